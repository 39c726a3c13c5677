"""End to end: a PyTorch MLP with its cross-entropy loss, exported to ONNX, differentiated by us.

The model (Linear -> Tanh -> Linear -> ReLU -> Linear -> F.cross_entropy) exports to
Gemm / Tanh / Relu / SoftmaxCrossEntropyLoss at opset 17. We add a Gradient node of the loss w.r.t.
every initializer and the input x, lower it, run it in float32 onnxruntime and hold the gradients
against torch autograd run in float64 on the same float32 values (float32 rounding stays far below
the 1e-4 relative tolerance).
"""
from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import helper

import onnx_autodiff as oa

RTOL = 1e-4
TRAIN = "ai.onnx.preview.training"
N_IN, N_H1, N_H2, N_CLASSES = 5, 8, 6, 4


class MLP(torch.nn.Module):
    def __init__(self, **loss_kwargs):
        super().__init__()
        self.l1 = torch.nn.Linear(N_IN, N_H1)
        self.l2 = torch.nn.Linear(N_H1, N_H2)
        self.l3 = torch.nn.Linear(N_H2, N_CLASSES)
        self.loss_kwargs = loss_kwargs

    def forward(self, x, target):
        logits = self.l3(F.relu(self.l2(torch.tanh(self.l1(x)))))
        return F.cross_entropy(logits, target, **self.loss_kwargs)


def export(model: MLP, x, target, dynamic_batch: bool = False) -> onnx.ModelProto:
    buf = io.BytesIO()
    dynamic_axes = {"x": {0: "N"}, "target": {0: "N"}} if dynamic_batch else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x, target), buf, dynamo=False, opset_version=17,
                          input_names=["x", "target"], output_names=["loss"], dynamic_axes=dynamic_axes)
    return onnx.load_from_string(buf.getvalue())


def with_gradient(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """The model plus a Gradient node of 'loss' w.r.t. every initializer and 'x', whose outputs are
    graph outputs named '<x>_grad'; returns it and the xs."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    xs = [t.name for t in g.initializer] + ["x"]
    grads = [f"{x}_grad" for x in xs]
    g.node.append(helper.make_node("Gradient", xs, grads, name="mlp_grad", domain=TRAIN, xs=xs, y="loss"))
    shapes = {t.name: list(t.dims) for t in g.initializer}
    x_dims = g.input[0].type.tensor_type.shape.dim
    shapes["x"] = [d.dim_param or d.dim_value for d in x_dims]
    for x, name in zip(xs, grads):
        g.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shapes[x]))
    m.opset_import.append(helper.make_opsetid(TRAIN, 1))
    return m, xs


def torch_gradients(model: MLP, x, target) -> dict[str, np.ndarray]:
    """d(sum of the loss)/d(parameters, x) by torch autograd in float64."""
    m64 = MLP(**{k: (v.double() if torch.is_tensor(v) else v) for k, v in model.loss_kwargs.items()})
    m64.load_state_dict(model.state_dict())
    m64.double()
    x64 = x.double().requires_grad_(True)
    m64(x64, target).sum().backward()
    out = {name: p.grad.numpy() for name, p in m64.named_parameters()}
    out["x"] = x64.grad.numpy()
    return out


def run_lowered(model: onnx.ModelProto, xs, x, target) -> dict[str, np.ndarray]:
    lowered = oa.lower(model)
    ops = {n.op_type for n in lowered.graph.node}
    assert "Gradient" not in ops and all(n.domain in ("", "ai.onnx") for n in lowered.graph.node), ops
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(lowered.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [f"{n}_grad" for n in xs]
    return dict(zip(xs, sess.run(names, {"x": x.numpy(), "target": target.numpy()})))


def assert_close(ours: dict, ref: dict):
    assert set(ours) == set(ref), (sorted(ours), sorted(ref))
    for name, r in ref.items():
        scale = float(np.abs(r).max())
        assert scale > 0, f"the reference gradient of {name} is zero: the check would be vacuous"
        np.testing.assert_allclose(ours[name], r, rtol=RTOL, atol=RTOL * scale, err_msg=name)


CASES = {
    "mean": dict(),
    "sum": dict(reduction="sum"),
    "none": dict(reduction="none"),
    "weights-ignore-index": dict(weight=torch.tensor([0.5, 2.0, 1.0, 1.5]), ignore_index=1),
    "weights-sum": dict(weight=torch.tensor([0.5, 2.0, 1.0, 1.5]), reduction="sum"),
}


@pytest.mark.parametrize("dynamic_batch", [False, True], ids=["static", "dynamic-batch"])
@pytest.mark.parametrize("kind", list(CASES))
def test_mlp_cross_entropy_matches_torch(kind, dynamic_batch):
    torch.manual_seed(0)
    model = MLP(**CASES[kind])
    x = torch.randn(6, N_IN)
    target = torch.tensor([0, 1, 3, 2, 1, 3])
    onnx_model = export(model, x, target, dynamic_batch)
    ops = [n.op_type for n in onnx_model.graph.node]
    assert "SoftmaxCrossEntropyLoss" in ops and ops.count("Gemm") == 3, ops

    grad_model, xs = with_gradient(onnx_model)
    ours = run_lowered(grad_model, xs, x, target)
    assert_close(ours, torch_gradients(model, x, target))


def test_ignore_index_default_is_exported_and_respected():
    """torch exports ignore_index=-100 always; targets equal to it must drop out of the mean."""
    torch.manual_seed(1)
    model = MLP()
    x = torch.randn(5, N_IN)
    target = torch.tensor([2, -100, 0, -100, 3])
    onnx_model = export(model, x, target)
    sce = next(n for n in onnx_model.graph.node if n.op_type == "SoftmaxCrossEntropyLoss")
    assert helper.get_attribute_value(next(a for a in sce.attribute if a.name == "ignore_index")) == -100

    grad_model, xs = with_gradient(onnx_model)
    ours = run_lowered(grad_model, xs, x, target)
    ref = torch_gradients(model, x, target)
    assert_close(ours, ref)
    assert np.all(ours["x"][[1, 3]] == 0) and np.all(ref["x"][[1, 3]] == 0)
