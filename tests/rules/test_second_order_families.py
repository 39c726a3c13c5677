"""Second order for the elementwise, matmul (MatMul, Gemm) and convolution families.

Each case computes f from its inputs and y = f * f (so the first gradient's seed depends on the inputs
too, and the op's backward is differentiated with a non-constant dy). The model holds a Gradient node
g = dy/dxs; then

* a second Gradient node of s = sum_k <g_k, v_k> gives the Hessian-vector product, held against torch
  double backward (``autograd.grad(..., create_graph=True)`` twice) in float64; ops onnxruntime runs
  only in float32 (Conv, ConvTranspose, Erf, Elu, ...) run in float32 there, still against float64 torch,
  within 1e-4 of each tensor's max abs;
* where onnxruntime has float64 kernels, ``gradcheck`` also holds the lowered second derivatives
  against central finite differences of the first-order lowering.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper

from onnx_autodiff import lower
from onnx_autodiff.check.gradcheck import gradcheck

TRAIN = "ai.onnx.preview.training"
RTOL = 1e-4
ALPHA, BETA = float(np.float32(0.7)), float(np.float32(-1.3))  # float attributes are float32


@dataclass
class Case:
    """Nodes computing ``f`` from ``inputs`` (name -> (shape, low, high)); ``xs`` are differentiated,
    the other inputs and ``consts`` are fixed. ``fn`` is the same f in torch."""

    name: str
    nodes: list
    inputs: dict
    fn: Callable
    xs: list | None = None
    consts: dict = field(default_factory=dict)
    float64: bool = True  # onnxruntime has float64 kernels for every op of the case (and its gradients)
    opset: int = 17
    gap: float = 0.0  # keep |x| at least this far from zero (kinks)

    @property
    def wrt(self):
        return self.xs if self.xs is not None else list(self.inputs)

    def values(self, seed=0) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        out = {}
        for name, (shape, low, high) in self.inputs.items():
            x = rng.uniform(low, high, size=shape)
            if self.gap:
                x = np.sign(x) * (np.abs(x) + self.gap)
            out[name] = x.astype(np.float64 if self.float64 else np.float32)
        return out


def first_order_model(case: Case) -> tuple[onnx.ModelProto, list[str]]:
    """f, y = f * f and Gradient(y; xs) -> '<x>_grad' (the graph outputs)."""
    dt = onnx.TensorProto.DOUBLE if case.float64 else onnx.TensorProto.FLOAT
    np_dt = np.float64 if case.float64 else np.float32
    grads = [f"{x}_grad" for x in case.wrt]
    nodes = list(case.nodes) + [
        helper.make_node("Mul", ["f", "f"], ["y"], name="square"),
        helper.make_node("Gradient", case.wrt, grads, name="inner", domain=TRAIN, xs=case.wrt, y="y"),
    ]
    inputs = [helper.make_tensor_value_info(n, dt, list(s)) for n, (s, _, _) in case.inputs.items()]
    outputs = [helper.make_tensor_value_info(g, dt, list(case.inputs[x][0])) for x, g in zip(case.wrt, grads)]
    inits = [numpy_helper.from_array(np.asarray(v, np_dt) if np.asarray(v).dtype.kind == "f" else np.asarray(v), k)
             for k, v in case.consts.items()]
    graph = helper.make_graph(nodes, case.name, inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset), helper.make_opsetid(TRAIN, 1)])
    model.ir_version = 10
    return model, grads


def hvp_model(case: Case) -> onnx.ModelProto:
    """The first-order model plus s = sum_k <x_k_grad, x_k_v> and Gradient(s; xs) -> '<x>_hvp'."""
    model, grads = first_order_model(case)
    g = model.graph
    dt = g.input[0].type.tensor_type.elem_type
    terms = []
    for x, grad in zip(case.wrt, grads):
        g.input.append(helper.make_tensor_value_info(f"{x}_v", dt, list(case.inputs[x][0])))
        g.node.extend([helper.make_node("Mul", [grad, f"{x}_v"], [f"{x}_gv"], name=f"{x}_gv"),
                       helper.make_node("ReduceSum", [f"{x}_gv"], [f"{x}_s"], name=f"{x}_s", keepdims=0)])
        terms.append(f"{x}_s")
    g.node.append(helper.make_node("Sum", terms, ["s"], name="s"))
    hvps = [f"{x}_hvp" for x in case.wrt]
    g.node.append(helper.make_node("Gradient", case.wrt, hvps, name="outer", domain=TRAIN, xs=case.wrt, y="s"))
    del g.output[:]
    g.output.extend(helper.make_tensor_value_info(h, dt, list(case.inputs[x][0])) for x, h in zip(case.wrt, hvps))
    return model


def run(model, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in model.graph.output], sess.run(None, feeds)))


def torch_hvp(case: Case, values, vs) -> dict[str, np.ndarray]:
    ts = {k: torch.tensor(v.astype(np.float64), requires_grad=k in case.wrt) for k, v in values.items()}
    consts = {k: torch.tensor(np.asarray(v, np.float64) if np.asarray(v).dtype.kind == "f" else v)
              for k, v in case.consts.items()}
    f = case.fn(**ts, **consts)
    xs = [ts[x] for x in case.wrt]
    grads = torch.autograd.grad((f * f).sum(), xs, create_graph=True)
    s = sum((g * torch.tensor(vs[x].astype(np.float64))).sum() for x, g in zip(case.wrt, grads))
    return {x: h.numpy() for x, h in zip(case.wrt, torch.autograd.grad(s, xs))}


def node(op, inputs, **attrs):
    return helper.make_node(op, inputs, ["f"], name=op.lower(), **attrs)


def unary(op, fn, low=-1.5, high=1.5, shape=(2, 3), **kw):
    attrs = kw.pop("attrs", {})
    return Case(kw.pop("name", op), [node(op, ["x"], **attrs)], {"x": (shape, low, high)},
                lambda x: fn(x), **kw)


def matmul(a, b):
    return a @ b


def where_fn(x, a, cond):
    return torch.where(cond, x, a)


ELEMENTWISE = [
    unary("Log", torch.log, 0.5, 2.0),
    Case("Sqrt", [helper.make_node("Sqrt", ["x"], ["r"], name="sqrt"), node("Mul", ["r", "x"])],
         {"x": ((2, 3), 0.5, 2.0)}, lambda x: torch.sqrt(x) * x),  # sqrt(x)^2 alone has no second derivative
    unary("Reciprocal", torch.reciprocal, 0.5, 2.0),
    unary("Sin", torch.sin),
    unary("Cos", torch.cos),
    unary("Softplus", F.softplus, float64=False),
    unary("Abs", torch.abs, gap=0.1),
    unary("Neg", torch.neg),
    unary("LeakyRelu", lambda x: F.leaky_relu(x, 0.1), attrs={"alpha": 0.1}, gap=0.1),
    unary("Softsign", F.softsign, float64=False),
    unary("Erf", torch.erf, float64=False),
    unary("Atan", torch.atan, float64=False),
    unary("Sinh", torch.sinh, float64=False),
    unary("Elu", F.elu, float64=False, gap=0.1),
    unary("Selu", F.selu, float64=False, gap=0.1),
    unary("Gelu", F.gelu, float64=False, opset=20),
    Case("Add-broadcast", [node("Add", ["a", "b"])], {"a": ((2, 3), -1, 1), "b": ((3,), -1, 1)}, lambda a, b: a + b),
    Case("Sub-broadcast", [node("Sub", ["a", "b"])], {"a": ((2, 1), -1, 1), "b": ((1, 3), -1, 1)}, lambda a, b: a - b),
    Case("Max", [node("Max", ["a", "b"])], {"a": ((2, 3), -1, 1), "b": ((2, 3), -1, 1)},
         lambda a, b: torch.maximum(a, b)),
    Case("Min-broadcast", [node("Min", ["a", "b"])], {"a": ((2, 3), -1, 1), "b": ((3,), -1, 1)},
         lambda a, b: torch.minimum(a, b)),
    Case("Where", [node("Where", ["cond", "x", "a"])], {"x": ((2, 3), -1, 1), "a": ((2, 3), -1, 1)}, where_fn,
         consts={"cond": np.array([[True, False, True], [False, False, True]])}),
    Case("Clip", [node("Clip", ["x", "lo", "hi"])], {"x": ((2, 3), -2, 2)},
         lambda x, lo, hi: torch.clamp(x, lo, hi), consts={"lo": np.array(-0.8), "hi": np.array(0.9)}),
    Case("PRelu", [node("PRelu", ["x", "slope"])], {"x": ((2, 3), -1, 1), "slope": ((3,), 0.1, 0.5)},
         lambda x, slope: torch.where(x >= 0, x, slope * x), gap=0.1),
    Case("Softmax", [node("Softmax", ["x"], axis=-1)], {"x": ((2, 4), -1, 1)}, lambda x: torch.softmax(x, -1)),
]

MATMUL = [
    Case("MatMul-2d", [node("MatMul", ["a", "b"])], {"a": ((3, 4), -1, 1), "b": ((4, 5), -1, 1)}, matmul),
    Case("MatMul-batch-broadcast", [node("MatMul", ["a", "b"])], {"a": ((2, 3, 4), -1, 1), "b": ((4, 5), -1, 1)},
         matmul),
    Case("MatMul-both-batched", [node("MatMul", ["a", "b"])],
         {"a": ((2, 1, 3, 4), -1, 1), "b": ((3, 4, 2), -1, 1)}, matmul),
    Case("MatMul-vector-matrix", [node("MatMul", ["a", "b"])], {"a": ((4,), -1, 1), "b": ((4, 5), -1, 1)},
         matmul),
    Case("MatMul-matrix-vector", [node("MatMul", ["a", "b"])], {"a": ((3, 4), -1, 1), "b": ((4,), -1, 1)},
         matmul),
    Case("Gemm-bias", [node("Gemm", ["a", "b", "c"])], {"a": ((3, 4), -1, 1), "b": ((4, 5), -1, 1),
                                                       "c": ((5,), -1, 1)}, lambda a, b, c: a @ b + c),
    Case("Gemm-trans-alpha-beta", [node("Gemm", ["a", "b", "c"], transA=1, transB=1, alpha=0.7, beta=-1.3)],
         {"a": ((4, 3), -1, 1), "b": ((5, 4), -1, 1), "c": ((3, 1), -1, 1)},
         lambda a, b, c: ALPHA * a.T @ b.T + BETA * c),
    Case("Gemm-no-bias", [node("Gemm", ["a", "b"], transB=1)], {"a": ((3, 4), -1, 1), "b": ((5, 4), -1, 1)},
         lambda a, b: a @ b.T),
    Case("MatMul-then-Tanh", [helper.make_node("MatMul", ["a", "b"], ["m"], name="mm"), node("Tanh", ["m"])],
         {"a": ((3, 4), -1, 1), "b": ((4, 2), -1, 1)}, lambda a, b: torch.tanh(a @ b)),
]


def conv_case(name, x, w, b=None, fn=None, **attrs):
    inputs = {"x": (x, -1, 1), "w": (w, -0.5, 0.5)} | ({"b": (b, -0.5, 0.5)} if b else {})
    return Case(name, [node("Conv", list(inputs), **attrs)], inputs, fn, float64=False)


CONV = [
    conv_case("Conv-2d-bias", (2, 3, 5, 5), (4, 3, 3, 3), (4,), lambda x, w, b: F.conv2d(x, w, b)),
    conv_case("Conv-2d-stride-pads-dilation", (1, 2, 7, 6), (3, 2, 3, 2),
              fn=lambda x, w: F.conv2d(F.pad(x, [0, 1, 1, 2]), w, stride=(2, 1), dilation=(1, 2)),
              strides=[2, 1], pads=[1, 0, 2, 1], dilations=[1, 2]),
    conv_case("Conv-2d-grouped", (2, 4, 5, 4), (6, 2, 3, 3), (6,),
              lambda x, w, b: F.conv2d(x, w, b, padding=1, groups=2), group=2, pads=[1, 1, 1, 1]),
    conv_case("Conv-2d-depthwise", (1, 3, 6, 6), (3, 1, 3, 3), fn=lambda x, w: F.conv2d(x, w, stride=2, groups=3),
              group=3, strides=[2, 2]),
    conv_case("Conv-1d", (2, 3, 8), (2, 3, 3), (2,), lambda x, w, b: F.conv1d(x, w, b, stride=2), strides=[2]),
    Case("ConvTranspose-2d", [node("ConvTranspose", ["x", "w", "b"], strides=[2, 2], pads=[1, 1, 1, 1])],
         {"x": ((1, 3, 4, 3), -1, 1), "w": ((3, 2, 3, 3), -0.5, 0.5), "b": ((2,), -0.5, 0.5)},
         lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1), float64=False),
    Case("Conv-Relu-Conv", [helper.make_node("Conv", ["x", "w1"], ["h"], name="conv1", pads=[1, 1, 1, 1]),
                            helper.make_node("Relu", ["h"], ["r"], name="relu"),
                            node("Conv", ["r", "w2"], group=2)],
         {"x": ((1, 2, 5, 5), -1, 1), "w1": ((4, 2, 3, 3), -0.5, 0.5), "w2": ((2, 2, 2, 2), -0.5, 0.5)},
         lambda x, w1, w2: F.conv2d(torch.relu(F.conv2d(x, w1, padding=1)), w2, groups=2), float64=False),
]

ALL = ELEMENTWISE + MATMUL + CONV


@pytest.mark.parametrize("case", ALL, ids=lambda c: c.name)
def test_gradient_of_gradient_matches_torch_double_backward(case):
    values = case.values()
    rng = np.random.default_rng(1)
    vs = {x: rng.standard_normal(values[x].shape).astype(values[x].dtype) for x in case.wrt}
    lowered = lower(hvp_model(case))
    assert not [n for n in lowered.graph.node if n.domain not in ("", "ai.onnx")]
    got = run(lowered, {**values, **{f"{x}_v": v for x, v in vs.items()}})
    want = torch_hvp(case, values, vs)
    for x in case.wrt:
        ref = want[x]
        scale = float(np.abs(ref).max())
        assert scale > 1e-3, f"{case.name}: the second derivative along {x} is ~0, the check would be vacuous"
        err = float(np.abs(got[f"{x}_hvp"].astype(np.float64) - ref).max()) / scale
        tol = 1e-9 if case.float64 else RTOL
        assert err <= tol, f"{case.name}: Hessian-vector product for {x} off by {err:.2e} (relative to max abs)"


@pytest.mark.parametrize("case", [c for c in ALL if c.float64], ids=lambda c: c.name)
def test_second_order_gradcheck(case):
    """gradcheck of the model holding a Gradient node: its outputs are differentiated again and held
    against central differences of the first-order lowering, in float64."""
    model, grads = first_order_model(case)
    report = gradcheck(model, case.values(), of=grads, wrt=case.wrt)
    assert report.ok and len(report.checks) == len(case.wrt), str(report)
    assert all(abs(c.numeric) > 1e-3 for c in report.checks), str(report)
