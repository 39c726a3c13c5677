"""GraphCall (the training proposal's call of the inference graph): inlining, the global-initializer
fallback for empty inputs, gradients through the inlined copy, and the seeds' diagrams training."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import TrainingSession, TrainingSpecError, build_step_model, lower
from onnx_autodiff.graph import TRAINING_DOMAINS

F = TensorProto.FLOAT
PROPOSAL = "ai.onnx.training"
PREVIEW = "ai.onnx.preview.training"


def inference_graph(w, z_dim=3):
    """The diagram's inference graph: W -> Conv -> H -> Gemm -> Y, with inputs X, W (optional: it is a
    global initializer) and Z. Conv is 1x1 over a (N, C, 1, 1) input, i.e. a matmul by W."""
    nodes = [helper.make_node("Conv", ["X", "W"], ["H"], name="conv"),
             helper.make_node("Flatten", ["H"], ["Hf"], name="flat"),
             helper.make_node("Gemm", ["Hf", "Z"], ["Y"], name="gemm")]
    cout, cin = w.shape[:2]
    return helper.make_graph(
        nodes, "MyInferenceGraph",
        [helper.make_tensor_value_info("X", F, ["N", cin, 1, 1]),
         helper.make_tensor_value_info("W", F, list(w.shape)),
         helper.make_tensor_value_info("Z", F, [cout, z_dim])],
        [helper.make_tensor_value_info("Y", F, ["N", z_dim])],
        [numpy_helper.from_array(w, "W")])


def seed_model(w, w_input="", domain=PROPOSAL, graph_name="MyInferenceGraph", calls=1):
    """The singa #691 diagram: GraphCall(X_1, [W], Z_1) -> Y_1 -> Loss(Y_1, C) -> O,
    Gradient(xs=[W], zs=[X_1, Z_1, C], y=O), W_new = W - dO_dW / T, T_new = T + 1."""
    cout, cin = w.shape[:2]
    nodes, ins, losses = [], [], []
    for k in range(calls):
        s = f"_{k + 1}"
        nodes += [
            helper.make_node("GraphCall", [f"X{s}", w_input, f"Z{s}"], [f"Y{s}"], name=f"call{s}", domain=domain,
                             graph_name=graph_name),
            helper.make_node("Sub", [f"Y{s}", f"C{s}"], [f"D{s}"], name=f"diff{s}"),
            helper.make_node("Mul", [f"D{s}", f"D{s}"], [f"D2{s}"], name=f"sq{s}"),
            helper.make_node("ReduceMean", [f"D2{s}"], [f"O{s}"], name=f"mean{s}", keepdims=0),
        ]
        ins += [helper.make_tensor_value_info(f"X{s}", F, ["N", cin, 1, 1]),
                helper.make_tensor_value_info(f"Z{s}", F, [cout, 3]),
                helper.make_tensor_value_info(f"C{s}", F, ["N", 3])]
        losses.append(f"O{s}")
    if calls > 1:
        nodes.append(helper.make_node("Sum", losses, ["O"], name="total"))
    else:
        nodes.append(helper.make_node("Identity", losses, ["O"], name="total"))
    zs = [n.name for n in ins]
    nodes += [
        helper.make_node("Gradient", ["W"] + zs, ["dO_dW"], name="grad", domain=domain, xs=["W"], zs=zs, y="O"),
        helper.make_node("Div", ["dO_dW", "T"], ["step"], name="div"),
        helper.make_node("Sub", ["W", "step"], ["W_new"], name="sub"),
        helper.make_node("Add", ["T", "one"], ["T_new"], name="count"),
    ]
    algorithm = helper.make_graph(
        nodes, "train", ins,
        [helper.make_tensor_value_info("O", F, []), helper.make_tensor_value_info("W_new", F, list(w.shape)),
         helper.make_tensor_value_info("T_new", F, [])],
        [numpy_helper.from_array(np.array(1.0, np.float32), "T"),
         numpy_helper.from_array(np.array(1.0, np.float32), "one")])
    ti = helper.make_training_info(algorithm, [("W", "W_new"), ("T", "T_new")], None, None)
    model = helper.make_model(inference_graph(w),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])
    model.ir_version = 10
    model.training_info.append(ti)
    return model


def data(rng, n=5, cin=2, cout=4):
    return (rng.normal(size=(n, cin, 1, 1)).astype(np.float32), rng.normal(size=(cout, 3)).astype(np.float32),
            rng.normal(size=(n, 3)).astype(np.float32))


def torch_step(w, t, batches):
    """One step of the diagram's algorithm in torch: W - dO/dW / T with O the summed mean squared errors."""
    wt = torch.tensor(w, requires_grad=True)
    total = 0
    for x, z, c in batches:
        y = torch.nn.functional.conv2d(torch.tensor(x), wt).flatten(1) @ torch.tensor(z)
        total = total + ((y - torch.tensor(c)) ** 2).mean()
    total.backward()
    return float(total.detach()), (wt - wt.grad / t).detach().numpy()


