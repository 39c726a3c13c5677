"""Elementwise and binary rules beyond the float64 first-order sweep.

1. Second order: a model holding a Gradient node is gradchecked, so the lowered backward ops are
   differentiated again (their rules must exist and be right).
2. Ops onnxruntime runs only in float32 (Tan, Erf, Elu, Mean, Clip-6, ...): the lowered gradient runs in
   float32 onnxruntime and is held against torch float64 autograd on the same inputs; float32 rounding
   keeps the error near 1e-6 of the gradient's scale, so 1e-4 is a real check.
3. The forms rules emit below opset 9 (no Sign, no Where), on scalar models.
"""
import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from onnx_autodiff import lower
from onnx_autodiff.check.gradcheck import gradcheck
from onnx_autodiff.testing import In, RuleCase, rule_case_model

TRAINING = "ai.onnx.preview.training"
D = TensorProto.DOUBLE


def _session(model):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


# ---- 1. second order ---------------------------------------------------------------------------

def _with_gradient(nodes, inputs, y, xs, opset=17, shape=(2, 3)):
    """A model computing ``y`` from ``inputs`` plus a Gradient node giving d(sum y)/dx for x in xs."""
    grads = [f"{x}_grad" for x in xs]
    nodes = nodes + [helper.make_node("Gradient", xs, grads, name="inner", domain=TRAINING, xs=xs, y=y)]
    vi = [helper.make_tensor_value_info(n, D, list(shape)) for n in inputs]
    outs = [helper.make_tensor_value_info(n, D, list(shape)) for n in grads]
    graph = helper.make_graph(nodes, "second_order", vi, outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid(TRAINING, 1)])
    model.ir_version = 10
    return model, grads


def _unary(op, **attrs):
    return _with_gradient([helper.make_node(op, ["x"], ["y"], **attrs)], ["x"], "y", ["x"])


SECOND_ORDER = {
    "Tanh": (lambda: _unary("Tanh"), {}),
    "Sigmoid": (lambda: _unary("Sigmoid"), {}),
    "Exp": (lambda: _unary("Exp"), {}),
    "Mul": (lambda: _with_gradient([helper.make_node("Mul", ["a", "b"], ["m"]),
                                    helper.make_node("Mul", ["m", "a"], ["y"])], ["a", "b"], "y", ["a", "b"]), {}),
    "Div": (lambda: _with_gradient([helper.make_node("Div", ["a", "b"], ["y"])], ["a", "b"], "y", ["a", "b"]),
            {"b": (0.5, 2.0)}),
    "Pow": (lambda: _with_gradient([helper.make_node("Pow", ["a", "b"], ["y"])], ["a", "b"], "y", ["a", "b"]),
            {"a": (0.5, 2.0)}),
}


@pytest.mark.parametrize("name", sorted(SECOND_ORDER))
def test_second_order_matches_finite_differences(name):
    build, ranges = SECOND_ORDER[name]
    model, grads = build()
    rng = np.random.default_rng(1)
    feeds = {vi.name: rng.uniform(*ranges.get(vi.name, (-1.5, 1.5)), size=(2, 3)) for vi in model.graph.input}
    report = gradcheck(model, feeds, of=grads)
    assert report.ok and report.checks
    # the check is not vacuous: the second derivatives are nonzero here
    assert all(abs(c.analytic) > 1e-3 for c in report.checks), str(report)


def test_relu_second_derivative_is_zero_and_mixed_partial_is_the_mask():
    """d/dx of Relu's gradient is 0 away from the kink; d/dw of d(w relu(x))/dx is the mask."""
    model, grads = _with_gradient([helper.make_node("Relu", ["x"], ["r"]),
                                   helper.make_node("Mul", ["w", "r"], ["y"])], ["x", "w"], "y", ["x"])
    rng = np.random.default_rng(2)
    x = rng.uniform(-2, 2, size=(2, 3))
    x = np.sign(x) * (np.abs(x) + 0.1)
    w = rng.uniform(-2, 2, size=(2, 3))
    report = gradcheck(model, {"x": x, "w": w}, of=grads)
    by = {c.name: c for c in report.checks}
    assert report.ok
    assert by["x"].analytic == 0.0 and abs(by["x"].numeric) < 1e-8
    assert abs(by["w"].analytic) > 1e-3

    grad_x, = _session(lower(model)).run(grads, {"x": x, "w": w})
    np.testing.assert_allclose(grad_x, w * (x > 0))


# ---- 2. float32-only kernels against torch --------------------------------------------------------

