"""The training spec end to end: a TrainingInfoProto model written only with onnx.helper (Gemm/Relu MLP,
SoftmaxCrossEntropyLoss, Gradient, Adam with an iteration counter, RandomNormal initialization) trains
through TrainingSession, matches torch.optim.Adam, and runs as a plain step model in stock onnxruntime."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import TrainingSession, TrainingSpecError, build_init_model, build_step_model, lower
from onnx_autodiff.graph import TRAINING_DOMAINS
from tests.models import model_of

PREVIEW = "ai.onnx.preview.training"
PARAMS = ["W1", "B1", "W2", "B2"]
F = TensorProto.FLOAT


def mlp_weights(n_in=4, hidden=8, n_out=3, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "W1": (rng.normal(size=(n_in, hidden)) * 0.5).astype(np.float32),
        "B1": (rng.normal(size=(hidden,)) * 0.1).astype(np.float32),
        "W2": (rng.normal(size=(hidden, n_out)) * 0.5).astype(np.float32),
        "B2": (rng.normal(size=(n_out,)) * 0.1).astype(np.float32),
    }


def mlp_training_model(weights=None, lr=0.01, alpha=0.9, beta=0.999, epsilon=1e-8, n_in=4, hidden=8, n_out=3,
                       init_std=0.5, gemm=True):
    """The spec-conformant training model, built with onnx.helper only."""
    w = weights or mlp_weights(n_in, hidden, n_out)
    if gemm:
        nodes = [helper.make_node("Gemm", ["X", "W1", "B1"], ["H1"], name="fc1"),
                 helper.make_node("Relu", ["H1"], ["A1"], name="relu1"),
                 helper.make_node("Gemm", ["A1", "W2", "B2"], ["Y"], name="fc2")]
    else:
        nodes = [helper.make_node("MatMul", ["X", "W1"], ["M1"], name="mm1"),
                 helper.make_node("Add", ["M1", "B1"], ["H1"], name="add1"),
                 helper.make_node("Relu", ["H1"], ["A1"], name="relu1"),
                 helper.make_node("MatMul", ["A1", "W2"], ["M2"], name="mm2"),
                 helper.make_node("Add", ["M2", "B2"], ["Y"], name="add2")]
    inference = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("X", F, ["batch", n_in])],
        [helper.make_tensor_value_info("Y", F, ["batch", n_out])],
        [numpy_helper.from_array(w[p], p) for p in PARAMS])

    grads = [f"{p}_grad" for p in PARAMS]
    moments = [f"{p}_V" for p in PARAMS]
    squares = [f"{p}_H" for p in PARAMS]
    alg_nodes = [
        helper.make_node("SoftmaxCrossEntropyLoss", ["Y", "labels"], ["loss"], name="xent", reduction="mean"),
        helper.make_node("Gradient", PARAMS, grads, name="grad", domain=PREVIEW, xs=PARAMS, y="loss"),
        helper.make_node("Adam", ["lr", "T"] + PARAMS + grads + moments + squares,
                         [f"{p}_new" for p in PARAMS] + [f"{m}_new" for m in moments] + [f"{s}_new" for s in squares],
                         name="adam", domain=PREVIEW, alpha=alpha, beta=beta, epsilon=epsilon),
        helper.make_node("Add", ["T", "one"], ["T_new"], name="count"),
    ]
    alg_inits = [numpy_helper.from_array(np.array(lr, np.float32), "lr"),
                 numpy_helper.from_array(np.array(1, np.int64), "T"),
                 numpy_helper.from_array(np.array(1, np.int64), "one")]
    alg_inits += [numpy_helper.from_array(np.zeros_like(w[p]), n) for p in PARAMS for n in (f"{p}_V", f"{p}_H")]
    bound = [f"{p}_new" for p in PARAMS] + [f"{m}_new" for m in moments] + [f"{s}_new" for s in squares] + ["T_new"]
    algorithm = helper.make_graph(
        alg_nodes, "mlp_train", [helper.make_tensor_value_info("labels", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("loss", F, [])] + [helper.make_tensor_value_info(n, F, None) for n in bound[:-1]]
        + [helper.make_tensor_value_info("T_new", TensorProto.INT64, [])],
        alg_inits)
    update = [(p, f"{p}_new") for p in PARAMS] + [(m, f"{m}_new") for m in moments + squares] + [("T", "T_new")]

    init_nodes = [
        helper.make_node("RandomNormal", [], ["W1_init"], name="rand1", shape=[n_in, hidden], scale=init_std),
        helper.make_node("RandomNormal", [], ["W2_init"], name="rand2", shape=[hidden, n_out], scale=init_std),
        helper.make_node("Constant", [], ["T_init"], name="t0", value=numpy_helper.from_array(np.array(1, np.int64))),
    ]
    initialization = helper.make_graph(
        init_nodes, "mlp_init", [],
        [helper.make_tensor_value_info("W1_init", F, [n_in, hidden]),
         helper.make_tensor_value_info("W2_init", F, [hidden, n_out]),
         helper.make_tensor_value_info("T_init", TensorProto.INT64, [])])
    ti = helper.make_training_info(algorithm, update, initialization,
                                   [("W1", "W1_init"), ("W2", "W2_init"), ("T", "T_init")])
    model = model_of(inference, training=True)
    model.training_info.append(ti)
    return model


def toy_data(steps, batch=16, n_in=4, n_out=3, seed=1):
    """A learnable problem: the label is the argmax of a fixed linear map of X."""
    rng = np.random.default_rng(seed)
    proj = rng.normal(size=(n_in, n_out))
    out = []
    for _ in range(steps):
        x = rng.normal(size=(batch, n_in)).astype(np.float32)
        out.append({"X": x, "labels": np.argmax(x @ proj, axis=1).astype(np.int64)})
    return out


def torch_adam_run(weights, batches, lr=0.01, betas=(0.9, 0.999), eps=1e-8):
    params = {p: torch.tensor(weights[p], requires_grad=True) for p in PARAMS}
    opt = torch.optim.Adam(params.values(), lr=lr, betas=betas, eps=eps)
    losses = []
    for b in batches:
        opt.zero_grad()
        x = torch.tensor(b["X"])
        h = torch.relu(x @ params["W1"] + params["B1"])
        loss = torch.nn.functional.cross_entropy(h @ params["W2"] + params["B2"], torch.tensor(b["labels"]))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {p: v.detach().numpy() for p, v in params.items()}


# ---- lowering ----------------------------------------------------------------------------------------

def test_lowered_training_info_is_plain_and_checks():
    low = lower(mlp_training_model())
    assert len(low.training_info) == 1
    for g in (low.graph, low.training_info[0].algorithm, low.training_info[0].initialization):
        assert not [n for n in g.node if n.domain in TRAINING_DOMAINS]
    assert PREVIEW not in {o.domain for o in low.opset_import}
    assert low.ir_version <= 13
    onnx.checker.check_model(low, full_check=True)
    # the inference graph is unchanged
    assert [n.name for n in low.graph.node] == ["fc1", "relu1", "fc2"]


@pytest.mark.parametrize("gemm", [True, False])
def test_step_model_contract(gemm):
    model = mlp_training_model(gemm=gemm)
    step = build_step_model(lower(model))
    onnx.checker.check_model(step, full_check=True)
    assert step.ir_version <= 13
    assert not [n for n in step.graph.node if n.domain in TRAINING_DOMAINS]
    binding = json.loads({p.key: p.value for p in step.metadata_props}["onnx_autodiff.update_binding"])
    assert binding == {b.key: b.value for b in model.training_info[0].update_binding}
    inputs = {i.name for i in step.graph.input}
    outputs = {o.name for o in step.graph.output}
    inits = {t.name: t for t in step.graph.initializer}
    for key, value in binding.items():
        assert key in inputs and key in inits
        assert value in outputs
    # the stored initializer is the default of the lifted input
    np.testing.assert_array_equal(numpy_helper.to_array(inits["W1"]), mlp_weights()["W1"])
    ort.InferenceSession(step.SerializeToString(), providers=["CPUExecutionProvider"])


def test_init_model_contract():
    init = build_init_model(lower(mlp_training_model()))
    onnx.checker.check_model(init, full_check=True)
    assert len(init.graph.input) == 0
    binding = json.loads({p.key: p.value for p in init.metadata_props}["onnx_autodiff.initialization_binding"])
    assert binding == {"W1": "W1_init", "W2": "W2_init", "T": "T_init"}
    sess = ort.InferenceSession(init.SerializeToString(), providers=["CPUExecutionProvider"])
    w1, w2, t = sess.run(["W1_init", "W2_init", "T_init"], {})
    assert w1.shape == (4, 8) and w2.shape == (8, 3) and t == 1
    assert 0.2 < w1.std() < 1.0  # RandomNormal(scale=0.5)


# ---- training ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("gemm", [True, False])
def test_matches_torch_adam_for_20_steps(gemm):
    """ONNX Adam with T starting at 1 is torch.optim.Adam up to where epsilon sits (see docs/training.md)."""
    weights = mlp_weights()
    batches = toy_data(20)
    sess = TrainingSession(mlp_training_model(weights, gemm=gemm))
    losses = sess.train(batches, progress=False)
    ref_losses, ref_weights = torch_adam_run(weights, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    for p in PARAMS:
        np.testing.assert_allclose(sess.state[p], ref_weights[p], rtol=1e-4, atol=1e-6, err_msg=p)
    assert int(sess.state["T"]) == 21
    # and it really moved: 20 Adam steps of lr 0.01 change every weight
    assert all(np.abs(sess.state[p] - weights[p]).max() > 1e-3 for p in PARAMS)


def test_loss_falls_from_random_initialization():
    sess = TrainingSession(mlp_training_model())
    sess.reset()
    assert int(sess.state["T"]) == 1
    assert not np.array_equal(sess.state["W1"], mlp_weights()["W1"])  # RandomNormal replaced it
    batches = toy_data(50, batch=32)
    losses = sess.train(batches, epochs=4, progress=False)
    assert len(losses) == 200
    assert np.mean(losses[-20:]) < 0.6 * np.mean(losses[:20])


def test_hand_written_loop_with_plain_onnxruntime():
    """Only build_step_model + stock onnxruntime + a loop that feeds the bound outputs back."""
    weights = mlp_weights()
    batches = toy_data(20)
    step = build_step_model(lower(mlp_training_model(weights)))
    binding = json.loads({p.key: p.value for p in step.metadata_props}["onnx_autodiff.update_binding"])
    sess = ort.InferenceSession(step.SerializeToString(), providers=["CPUExecutionProvider"])
    state = {t.name: numpy_helper.to_array(t) for t in step.graph.initializer if t.name in binding}
    outputs = [o.name for o in sess.get_outputs()]
    losses = []
    for b in batches:
        got = dict(zip(outputs, sess.run(outputs, {**b, **state})))
        state = {k: got[v] for k, v in binding.items()}
        losses.append(float(got["loss"]))
    ref_losses, ref_weights = torch_adam_run(weights, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    for p in PARAMS:
        np.testing.assert_allclose(state[p], ref_weights[p], rtol=1e-4, atol=1e-6)
    # a runtime that feeds nothing for the state gets the stored initializers (step 1 again)
    first = dict(zip(outputs, sess.run(outputs, batches[0])))
    np.testing.assert_allclose(float(first["loss"]), ref_losses[0], rtol=1e-5)


# ---- TrainingSpecError, one test per case ----------------------------------------------------------------

def _with_binding(model, field, pairs, index=0):
    ti = model.training_info[index]
    getattr(ti, field).extend(onnx.StringStringEntryProto(key=k, value=v) for k, v in pairs)
    return model


def test_error_key_used_twice_across_update_bindings():
    model = mlp_training_model()
    extra = helper.make_training_info(
        helper.make_graph([helper.make_node("Identity", ["W1"], ["W1_copy"])], "other", [],
                          [helper.make_tensor_value_info("W1_copy", F, [4, 8])]),
        [("W1", "W1_copy")], None, None)
    model.training_info.append(extra)
    with pytest.raises(TrainingSpecError, match=r"training_info\[1\]\.update_binding.*'W1'.*training_info\[0\]"):
        build_step_model(model)


def test_error_key_not_an_initializer():
    model = _with_binding(mlp_training_model(), "update_binding", [("X", "loss")])
    with pytest.raises(TrainingSpecError, match=r"update_binding: key 'X' is not an initializer"):
        build_step_model(model)


def test_error_value_not_an_output():
    model = mlp_training_model()
    del model.training_info[0].update_binding[0]
    _with_binding(model, "update_binding", [("W1", "H1")])
    with pytest.raises(TrainingSpecError, match=r"update_binding: value 'H1'.*not an output"):
        build_step_model(model)


def test_error_initialization_graph_with_inputs():
    model = mlp_training_model()
    model.training_info[0].initialization.input.append(helper.make_tensor_value_info("seed", F, []))
    with pytest.raises(TrainingSpecError, match=r"initialization\.input"):
        build_init_model(model)


def test_error_initialization_binding_value_not_an_output():
    model = _with_binding(mlp_training_model(), "initialization_binding", [("B1", "nowhere")])
    with pytest.raises(TrainingSpecError, match=r"initialization_binding: value 'nowhere'"):
        build_init_model(model)


def test_error_initialization_binding_key_not_an_initializer():
    model = _with_binding(mlp_training_model(), "initialization_binding", [("labels", "W1_init")])
    with pytest.raises(TrainingSpecError, match=r"initialization_binding: key 'labels'"):
        build_init_model(model)


def test_error_names_collide_between_graphs():
    model = mlp_training_model()
    model.training_info[0].algorithm.initializer.append(numpy_helper.from_array(np.zeros(3, np.float32), "B2"))
    with pytest.raises(TrainingSpecError, match=r"algorithm: 'B2' \(initializer\) is also defined by the inference"):
        build_step_model(model)


def test_error_node_output_collides_with_inference_tensor():
    model = mlp_training_model()
    model.training_info[0].algorithm.node.append(helper.make_node("Identity", ["loss"], ["H1"]))
    with pytest.raises(TrainingSpecError, match=r"'H1' \(output of node"):
        build_step_model(model)


def test_error_missing_training_info_index():
    with pytest.raises(TrainingSpecError, match=r"training_info\[3\] does not exist"):
        build_step_model(mlp_training_model(), index=3)


def test_error_key_in_another_training_infos_algorithm():
    """Keys may name initializers of the same TrainingInfoProto's algorithm only."""
    model = mlp_training_model()
    extra = helper.make_training_info(
        helper.make_graph([helper.make_node("Identity", ["lr"], ["lr2"])], "other", [],
                          [helper.make_tensor_value_info("lr2", F, [])]),
        [("lr", "lr2")], None, None)
    model.training_info.append(extra)
    with pytest.raises(TrainingSpecError, match=r"training_info\[1\]\.update_binding: key 'lr'"):
        build_step_model(model, index=1)