@pytest.mark.parametrize("domain", [PROPOSAL, PREVIEW])
def test_empty_input_falls_back_to_global_initializer(domain):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(4, 2, 1, 1)).astype(np.float32)
    low = lower(seed_model(w, domain=domain))
    alg = low.training_info[0].algorithm
    assert not [n for n in alg.node if n.domain in TRAINING_DOMAINS]
    conv = [n for n in alg.node if n.op_type == "Conv" and "/grad/" not in n.name]
    assert len(conv) == 1 and conv[0].input[1] == "W"  # the inlined copy reads the global W
    assert conv[0].name.startswith("call_1/") and conv[0].input[0] == "X_1"
    # the call's output keeps its name; the copy's intermediate tensors are fresh
    assert any(n.op_type == "Gemm" and n.output[0] == "Y_1" for n in alg.node)
    assert "H" not in {o for n in alg.node for o in n.output}


def test_seed_diagram_trains_and_matches_torch():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(4, 2, 1, 1)).astype(np.float32) * 0.3
    sess = TrainingSession(seed_model(w))
    # proposal style: the algorithm never reads the inference graph, so X / Z are not feeds
    assert sorted(sess.feed_names) == ["C_1", "X_1", "Z_1"]
    x, z, c = data(rng)
    c = (np.einsum("nc,oc->no", x[:, :, 0, 0], rng.normal(size=(4, 2))) @ z).astype(np.float32) * 0.5
    ref_w, t = w.copy(), 1.0
    losses = []
    for _ in range(15):
        out = sess.step({"X_1": x, "Z_1": z, "C_1": c})
        ref_loss, ref_w = torch_step(ref_w, t, [(x, z, c)])
        t += 1
        np.testing.assert_allclose(float(out["O"]), ref_loss, rtol=1e-5)
        losses.append(float(out["O"]))
    np.testing.assert_allclose(sess.state["W"], ref_w, rtol=1e-5, atol=1e-6)
    assert float(sess.state["T"]) == 16.0
    assert losses[-1] < 0.5 * losses[0]


def test_two_calls_share_the_global_weight():
    rng = np.random.default_rng(2)
    w = rng.normal(size=(4, 2, 1, 1)).astype(np.float32)
    model = seed_model(w, calls=2)
    low = lower(model)
    convs = [n for n in low.training_info[0].algorithm.node if n.op_type == "Conv" and "/grad/" not in n.name]
    assert len(convs) == 2 and {c.input[1] for c in convs} == {"W"}
    assert len({c.output[0] for c in convs}) == 2
    sess = TrainingSession(model)
    b1, b2 = data(rng), data(rng)
    feeds = {"X_1": b1[0], "Z_1": b1[1], "C_1": b1[2], "X_2": b2[0], "Z_2": b2[1], "C_2": b2[2]}
    out = sess.step(feeds)
    ref_loss, ref_w = torch_step(w, 1.0, [b1, b2])
    np.testing.assert_allclose(float(out["O"]), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(sess.state["W"], ref_w, rtol=1e-5, atol=1e-6)


def test_explicit_input_binds_by_position():
    """Passing a tensor for W binds it instead of the global; the gradient is then zero w.r.t. W."""
    rng = np.random.default_rng(3)
    w = rng.normal(size=(4, 2, 1, 1)).astype(np.float32)
    model = seed_model(w, w_input="W_other")
    alg = model.training_info[0].algorithm
    alg.initializer.append(numpy_helper.from_array(np.ones_like(w), "W_other"))
    sess = TrainingSession(model)
    x, z, c = data(rng)
    out = sess.step({"X_1": x, "Z_1": z, "C_1": c})
    y = np.einsum("nc,oc->no", x[:, :, 0, 0], np.ones((4, 2), np.float32)) @ z
    np.testing.assert_allclose(float(out["O"]), np.mean((y - c) ** 2), rtol=1e-5)
    np.testing.assert_array_equal(sess.state["W"], w)


def test_graph_name_must_name_the_inference_graph():
    w = np.ones((4, 2, 1, 1), np.float32)
    with pytest.raises(TrainingSpecError, match="graph_name 'Other' does not name the inference graph"):
        lower(seed_model(w, graph_name="Other"))


def test_missing_input_without_initializer_is_an_error():
    w = np.ones((4, 2, 1, 1), np.float32)
    model = seed_model(w)
    call = model.training_info[0].algorithm.node[0]
    call.input[2] = ""  # Z has no global initializer to fall back to
    with pytest.raises(TrainingSpecError, match=r"input 2 of graph 'MyInferenceGraph' \('Z'\) is not given"):
        lower(model)


def test_too_many_outputs_is_an_error():
    w = np.ones((4, 2, 1, 1), np.float32)
    model = seed_model(w)
    model.training_info[0].algorithm.node[0].output.append("extra")
    with pytest.raises(TrainingSpecError, match="outputs bind to the graph's outputs by position"):
        lower(model)


def test_step_model_of_graphcall_model_checks():
    w = np.ones((4, 2, 1, 1), np.float32)
    step = build_step_model(lower(seed_model(w)))
    onnx.checker.check_model(step, full_check=True)
    assert {i.name for i in step.graph.input} == {"X_1", "Z_1", "C_1", "W", "T"}
    assert "Y" not in {o.name for o in step.graph.output}