def _vjp_ort(case: RuleCase, seed=0):
    """(float32 feeds, output cotangent v, lowered gradients of <y, v>) for a float32 rule case."""
    model, feeds, wrt = rule_case_model(case, seed)
    ort_y = _session(lower(model)).run(["y0"], feeds)[0]
    v = np.random.default_rng(seed + 7).standard_normal(ort_y.shape).astype(np.float32)
    g = model.graph
    g.input.append(helper.make_tensor_value_info("v", TensorProto.FLOAT, list(ort_y.shape)))
    g.node.extend([helper.make_node("Mul", ["y0", "v"], ["yv"]),
                   helper.make_node("ReduceSum", ["yv"], ["s"], keepdims=0),
                   helper.make_node("Gradient", wrt, [f"{w}_grad" for w in wrt], domain=TRAINING, xs=wrt, y="s")])
    for w in wrt:
        g.output.append(helper.make_tensor_value_info(f"{w}_grad", TensorProto.FLOAT, list(feeds[w].shape)))
    model.opset_import.append(helper.make_opsetid(TRAINING, 1))
    lowered = lower(model)
    out = _session(lowered).run([f"{w}_grad" for w in wrt], {**feeds, "v": v})
    return feeds, v, dict(zip(wrt, out)), ort_y


def _check_against_torch(case, fn):
    feeds, v, got, ort_y = _vjp_ort(case)
    ts = {k: torch.tensor(a.astype(np.float64), requires_grad=k in got) for k, a in feeds.items()}
    y = fn(*[ts[f"x{k}"] for k in range(len(case.inputs)) if f"x{k}" in ts])
    np.testing.assert_allclose(ort_y, y.detach().numpy(), rtol=1e-4, atol=1e-5)  # same function
    (y * torch.tensor(v.astype(np.float64))).sum().backward()
    for k, g in got.items():
        want = ts[k].grad.numpy()
        scale = max(np.abs(want).max(), 1.0)
        assert np.abs(g.astype(np.float64) - want).max() <= 1e-4 * scale, (k, g, want)
        assert np.abs(want).max() > 1e-3  # a real gradient, not zeros on both sides


def f32(shape=(3, 4), **kw):
    return In(shape, dtype="float32", **kw)


SELU_A, SELU_G = 1.3, 0.8
FLOAT32_ONLY = [
    (RuleCase("Tan", [f32(low=-1.2, high=1.2)]), torch.tan),
    (RuleCase("Asin", [f32(low=-0.9, high=0.9)]), torch.asin),
    (RuleCase("Acos", [f32(low=-0.9, high=0.9)]), torch.acos),
    (RuleCase("Atan", [f32()]), torch.atan),
    (RuleCase("Sinh", [f32()]), torch.sinh),
    (RuleCase("Cosh", [f32()]), torch.cosh),
    (RuleCase("Asinh", [f32()]), torch.asinh),
    (RuleCase("Acosh", [f32(low=1.1, high=3.0)]), torch.acosh),
    (RuleCase("Atanh", [f32(low=-0.9, high=0.9)]), torch.atanh),
    (RuleCase("Softplus", [f32()]), lambda x: torch.log1p(torch.exp(x))),
    (RuleCase("Softsign", [f32(gap=0.05)]), lambda x: x / (1 + x.abs())),
    (RuleCase("Erf", [f32()]), torch.erf),
    (RuleCase("ThresholdedRelu", [f32(low=-3, high=3)], attrs={"alpha": 0.5}),
     lambda x: torch.where(x > 0.5, x, torch.zeros_like(x))),
    (RuleCase("ThresholdedRelu", [f32(low=-3, high=3)], id="default"),
     lambda x: torch.where(x > 1.0, x, torch.zeros_like(x))),
    (RuleCase("Elu", [f32(gap=0.05)]), F.elu),
    (RuleCase("Elu", [f32(gap=0.05)], attrs={"alpha": 0.7}, id="alpha"), lambda x: F.elu(x, 0.7)),
    (RuleCase("Selu", [f32(gap=0.05)]), F.selu),
    (RuleCase("Selu", [f32(gap=0.05)], attrs={"alpha": SELU_A, "gamma": SELU_G}, id="attrs"),
     lambda x: SELU_G * torch.where(x > 0, x, SELU_A * (torch.exp(x) - 1))),
    (RuleCase("Celu", [f32(gap=0.05)], opset=12), F.celu),
    (RuleCase("Celu", [f32(gap=0.05)], attrs={"alpha": 2.0}, id="alpha"), lambda x: F.celu(x, 2.0)),
    (RuleCase("HardSigmoid", [f32(low=-4, high=4)]), lambda x: torch.clamp(0.2 * x + 0.5, 0, 1)),
    (RuleCase("HardSigmoid", [f32(low=-2, high=2)], attrs={"alpha": 0.4, "beta": 0.3}, id="attrs"),
     lambda x: torch.clamp(0.4 * x + 0.3, 0, 1)),
    (RuleCase("HardSwish", [f32(low=-5, high=5)], opset=14), F.hardswish),
    (RuleCase("Shrink", [f32()], attrs={"lambd": 0.3, "bias": 0.2}),
     lambda x: torch.where(x < -0.3, x + 0.2, torch.where(x > 0.3, x - 0.2, torch.zeros_like(x)))),
    (RuleCase("Gelu", [f32()], opset=20), F.gelu),
    (RuleCase("Gelu", [f32()], attrs={"approximate": "tanh"}, opset=20, id="tanh"),
     lambda x: F.gelu(x, approximate="tanh")),
    (RuleCase("Mean", [f32((2, 3)), f32((3,)), f32((1, 3))], id="variadic-broadcast"), lambda a, b, c: (a + b + c) / 3),
    (RuleCase("Mean", [f32((2, 3))], opset=9, id="single-opset9"), lambda a: a),
    (RuleCase("Clip", [f32()], attrs={"min": -0.5, "max": 0.7}, opset=9, id="opset9-attrs"),
     lambda x: torch.clamp(x, -0.5, 0.7)),
    (RuleCase("Clip", [f32()], attrs={"max": 0.7}, opset=10, id="opset10-max-attr"), lambda x: torch.clamp(x, max=0.7)),
    (RuleCase("PRelu", [f32((2, 3, 4), gap=0.05), f32((3, 1))], opset=9, id="opset9-broadcast-slope"),
     lambda x, s: torch.where(x >= 0, x, s * x)),
]


