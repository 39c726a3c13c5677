"""make_training_model: every loss and optimizer against torch, trainable/frozen selection, the spec's
structure (Gradient xs, update/initialization bindings, counter), and the errors it raises."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import TrainingBuilderError, TrainingSession, UnsupportedOperatorError, build_step_model, lower
from onnx_autodiff.training import (
    PREVIEW,
    LossSpec,
    OptimizerSpec,
    builder_record,
    make_training_model,
    select_trainable,
)

F = TensorProto.FLOAT
PARAMS = ["W1", "B1", "W2", "B2"]


def weights(n_in=4, hidden=8, n_out=3, seed=0):
    rng = np.random.default_rng(seed)
    return {"W1": (rng.normal(size=(n_in, hidden)) * 0.5).astype(np.float32),
            "B1": (rng.normal(size=(hidden,)) * 0.1).astype(np.float32),
            "W2": (rng.normal(size=(hidden, n_out)) * 0.5).astype(np.float32),
            "B2": (rng.normal(size=(n_out,)) * 0.1).astype(np.float32)}


def mlp(w=None, head=None, n_out=3, extra_outputs=()):
    """X -> Gemm/Relu/Gemm -> Z, then an optional head op (LogSoftmax, Sigmoid) -> Y."""
    w = w or weights(n_out=n_out)
    nodes = [helper.make_node("Gemm", ["X", "W1", "B1"], ["H"], name="fc1"),
             helper.make_node("Relu", ["H"], ["A"], name="relu"),
             helper.make_node("Gemm", ["A", "W2", "B2"], ["Z"], name="fc2")]
    last = "Z"
    if head:
        nodes.append(helper.make_node(head, ["Z"], ["Y"], name="head"))
        last = "Y"
    outputs = [helper.make_tensor_value_info(last, F, ["N", n_out])]
    outputs += [helper.make_tensor_value_info(o, F, None) for o in extra_outputs]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("X", F, ["N", 4])], outputs,
                          [numpy_helper.from_array(w[p], p) for p in PARAMS])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def torch_forward(params, x, head=None):
    h = torch.relu(x @ params["W1"] + params["B1"])
    z = h @ params["W2"] + params["B2"]
    if head == "LogSoftmax":
        return torch.log_softmax(z, dim=1)
    if head == "Sigmoid":
        return torch.sigmoid(z)
    return z


def batches(n, batch=16, seed=1, kind="class", n_out=3):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(size=(batch, 4)).astype(np.float32)
        if kind == "class":
            t = np.argmax(x[:, :n_out], axis=1).astype(np.int64)
        elif kind == "binary":
            t = (rng.random(size=(batch, n_out)) < 0.5).astype(np.float32)
        else:
            t = rng.normal(size=(batch, n_out)).astype(np.float32)
        out.append((x, t))
    return out


TORCH_OPT = {
    "sgd": lambda p, lr, o: torch.optim.SGD(p, lr=lr, weight_decay=o.get("weight_decay", 0.0)),
    "momentum": lambda p, lr, o: torch.optim.SGD(p, lr=lr, momentum=o["momentum"], dampening=o["dampening"],
                                                 weight_decay=o["weight_decay"]),
    "nesterov": lambda p, lr, o: torch.optim.SGD(p, lr=lr, momentum=o["momentum"], nesterov=True,
                                                 weight_decay=o["weight_decay"]),
    "adagrad": lambda p, lr, o: torch.optim.Adagrad(p, lr=lr, lr_decay=o["lr_decay"], eps=o["eps"],
                                                    weight_decay=o["weight_decay"]),
    "adam": lambda p, lr, o: torch.optim.Adam(p, lr=lr, betas=o["betas"], eps=o["eps"], weight_decay=o["weight_decay"]),
    "adamw": lambda p, lr, o: torch.optim.AdamW(p, lr=lr, betas=o["betas"], eps=o["eps"],
                                                weight_decay=o["weight_decay"]),
}
OPTIONS = {
    "sgd": {"weight_decay": 0.01},
    "momentum": {"momentum": 0.8, "dampening": 0.1, "weight_decay": 0.01},
    "nesterov": {"momentum": 0.9, "dampening": 0.0, "weight_decay": 0.01},
    "adagrad": {"lr_decay": 0.05, "eps": 1e-10, "weight_decay": 0.01},
    "adam": {"betas": (0.8, 0.95), "eps": 1e-8, "weight_decay": 0.01},
    "adamw": {"betas": (0.85, 0.99), "eps": 1e-8, "weight_decay": 0.1},
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_optimizer_matches_torch_with_a_learning_rate_schedule(name):
    """12 steps with a decaying learning rate fed through the ``learning_rate`` input, vs torch.optim."""
    w = weights()
    data = batches(12)
    lrs = [0.05 * 0.9 ** k for k in range(len(data))]
    sess = TrainingSession(make_training_model(mlp(w), "cross_entropy", OptimizerSpec(name, OPTIONS[name]), lr=0.05))
    losses = [float(sess.step({"X": x, "labels": t, "learning_rate": np.float32(lr)})["loss"])
              for (x, t), lr in zip(data, lrs)]

    params = {p: torch.tensor(w[p], requires_grad=True) for p in PARAMS}
    opt = TORCH_OPT[name](list(params.values()), lrs[0], OPTIONS[name])
    ref = []
    for (x, t), lr in zip(data, lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(torch_forward(params, torch.tensor(x)), torch.tensor(t))
        loss.backward()
        opt.step()
        ref.append(loss.item())
    np.testing.assert_allclose(losses, ref, rtol=1e-4)
    for p in PARAMS:
        np.testing.assert_allclose(sess.state[p], params[p].detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=p)
        assert np.abs(sess.state[p] - w[p]).max() > 1e-3  # every weight moved
    assert int(sess.state[builder_record(sess.model)["iteration"]]) == 12


def _torch_loss(kind, y, t):
    nnf = torch.nn.functional
    return {"cross_entropy": lambda: nnf.cross_entropy(y, t), "nll": lambda: nnf.nll_loss(y, t),
            "mse": lambda: nnf.mse_loss(y, t), "l1": lambda: nnf.l1_loss(y, t),
            "bce": lambda: nnf.binary_cross_entropy(y, t),
            "bce_with_logits": lambda: nnf.binary_cross_entropy_with_logits(y, t)}[kind]()


LOSS_CASES = [("cross_entropy", None, "class"), ("nll", "LogSoftmax", "class"), ("mse", None, "real"),
              ("l1", None, "real"), ("bce", "Sigmoid", "binary"), ("bce_with_logits", None, "binary")]


@pytest.mark.parametrize("kind,head,data_kind", LOSS_CASES)
def test_loss_value_and_gradient_match_torch(kind, head, data_kind):
    """SGD with lr = 1: the loss is torch's and W - W_new is torch's gradient."""
    w = weights()
    (x, t), = batches(1, kind=data_kind)
    sess = TrainingSession(make_training_model(mlp(w, head), kind, "sgd"))
    out = sess.step({"X": x, "labels": t, "learning_rate": np.float32(1.0)})
    params = {p: torch.tensor(w[p], requires_grad=True) for p in PARAMS}
    loss = _torch_loss(kind, torch_forward(params, torch.tensor(x), head), torch.tensor(t))
    loss.backward()
    np.testing.assert_allclose(out["loss"], loss.item(), rtol=1e-5)
    for p in PARAMS:
        np.testing.assert_allclose(w[p] - sess.state[p], params[p].grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=p)


def quartic_loss_graph():
    """A user loss: mean((y - t)^4) + 0.5, with an initializer of its own."""
    nodes = [helper.make_node("Sub", ["y", "t"], ["d"]), helper.make_node("Mul", ["d", "d"], ["d2"]),
             helper.make_node("Mul", ["d2", "d2"], ["d4"]), helper.make_node("ReduceMean", ["d4"], ["m"], keepdims=0),
             helper.make_node("Add", ["m", "half"], ["out"])]
    return helper.make_graph(nodes, "quartic", [helper.make_tensor_value_info("y", F, ["N", 3]),
                                                helper.make_tensor_value_info("t", F, ["N", 3])],
                             [helper.make_tensor_value_info("out", F, [])],
                             [numpy_helper.from_array(np.array(0.5, np.float32), "half")])


def test_user_loss_graph():
    w = weights()
    (x, t), = batches(1, kind="real")
    model = make_training_model(mlp(w), quartic_loss_graph(), "sgd")
    alg = model.training_info[0].algorithm
    assert [i.name for i in alg.input] == ["labels", "learning_rate"]
    sess = TrainingSession(model)
    out = sess.step({"X": x, "labels": t, "learning_rate": np.float32(1.0)})
    params = {p: torch.tensor(w[p], requires_grad=True) for p in PARAMS}
    loss = ((torch_forward(params, torch.tensor(x)) - torch.tensor(t)) ** 4).mean() + 0.5
    loss.backward()
    np.testing.assert_allclose(out["loss"], loss.item(), rtol=1e-5)
    for p in PARAMS:
        np.testing.assert_allclose(w[p] - sess.state[p], params[p].grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=p)


def test_weighted_sum_over_two_outputs():
    """Z gets cross-entropy (weight 1), H (the hidden pre-activation, not a graph output) MSE with weight 0.25."""
    w = weights()
    (x, t), = batches(1)
    h_target = np.random.default_rng(5).normal(size=(16, 8)).astype(np.float32)
    loss = LossSpec({"Z": "cross_entropy", "H": "mse"}, label={"Z": "digits", "H": "h_target"}, weights={"H": 0.25})
    model = make_training_model(mlp(w), loss, "sgd")
    assert builder_record(model)["labels"] == ["digits", "h_target"]
    sess = TrainingSession(model)
    out = sess.step({"X": x, "digits": t, "h_target": h_target, "learning_rate": np.float32(1.0)})
    params = {p: torch.tensor(w[p], requires_grad=True) for p in PARAMS}
    xt = torch.tensor(x)
    h = xt @ params["W1"] + params["B1"]
    z = torch.relu(h) @ params["W2"] + params["B2"]
    loss = (torch.nn.functional.cross_entropy(z, torch.tensor(t))
            + 0.25 * torch.nn.functional.mse_loss(h, torch.tensor(h_target)))
    loss.backward()
    np.testing.assert_allclose(out["loss"], loss.item(), rtol=1e-5)
    for p in PARAMS:
        np.testing.assert_allclose(w[p] - sess.state[p], params[p].grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=p)


# ---- structure ----------------------------------------------------------------------------------

def test_spec_structure():
    model = make_training_model(mlp(), "cross_entropy", "adam", lr=0.01)
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version >= 7 and any(o.domain == PREVIEW for o in model.opset_import)
    assert len(model.graph.node) == 3  # the inference graph is unchanged
    ti = model.training_info[0]
    grad = [n for n in ti.algorithm.node if n.op_type == "Gradient"]
    assert len(grad) == 1 and grad[0].domain == PREVIEW
    attrs = {a.name: helper.get_attribute_value(a) for a in grad[0].attribute}
    assert [x.decode() for x in attrs["xs"]] == PARAMS and attrs["y"] == b"loss"
    assert [n.op_type for n in ti.algorithm.node if n.domain == PREVIEW] == ["Gradient", "Adam"]
    rec = builder_record(model)
    update = {b.key: b.value for b in ti.update_binding}
    init = {b.key: b.value for b in ti.initialization_binding}
    assert set(PARAMS) < set(update) and rec["iteration"] in update
    # the optimizer state and the counter are reset by the initialization graph, the weights are not
    assert set(init) == set(update) - set(PARAMS)
    lr_input = [i for i in ti.algorithm.input if i.name == rec["learning_rate"]][0]
    assert lr_input.type.tensor_type.elem_type == F and len(lr_input.type.tensor_type.shape.dim) == 0
    assert rec["lr"] == 0.01 and rec["loss"] == "loss"


def test_initialization_resets_optimizer_state():
    w = weights()
    sess = TrainingSession(make_training_model(mlp(w), "cross_entropy", "adam"))
    for x, t in batches(3):
        sess.step({"X": x, "labels": t, "learning_rate": np.float32(0.01)})
    state = [k for k in sess.state if k not in PARAMS]
    assert any(np.abs(sess.state[k]).max() > 0 for k in state)
    sess.reset()
    for k in state:
        assert not np.any(sess.state[k]), k
    np.testing.assert_array_equal(sess.state["W1"], w["W1"])


def test_frozen_layers_get_no_backward_and_stay_bit_identical():
    w = weights()
    model = make_training_model(mlp(w), "cross_entropy", "adam", trainable=["*2"])
    grad = [n for n in model.training_info[0].algorithm.node if n.op_type == "Gradient"][0]
    assert [x.decode() for x in helper.get_attribute_value(grad.attribute[0])] == ["W2", "B2"]
    step = build_step_model(lower(model))
    backward = [n.name for n in step.graph.node if "/grad" in n.name]
    assert backward and not [n for n in backward if n.startswith(("fc1/", "relu/"))], backward
    assert {i.name for i in step.graph.input} >= {"W2", "B2"}
    assert not {"W1", "B1"} & {i.name for i in step.graph.input}
    sess = TrainingSession(model)
    for x, t in batches(5):
        sess.step({"X": x, "labels": t, "learning_rate": np.float32(0.05)})
    inf = sess.inference_model()
    trained = {t.name: numpy_helper.to_array(t) for t in inf.graph.initializer}
    assert trained["W1"].tobytes() == w["W1"].tobytes() and trained["B1"].tobytes() == w["B1"].tobytes()
    assert not np.array_equal(trained["W2"], w["W2"])


def test_selection_patterns_and_defaults():
    m = mlp()
    assert select_trainable(m) == PARAMS
    assert select_trainable(m, frozen="W*") == ["B1", "B2"]
    assert select_trainable(m, trainable=["B?", "W1"]) == ["W1", "B1", "B2"]
    # an initializer the output does not depend on and BatchNormalization running statistics are left out
    g = m.graph
    g.initializer.append(numpy_helper.from_array(np.ones(3, np.float32), "unused"))
    for name, val in [("scale", 1.0), ("bias", 0.0), ("mean", 0.0), ("var", 1.0)]:
        g.initializer.append(numpy_helper.from_array(np.full(3, val, np.float32), name))
    g.node.append(helper.make_node("BatchNormalization", ["Z", "scale", "bias", "mean", "var"], ["Zn"], name="bn"))
    g.output[0].name = "Zn"
    assert select_trainable(m) == PARAMS + ["scale", "bias"]


# ---- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,field,words", [
    ({"loss": "hinge"}, "loss", "unknown loss 'hinge'"),
    ({"optimizer": "lamb"}, "optimizer", "unknown optimizer 'lamb'"),
    ({"optimizer": OptimizerSpec("adam", {"momentum": 0.9})}, "OptimizerSpec.options",
     "adam has no option 'momentum'"),
    ({"trainable": ["fc9.*"]}, "trainable", "'fc9.*' matches no float initializer"),
    ({"frozen": ["*"]}, "trainable", "no initializer is left to train"),
    ({"frozen": ["nope"]}, "frozen", "'nope' matches no float initializer"),
    ({"loss": LossSpec("mse", label_shape=["N", 4])}, "LossSpec.label_shape", "needs [N, 3]"),
    ({"loss": LossSpec("cross_entropy", label_shape=["N", 3])}, "LossSpec.label_shape", "needs [N]"),
    ({"loss": LossSpec(outputs="nothing")}, "LossSpec.outputs", "'nothing' is not a tensor"),
    ({"loss": LossSpec(label="X")}, "LossSpec.label", "'X' is already a name"),
    ({"lr": float("nan")}, "lr", "finite"),
])
def test_builder_errors_name_the_field(kwargs, field, words):
    with pytest.raises(TrainingBuilderError) as e:
        make_training_model(mlp(), **kwargs)
    assert e.value.field == field
    group, _, attr = field.partition(".")
    where = f"({group}({attr}=...))" if attr else f"({field}=...)"
    assert words in str(e.value) and f"make_training_model{where}" in str(e.value)


def test_cross_entropy_needs_class_scores():
    g = mlp().graph
    g.node.append(helper.make_node("ReduceSum", ["Z", "axis"], ["S"], name="sum", keepdims=0))
    g.initializer.append(numpy_helper.from_array(np.array([1], np.int64), "axis"))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(TrainingBuilderError, match=r"class scores of shape \[N, C, ...\]; output 'S' has shape \[N\]"):
        make_training_model(m, LossSpec("cross_entropy", outputs="S"))


def test_an_untyped_output_of_a_custom_op_names_the_op_and_the_fix():
    g = mlp().graph
    g.node.append(helper.make_node("Scale", ["Z"], ["logits"], name="my_scale", domain="my.ops"))
    del g.output[:]
    g.output.append(helper.make_empty_tensor_value_info("logits"))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.ops", 1)])
    with pytest.raises(TrainingBuilderError) as e:
        make_training_model(m, "mse")
    assert e.value.field == "LossSpec.outputs"
    for words in ("output 0 of node 'my_scale'", "op 'Scale', domain 'my.ops'", "graph.value_info",
                  "make_tensor_value_info('logits'"):
        assert words in str(e.value), str(e.value)


def test_user_loss_graph_checks():
    bad = quartic_loss_graph()
    bad.input[0].type.tensor_type.shape.dim[1].dim_value = 5
    with pytest.raises(TrainingBuilderError,
                       match=r"loss graph input 'y' has shape \[N, 5\] but output 'Z' has shape \[N, 3\]"):
        make_training_model(mlp(), bad)
    one_input = quartic_loss_graph()
    del one_input.input[1]
    with pytest.raises(TrainingBuilderError, match="takes 2 inputs"):
        make_training_model(mlp(), one_input)


def test_existing_training_info_is_refused():
    model = make_training_model(mlp())
    with pytest.raises(TrainingBuilderError, match="already has training_info"):
        make_training_model(model)


def test_unsupported_op_fails_at_build_time():
    g = mlp().graph
    g.initializer.append(numpy_helper.from_array(np.eye(3, dtype=np.float32) * 2, "M"))
    g.node.extend([helper.make_node("Det", ["M"], ["d"], name="det"),
                   helper.make_node("Mul", ["Z", "d"], ["Zd"], name="scale")])
    g.output[0].name = "Zd"
    with pytest.raises(UnsupportedOperatorError, match="'det': op 'Det'"):
        make_training_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), "mse")
    # frozen, the Det input needs no gradient and the model trains
    model = make_training_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), "mse", frozen="M")
    assert json.loads(model.metadata_props[-1].value)["trainable"] == PARAMS
    lower(model)


def test_a_path_keeps_the_weights_in_their_file_and_trains_as_the_proto(tmp_path, monkeypatch):
    """A large model (here: past a limit lowered to 0) from a path keeps its weights in its files
    (external-data references) and its optimizer's fresh state as sparse zeros; from the loaded ModelProto its
    weights are inline; both train to the same bits."""
    from onnx_autodiff.errors import ModelTypeError
    from onnx_autodiff.model import carrier
    from onnx_autodiff.model.io import save_model_atomic

    monkeypatch.setattr(carrier, "INLINE_LIMIT", 0)
    inference = mlp(weights(hidden=300))  # weights of more than 1 KiB leave the protobuf
    path = tmp_path / "mlp.onnx"
    save_model_atomic(inference, path, external_data_threshold=0)
    by_path = make_training_model(str(path), "cross_entropy", "adam", lr=0.05)
    by_proto = make_training_model(inference, "cross_entropy", "adam", lr=0.05)
    external = [t.name for t in by_path.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert external == ["W1", "B1", "W2"] and not any(t.data_location for t in by_proto.graph.initializer)
    assert len(by_proto.training_info[0].algorithm.sparse_initializer) == 6  # zeros: no bytes either way
    zeros = by_path.training_info[0].algorithm.sparse_initializer  # Adam's two moments of each large weight
    assert len(zeros) == 6 and all(s.values.dims[0] == 0 for s in zeros)
    a, b = TrainingSession(by_proto, progress=False), TrainingSession(by_path, progress=False)
    for x, t in batches(3):
        np.testing.assert_array_equal(a.step({"X": x, "labels": t})["loss"], b.step({"X": x, "labels": t})["loss"])
    with pytest.raises(ModelTypeError, match="int; expected the path"):
        make_training_model(42)
