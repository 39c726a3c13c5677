"""Function ops of opset 23 on the gradient path of a training model (RMSNormalization, RotaryEmbedding,
Attention: no rule, differentiated through their schema's body). The body that recomputes such a node goes
into the training algorithm, which runs concatenated with the inference graph: its last node wrote the
node's outputs a second time ("... is also defined by the inference graph"), and its shape arithmetic left
what followed without a rank. onnxruntime 1.32 has kernels for the three ops at opset 23 (float32; float64 too
for RMSNormalization and Attention), so the inference graph runs them natively; the algorithm runs their
bodies for the backward.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnx_autodiff import TrainingSession, gradcheck, lower, make_training_model
from onnx_autodiff.check.gradcheck import to_float64

B, S, H, HEADS = 2, 4, 8, 2
TRAIN = "ai.onnx.preview.training"


def _model(ops: str) -> onnx.ModelProto:
    """x [B, S, H] -> (RMSNormalization) -> q, k, v projections -> (RotaryEmbedding of q and k) ->
    (Attention, else q * k + v) -> y [B, S, 2], at opset 23, float32."""
    rng = np.random.default_rng(0)
    weight = lambda name, shape: numpy_helper.from_array(  # noqa: E731
        (0.4 * rng.standard_normal(shape)).astype(np.float32), name)
    inits = [weight("Wq", [H, H]), weight("Wk", [H, H]), weight("Wv", [H, H]), weight("Wo", [H, 2]),
             numpy_helper.from_array((1 + 0.1 * rng.standard_normal(H)).astype(np.float32), "gamma")]
    nodes, x = [], "x"
    if "rms" in ops:
        nodes.append(helper.make_node("RMSNormalization", ["x", "gamma"], ["xn"], axis=-1, epsilon=1e-5))
        x = "xn"
    nodes += [helper.make_node("MatMul", [x, w], [o]) for w, o in (("Wq", "q"), ("Wk", "k"), ("Wv", "v"))]
    q, k = "q", "k"
    if "rope" in ops:
        angles = np.arange(S)[:, None] * 0.5 ** np.arange(H // HEADS // 2)[None]
        inits += [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
                  numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin"),
                  numpy_helper.from_array(np.tile(np.arange(S), (B, 1)), "positions")]
        nodes += [helper.make_node("RotaryEmbedding", [t, "cos", "sin", "positions"], [f"{t}_rot"], num_heads=HEADS)
                  for t in (q, k)]
        q, k = "q_rot", "k_rot"
    if "attention" in ops:
        nodes.append(helper.make_node("Attention", [q, k, "v"], ["a"], q_num_heads=HEADS, kv_num_heads=HEADS))
    else:
        nodes += [helper.make_node("Mul", [q, k], ["qk"]), helper.make_node("Add", ["qk", "v"], ["a"])]
    nodes.append(helper.make_node("MatMul", ["a", "Wo"], ["y"]))
    graph = helper.make_graph(nodes, "function_ops", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, S, H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, S, 2])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 11
    onnx.checker.check_model(model, full_check=True)
    return model


def _with_mse(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model in float64 with the loss make_training_model's "mse" computes, mean((y - labels)^2)."""
    m = to_float64(model)
    m.graph.input.append(helper.make_tensor_value_info("labels", TensorProto.DOUBLE, [B, S, 2]))
    m.graph.node.extend([helper.make_node("Sub", ["y", "labels"], ["d"]), helper.make_node("Mul", ["d", "d"], ["d2"]),
                         helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0)])
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info("loss", TensorProto.DOUBLE, []))
    return m


PARAMS = ["Wq", "Wk", "Wv", "Wo"]
OPS = ["rms", "rope", "attention", "rms+rope+attention"]


@pytest.mark.parametrize("ops", OPS)
def test_training_through_function_ops_matches_finite_differences(ops):
    model = _model(ops)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((B, S, H)).astype(np.float32),
             "labels": rng.standard_normal((B, S, 2)).astype(np.float32)}
    params = PARAMS + (["gamma"] if "rms" in ops else [])

    # the gradient of this loss, held against float64 central differences (RotaryEmbedding's schema has no
    # float64, so a model with it runs on onnx's reference evaluator: the float64 oracle of its maths)
    loss_model = _with_mse(model)
    report = gradcheck(loss_model, feeds, wrt=params, of="loss")
    assert report.ok and len(report.checks) == len(params), str(report)

    # the training session's gradients (its algorithm beside the inference graph) are that gradient
    session = TrainingSession(make_training_model(model, loss="mse", optimizer="sgd", lr=0.05, trainable=params))
    got = {k: v.numpy() for k, v in session.gradients(feeds).items()}
    grads = {n: f"{n}__grad" for n in params}
    loss_model.graph.node.append(helper.make_node("Gradient", params, list(grads.values()), domain=TRAIN,
                                                  xs=params, y="loss"))
    loss_model.graph.output.extend(helper.make_tensor_value_info(g, TensorProto.DOUBLE, None) for g in grads.values())
    loss_model.opset_import.append(helper.make_opsetid(TRAIN, 1))
    ref = dict(zip(grads, ReferenceEvaluator(lower(loss_model)).run(
        list(grads.values()), {k: v.astype(np.float64) for k, v in feeds.items()})))
    for name in params:
        found = [v for k, v in got.items() if name in k and v.shape == ref[name].shape]
        assert len(found) == 1, sorted(got)
        np.testing.assert_allclose(found[0], ref[name], rtol=2e-4, atol=2e-5 * np.abs(ref[name]).max())

    losses = [float(session.step(feeds)["loss"]) for _ in range(4)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