@pytest.mark.parametrize("case,fn", FLOAT32_ONLY, ids=[c.name for c, _ in FLOAT32_ONLY])
def test_float32_only_ops_match_torch(case, fn):
    _check_against_torch(case, fn)


# ---- 3. forms below opset 9 -----------------------------------------------------------------------

def _scalar_grad(op, x, dtype, opset=8, **attrs):
    """d op(x)/dx for a scalar model at ``opset`` (a scalar y seeds with a float Constant, so nothing
    else in the lowering needs opset 9)."""
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [helper.make_node(op, ["x"], ["y"], **attrs),
             helper.make_node("Gradient", ["x"], ["dx"], domain=TRAINING, xs=["x"], y="y")]
    graph = helper.make_graph(nodes, "low", [helper.make_tensor_value_info("x", t, [])],
                              [helper.make_tensor_value_info("dx", t, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(TRAINING, 1)])
    model.ir_version = 7
    lowered = lower(model)
    assert not any(n.op_type in ("Sign", "Where") for n in lowered.graph.node)
    sess = _session(lowered)
    return [float(sess.run(["dx"], {"x": np.array(v, dtype=dtype)})[0]) for v in x]


def test_abs_below_opset9_uses_masks():
    assert _scalar_grad("Abs", [-1.5, 0.0, 2.0], "float64") == [-1.0, 0.0, 1.0]


def test_elu_below_opset9_selects_by_arithmetic():
    got = _scalar_grad("Elu", [-1.5, 0.5], "float32", alpha=0.7)
    np.testing.assert_allclose(got, [0.7 * np.exp(-1.5), 1.0], rtol=1e-6)


def test_cast_from_integer_gets_no_gradient_but_float_does():
    """y = Cast(int(k)) * x + Cast(x): only x is differentiable; the int path contributes nothing."""
    nodes = [helper.make_node("Cast", ["k"], ["kf"], to=D),
             helper.make_node("Mul", ["kf", "x"], ["p"]),
             helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["xf"], ["xd"], to=D),
             helper.make_node("Add", ["p", "xd"], ["y"]),
             helper.make_node("Gradient", ["x"], ["dx"], domain=TRAINING, xs=["x"], y="y")]
    graph = helper.make_graph(nodes, "cast", [helper.make_tensor_value_info("x", D, [3]),
                                              helper.make_tensor_value_info("k", TensorProto.INT64, [3])],
                              [helper.make_tensor_value_info("dx", D, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(TRAINING, 1)])
    model.ir_version = 10
    dx, = _session(lower(model)).run(["dx"], {"x": np.array([1.0, -2.0, 3.0]), "k": np.array([2, 5, -1])})
    np.testing.assert_allclose(dx, [3.0, 6.0, 0.0])


def test_max_min_ties_split_the_gradient_evenly():
    nodes = [helper.make_node("Max", ["a", "b", "c"], ["y"]),
             helper.make_node("Min", ["a", "b"], ["z"]),
             helper.make_node("Add", ["y", "z"], ["s"]),
             helper.make_node("Gradient", ["a", "b", "c"], ["da", "db", "dc"], domain=TRAINING,
                              xs=["a", "b", "c"], y="s")]
    vi = [helper.make_tensor_value_info(n, D, [3]) for n in "abc"]
    graph = helper.make_graph(nodes, "ties", vi, [helper.make_tensor_value_info(n, D, [3]) for n in ("da", "db", "dc")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(TRAINING, 1)])
    model.ir_version = 10
    a, b, c = np.array([1.0, 2.0, 0.0]), np.array([1.0, 2.0, -1.0]), np.array([0.0, 2.0, 5.0])
    da, db, dc = _session(lower(model)).run(None, {"a": a, "b": b, "c": c})
    # max: tie a=b | three-way tie | c wins;  min: tie a=b | tie a=b | b wins
    np.testing.assert_allclose(da, [0.5 + 0.5, 1 / 3 + 0.5, 0.0])
    np.testing.assert_allclose(db, [0.5 + 0.5, 1 / 3 + 0.5, 1.0])
    np.testing.assert_allclose(dc, [0.0, 1 / 3, 1.0])
