"""Training-mode layers in a spec training model: BatchNormalization (training_mode=1) and Dropout
(training_mode=True) train through TrainingSession, and export_inference gives the eval-mode model.

The released spec keeps two graphs: ``ModelProto.graph`` is the inference graph (BatchNormalization
with training_mode=0 reading the running statistics, Dropout without training_mode, the identity), and
``TrainingInfoProto.algorithm`` holds the training forward over the same global initializers (batch
statistics, random masks), the loss, a Gradient node and a Momentum optimizer. The BatchNormalization
running mean/variance outputs are bound back to their initializers by update_binding, so they are
state the session carries from step to step.

The algorithm also returns each step's dropout mask, so torch float64 can replay the very same steps.
BatchNormalization here follows the ONNX schema: the running variance averages the biased batch
variance (torch averages the unbiased one), and the running statistics get momentum 0.9
(torch's momentum=0.1).
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import TrainingSession
from tests.models import model_of

PREVIEW = "ai.onnx.preview.training"
FLOAT = TensorProto.FLOAT
N, C_IN, L, C, K, CLASSES = 16, 2, 6, 4, 3, 3
L_OUT = L - K + 1
PARAMS = ["W", "B", "scale", "bias", "W2", "B2"]
STATS = ["running_mean", "running_var"]
RATIO, MOMENTUM, LR, ALPHA, EPS = 0.25, 0.9, 0.05, 0.9, 1e-5


def initial_values(seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    return {
        "W": f32(rng.normal(size=(C, C_IN, K)) * 0.5),
        "B": f32(rng.normal(size=C) * 0.1),
        "scale": f32(rng.uniform(0.8, 1.2, C)),
        "bias": f32(rng.normal(size=C) * 0.1),
        "W2": f32(rng.normal(size=(C * L_OUT, CLASSES)) * 0.3),
        "B2": f32(rng.normal(size=CLASSES) * 0.1),
        "running_mean": f32(rng.normal(size=C) * 0.1),
        "running_var": f32(rng.uniform(0.5, 1.5, C)),
    }


def forward_nodes(prefix: str, training: bool, x: str, out: str) -> list[onnx.NodeProto]:
    """Conv1d, BatchNormalization, Relu, Dropout, Flatten, Gemm over the global initializers."""
    p = prefix
    bn_out = [f"{p}bn"] + ([f"{p}running_mean_new", f"{p}running_var_new"] if training else [])
    drop_in = [f"{p}relu", "ratio"] + (["training_mode"] if training else [])
    drop_out = [f"{p}drop"] + ([f"{p}mask"] if training else [])
    return [
        helper.make_node("Conv", [x, "W", "B"], [f"{p}conv"], name=f"{p}conv"),
        helper.make_node("BatchNormalization", [f"{p}conv", "scale", "bias"] + STATS, bn_out, name=f"{p}bn",
                         epsilon=EPS, momentum=MOMENTUM, training_mode=int(training)),
        helper.make_node("Relu", [f"{p}bn"], [f"{p}relu"], name=f"{p}relu"),
        helper.make_node("Dropout", drop_in, drop_out, name=f"{p}dropout"),
        helper.make_node("Flatten", [f"{p}drop"], [f"{p}flat"], name=f"{p}flatten"),
        helper.make_node("Gemm", [f"{p}flat", "W2", "B2"], [out], name=f"{p}fc"),
    ]


def training_model(values=None) -> onnx.ModelProto:
    values = values or initial_values()
    inference = helper.make_graph(
        forward_nodes("", False, "X", "logits"), "bn_dropout",
        [helper.make_tensor_value_info("X", FLOAT, ["batch", C_IN, L])],
        [helper.make_tensor_value_info("logits", FLOAT, ["batch", CLASSES])],
        [numpy_helper.from_array(v, k) for k, v in values.items()]
        + [numpy_helper.from_array(np.array(RATIO, np.float32), "ratio")])

    grads = [f"{p}_grad" for p in PARAMS]
    moments = [f"{p}_V" for p in PARAMS]
    nodes = forward_nodes("train/", True, "X", "train/logits") + [
        helper.make_node("SoftmaxCrossEntropyLoss", ["train/logits", "labels"], ["loss"], name="xent"),
        helper.make_node("Gradient", PARAMS, grads, name="grad", domain=PREVIEW, xs=PARAMS, y="loss"),
        helper.make_node("Momentum", ["lr", "T"] + PARAMS + grads + moments,
                         [f"{p}_new" for p in PARAMS] + [f"{m}_new" for m in moments], name="momentum",
                         domain=PREVIEW, alpha=ALPHA, beta=1.0, norm_coefficient=0.0, mode="standard"),
        helper.make_node("Add", ["T", "one"], ["T_new"], name="count"),
    ]
    bound = [f"{p}_new" for p in PARAMS] + [f"{m}_new" for m in moments]
    algorithm = helper.make_graph(
        nodes, "bn_dropout_train", [helper.make_tensor_value_info("labels", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("loss", FLOAT, []),
         helper.make_tensor_value_info("train/mask", TensorProto.BOOL, ["batch", C, L_OUT])]
        + [helper.make_tensor_value_info(n, FLOAT, None) for n in bound]
        + [helper.make_tensor_value_info(f"train/{s}_new", FLOAT, [C]) for s in STATS]
        + [helper.make_tensor_value_info("T_new", TensorProto.INT64, [])],
        [numpy_helper.from_array(np.array(LR, np.float32), "lr"),
         numpy_helper.from_array(np.array(0, np.int64), "T"),
         numpy_helper.from_array(np.array(1, np.int64), "one"),
         numpy_helper.from_array(np.array(True), "training_mode")]
        + [numpy_helper.from_array(np.zeros_like(values[p]), f"{p}_V") for p in PARAMS])
    update = ([(p, f"{p}_new") for p in PARAMS] + [(m, f"{m}_new") for m in moments]
              + [(s, f"train/{s}_new") for s in STATS] + [("T", "T_new")])
    model = model_of(inference, training=True)
    model.training_info.append(helper.make_training_info(algorithm, update, None, None))
    return model


def batches(steps, seed=1):
    """A learnable problem: the label is the argmax of a fixed linear map of the flattened input."""
    rng = np.random.default_rng(seed)
    proj = rng.normal(size=(C_IN * L, CLASSES))
    out = []
    for _ in range(steps):
        x = rng.normal(size=(N, C_IN, L)).astype(np.float32)
        out.append({"X": x, "labels": np.argmax(x.reshape(N, -1) @ proj, axis=1).astype(np.int64)})
    return out


def torch_replay(values, data, masks):
    """The same steps in torch float64 with the session's dropout masks: ONNX BatchNormalization
    training semantics, SGD with momentum (ONNX Momentum with beta=1: v = alpha v + g, p -= lr v,
    torch.optim.SGD with dampening=0)."""
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()}
    params = {p: t[p].clone().requires_grad_(True) for p in PARAMS}
    mean, var = t["running_mean"].clone(), t["running_var"].clone()
    velocity = {p: torch.zeros_like(v) for p, v in params.items()}
    losses = []
    for b, mask in zip(data, masks):
        h = F.conv1d(torch.tensor(b["X"], dtype=torch.float64), params["W"], params["B"])
        batch_mean, batch_var = h.mean(dim=(0, 2)), h.var(dim=(0, 2), unbiased=False)
        h = F.batch_norm(h, None, None, params["scale"], params["bias"], training=True, eps=EPS)
        h = torch.relu(h) * torch.tensor(mask) / (1 - RATIO)
        loss = F.cross_entropy(h.flatten(1) @ params["W2"] + params["B2"], torch.tensor(b["labels"]))
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            for (p, v), g in zip(params.items(), grads):
                velocity[p] = ALPHA * velocity[p] + g
                v -= LR * velocity[p]
        mean = MOMENTUM * mean + (1 - MOMENTUM) * batch_mean.detach()
        var = MOMENTUM * var + (1 - MOMENTUM) * batch_var.detach()
        losses.append(loss.item())
    state = {p: v.detach().numpy() for p, v in params.items()}
    return losses, {**state, "running_mean": mean.numpy(), "running_var": var.numpy()}


def eval_forward(state, x):
    """Eval mode in numpy: BatchNormalization with the running statistics, Dropout the identity."""
    w, b = state["W"].astype(np.float64), state["B"].astype(np.float64)
    conv = sum(np.einsum("ncl,oc->nol", x[:, :, k:k + L_OUT], w[:, :, k]) for k in range(K)) + b[None, :, None]
    c = (1, -1, 1)
    bn = ((conv - state["running_mean"].reshape(c)) / np.sqrt(state["running_var"].reshape(c) + EPS)
          * state["scale"].reshape(c) + state["bias"].reshape(c))
    return np.maximum(bn, 0).reshape(len(x), -1) @ state["W2"] + state["B2"]


@pytest.fixture(scope="module")
def trained():
    values = initial_values()
    data = batches(10) * 6  # six epochs over ten batches
    sess = TrainingSession(training_model(values))
    masks, losses = [], []

    def keep(step, out):
        masks.append(out["train/mask"].copy())

    losses = sess.train(data, callback=keep, progress=False)
    return values, data, sess, masks, losses


def test_step_model_keeps_the_running_statistics_as_state(trained):
    _, _, sess, _, _ = trained
    assert sess.loss_name == "loss"
    for s in STATS:
        assert sess.update_binding[s] == f"train/{s}_new"
    bn = [n for n in sess.step_model.graph.node if n.op_type == "BatchNormalization"]
    modes = sorted(helper.get_attribute_value(a) for n in bn for a in n.attribute if a.name == "training_mode")
    assert modes == [0, 1]  # the inference graph's and the algorithm's


def test_dropout_masks_are_random_and_drop_about_the_ratio(trained):
    _, _, _, masks, _ = trained
    assert len(masks) == 60 and masks[0].dtype == np.bool_
    assert not all(np.array_equal(masks[0], m) for m in masks[1:])
    dropped = 1 - np.mean(masks)
    assert abs(dropped - RATIO) < 0.05, dropped


def test_training_matches_torch_replay(trained):
    values, data, sess, masks, losses = trained
    ref_losses, ref_state = torch_replay(values, data, masks)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    for name in PARAMS + STATS:
        want = ref_state[name]
        err = np.abs(sess.state[name] - want).max() / np.abs(want).max()
        assert err <= 1e-4, f"{name} off by {err:.2e} relative to its max abs after {len(data)} steps"


def test_loss_falls_and_running_statistics_move(trained):
    values, _, sess, _, losses = trained
    assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:10]), (losses[:10], losses[-10:])
    for s in STATS:
        assert np.abs(sess.state[s] - values[s]).max() > 0.05, s
    assert int(sess.state["T"]) == 60


def test_export_inference_is_the_eval_mode_model(trained, tmp_path):
    _, data, sess, _, _ = trained
    path = tmp_path / "inference.onnx"
    sess.export_inference(path)
    model = onnx.load(path)
    assert not len(model.training_info)
    assert PREVIEW not in {o.domain for o in model.opset_import}
    bn = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    assert len([o for o in bn.output if o]) == 1
    assert helper.get_attribute_value(next(a for a in bn.attribute if a.name == "training_mode")) == 0
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for name in PARAMS + STATS:
        np.testing.assert_array_equal(inits[name], sess.state[name], err_msg=name)

    x = np.concatenate([b["X"] for b in data[:2]])
    so = ort.SessionOptions()
    so.log_severity_level = 3
    got, = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(["logits"], {"X": x})
    want = eval_forward({k: v.astype(np.float64) for k, v in inits.items()}, x.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # deterministic: no dropout, no batch statistics (one sample alone gives the same logits)
    alone, = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(["logits"], {"X": x[:1]})
    np.testing.assert_allclose(alone, got[:1], rtol=1e-5, atol=1e-6)


# ---- a PyTorch train-mode export ---------------------------------------------------------------------

def torch_train_mode_model():
    """nn.Sequential exported in training mode (its graph has BatchNormalization training_mode=1 with
    the running statistics as extra outputs, Dropout with training_mode=True) as the inference graph;
    the algorithm adds the loss, Gradient, Momentum and copies the statistics outputs out to bind them."""
    from torch import nn

    from tests.torch_export import export

    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv1d(C_IN, C, K), nn.BatchNorm1d(C, momentum=1 - MOMENTUM), nn.ReLU(),
                           nn.Dropout(RATIO), nn.Flatten(), nn.Linear(C * L_OUT, CLASSES)).train()
    model = export(module, (torch.randn(N, C_IN, L),), ["X"], ("logits",), training=torch.onnx.TrainingMode.TRAINING)
    bn = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    stats = dict(zip(bn.input[3:5], bn.output[1:3]))
    params = [t.name for t in model.graph.initializer if t.name not in stats]
    grads = [f"{p}_grad" for p in params]
    nodes = [helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], name="xent"),
             helper.make_node("Gradient", params, grads, name="grad", domain=PREVIEW, xs=params, y="loss"),
             helper.make_node("Momentum", ["lr", "T"] + params + grads + [f"{p}_V" for p in params],
                              [f"{p}_new" for p in params] + [f"{p}_V_new" for p in params], name="momentum",
                              domain=PREVIEW, alpha=ALPHA, beta=1.0, norm_coefficient=0.0, mode="standard")]
    nodes += [helper.make_node("Identity", [v], [f"{k}_new"], name=f"{k}_out") for k, v in stats.items()]
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    algorithm = helper.make_graph(
        nodes, "train", [helper.make_tensor_value_info("labels", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("loss", FLOAT, [])]
        + [helper.make_tensor_value_info(f"{n}_new", FLOAT, None) for n in params + list(stats)]
        + [helper.make_tensor_value_info(f"{p}_V_new", FLOAT, None) for p in params],
        [numpy_helper.from_array(np.array(LR, np.float32), "lr"), numpy_helper.from_array(np.array(0, np.int64), "T")]
        + [numpy_helper.from_array(np.zeros_like(inits[p]), f"{p}_V") for p in params])
    update = [(n, f"{n}_new") for n in params + list(stats)] + [(f"{p}_V", f"{p}_V_new") for p in params]
    model.training_info.append(helper.make_training_info(algorithm, update, None, None))
    model.opset_import.append(helper.make_opsetid(PREVIEW, 1))
    return model, list(stats)


def test_torch_train_mode_export_trains_and_exports_eval_mode(tmp_path):
    model, stats = torch_train_mode_model()
    sess = TrainingSession(model)
    before = {s: sess.state[s] for s in stats}
    losses = sess.train(batches(10) * 6, progress=False)
    assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:10])
    for s in stats:
        assert np.abs(sess.state[s] - before[s]).max() > 0.05, s

    path = tmp_path / "inference.onnx"
    sess.export_inference(path)
    exported = onnx.load(path)
    bn = next(n for n in exported.graph.node if n.op_type == "BatchNormalization")
    assert helper.get_attribute_value(next(a for a in bn.attribute if a.name == "training_mode")) == 0
    x = batches(1)[0]["X"]
    so = ort.SessionOptions()
    so.log_severity_level = 3
    run = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    full, = run.run(["logits"], {"X": x})
    other = x.copy()
    other[1:] = batches(2)[1]["X"][1:]  # same first sample, different batch mates
    mixed, = run.run(["logits"], {"X": other})
    again, = run.run(["logits"], {"X": x})
    np.testing.assert_array_equal(again, full)  # no random mask
    np.testing.assert_allclose(mixed[:1], full[:1], rtol=1e-5, atol=1e-6)  # no batch statistics


def test_dropout_of_the_inference_graph_gives_its_mask_to_the_backward():
    """A hand-written spec model may train through a training-mode Dropout of the inference graph itself
    (the algorithm holds only the Gradient and the update). The backward must read that node's own mask:
    lowering gives the node a mask output (it had none) instead of naming a tensor nothing computes."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.uniform(0.5, 1.0, (6, 5)).astype(np.float32), "W"),
             numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
             numpy_helper.from_array(np.array(True), "on"),
             numpy_helper.from_array(np.array(0.1, np.float32), "lr")]
    nodes = [helper.make_node("MatMul", ["X", "W"], ["Z"], name="mm"),
             helper.make_node("Dropout", ["Z", "ratio", "on"], ["D"], name="drop"),
             helper.make_node("ReduceSum", ["D"], ["Y"], name="sum", keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", FLOAT, [8, 6])],
                              [helper.make_tensor_value_info("Y", FLOAT, [])], inits[:3])
    alg = helper.make_graph(
        [helper.make_node("Gradient", ["W"], ["dW"], name="grad", domain=PREVIEW, xs=["W"], y="Y"),
         helper.make_node("Mul", ["dW", "lr"], ["step"], name="scale"),
         helper.make_node("Sub", ["W", "step"], ["W_new"], name="update")],
        "alg", [], [helper.make_tensor_value_info(n, FLOAT, s) for n, s in
                    (("W_new", [6, 5]), ("dW", [6, 5]), ("D", [8, 5]))], inits[3:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(PREVIEW, 1)])
    ti = model.training_info.add()
    ti.algorithm.CopyFrom(alg)
    ti.update_binding.add(key="W", value="W_new")
    sess = TrainingSession(model)
    x = rng.uniform(0.5, 1.0, (8, 6)).astype(np.float32)
    for _ in range(3):
        out = sess.step({"X": x})
        kept = np.asarray(out["D"]) != 0  # Z > 0 everywhere, so D is zero exactly where the mask dropped
        assert 0 < kept.mean() < 1
        np.testing.assert_allclose(np.asarray(out["dW"]), x.T @ (kept / 0.5), rtol=1e-6)
