"""GELU as the torch exporters write it, differentiated as one Gelu in closed form (issue 38;
``gradient_rules/elementwise.py``, ``gelu_patterns``): the closed form against torch autograd and against the op-by-op
form (the group left out of the registry), on every order the exporters write; a pattern that does
not match exactly (another constant, an intermediate with a second reader) stays op by op."""
from __future__ import annotations

import io
import math
import warnings
from contextlib import contextmanager

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from gradient_rules.elementwise import gelu_patterns
from onnx_autodiff import build_vjp
from onnx_autodiff.engine import registry
from tests.models import run_ort


@contextmanager
def _op_by_op(on: bool = True):
    """Within the block (``on``) the GELU group is left out of the registry: every pattern is differentiated op by op,
    the form before the group."""
    saved = list(registry._GROUPS)
    if on:
        registry._GROUPS[:] = [g for g in saved if g is not gelu_patterns]
    try:
        yield
    finally:
        registry._GROUPS[:] = saved


def _grads(model, wrt, feeds, op_by_op=False):
    """(gradients of sum(y * dy) w.r.t. ``wrt`` in onnxruntime, the backward's op types, dy); ``op_by_op``: without
    the group."""
    with _op_by_op(op_by_op):
        v = build_vjp(model, wrt=wrt)
    fwd = run_ort(v.forward, feeds)
    rng = np.random.default_rng(7)
    dy = {f"{o}_grad": rng.standard_normal(fwd[o].shape).astype(fwd[o].dtype) for o in v.outputs}
    back = run_ort(v.backward, {**feeds, **fwd, **dy})
    ops = [n.op_type for n in v.backward.graph.node if n.op_type not in ("Constant", "Identity")]
    return {k: back[f"{k}_grad"] for k in wrt}, ops, dy


# ---- exported by torch ---------------------------------------------------------------------------------------
def _export(approximate: str, opset: int, dynamo: bool):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(approximate=approximate),
                                 torch.nn.Linear(16, 3))
    x = torch.randn(5, 6)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            program = torch.onnx.export(module, (x,), dynamo=True, opset_version=opset, verbose=False)
            model = program.model_proto
        else:
            torch.onnx.export(module, (x,), buf, dynamo=False, opset_version=opset, input_names=["x"],
                              output_names=["y"], do_constant_folding=False)
            model = onnx.load_from_string(buf.getvalue())
    return module, model, x


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("opset", [17, 20])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_exported_gelu_gradients_match_torch(approximate, opset, dynamo):
    module, model, x = _export(approximate, opset, dynamo)
    xin, yout = model.graph.input[0].name, model.graph.output[0].name
    fast, fast_ops, dy = _grads(model, [xin], {xin: x.numpy()})
    plain, plain_ops, _ = _grads(model, [xin], {xin: x.numpy()}, op_by_op=True)
    xt = x.double().requires_grad_()
    module.double()(xt).backward(torch.from_numpy(dy[f"{yout}_grad"]).double())
    np.testing.assert_allclose(fast[xin], xt.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fast[xin], plain[xin], rtol=1e-5, atol=1e-6)
    has_gelu_op = any(n.op_type == "Gelu" for n in model.graph.node)
    assert has_gelu_op == (opset >= 20)
    if has_gelu_op:
        assert fast_ops == plain_ops  # nothing to group: the Gelu op's own rule
    else:
        assert len(fast_ops) < len(plain_ops), (fast_ops, plain_ops)


# ---- written by hand: every order, random shapes -------------------------------------------------------------
def _const(name, value):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, np.float32)))


SQRT2 = math.sqrt(2.0)


def _erf_nodes(order="torchscript", pre="div", sqrt2=SQRT2, half=0.5):
    """The erf GELU of x into y; ``order``: torchscript (x b) 0.5, dynamo (0.5 b) x, or hf (0.5 x) b."""
    nodes = [_const("c2", sqrt2 if pre == "div" else 1.0 / sqrt2), _const("one", 1.0), _const("half", half),
             helper.make_node("Div" if pre == "div" else "Mul", ["x", "c2"], ["s"]),
             helper.make_node("Erf", ["s"], ["e"]), helper.make_node("Add", ["e", "one"], ["b"])]
    if order == "torchscript":
        nodes += [helper.make_node("Mul", ["x", "b"], ["xb"]), helper.make_node("Mul", ["xb", "half"], ["y"])]
    elif order == "dynamo":
        nodes += [helper.make_node("Mul", ["half", "b"], ["hb"]), helper.make_node("Mul", ["x", "hb"], ["y"])]
    else:
        nodes += [helper.make_node("Mul", ["x", "half"], ["hx"]), helper.make_node("Mul", ["hx", "b"], ["y"])]
    return nodes


def _tanh_nodes(cube="pow", k=0.044715, order="torchscript"):
    """The tanh GELU of x into y: TorchScript's x (x x) cube, or dynamo's Pow(x, 3); ``order`` hf: (0.5 x) b, as
    transformers' NewGELUActivation (GPT-2) is exported."""
    nodes = [_const("three", 3.0), _const("k", k), _const("c", math.sqrt(2.0 / math.pi)), _const("one", 1.0),
             _const("half", 0.5)]
    if cube == "pow":
        nodes.append(helper.make_node("Pow", ["x", "three"], ["x3"]))
    else:
        nodes += [helper.make_node("Mul", ["x", "x"], ["x2"]), helper.make_node("Mul", ["x", "x2"], ["x3"])]
    nodes += [helper.make_node("Mul", ["k", "x3"], ["kx3"]), helper.make_node("Add", ["x", "kx3"], ["v"]),
              helper.make_node("Mul", ["c", "v"], ["u"]), helper.make_node("Tanh", ["u"], ["t"]),
              helper.make_node("Add", ["one", "t"], ["b"])]
    if order == "hf":
        return nodes + [helper.make_node("Mul", ["x", "half"], ["hx"]), helper.make_node("Mul", ["hx", "b"], ["y"])]
    return nodes + [helper.make_node("Mul", ["x", "b"], ["xb"]), helper.make_node("Mul", ["half", "xb"], ["y"])]


def _model(nodes, shape, extra_outputs=(), opset=17):
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, list(shape)) for o in ("y", *extra_outputs)]
    graph = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))], outs)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _exact(x, approximate):
    """GELU's derivative in float64 (math.erf / tanh)."""
    x = x.astype(np.float64)
    if approximate == "tanh":
        c, k = math.sqrt(2.0 / math.pi), 0.044715
        t = np.tanh(c * (x + k * x ** 3))
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * k * x * x)
    cdf = 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    return cdf + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


FORMS = [("none", dict(order="torchscript")), ("none", dict(order="dynamo")), ("none", dict(order="hf")),
         ("none", dict(order="torchscript", pre="mul")), ("tanh", dict(cube="pow")), ("tanh", dict(cube="mul")),
         ("tanh", dict(cube="pow", order="hf"))]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("approximate,form", FORMS)
def test_gelu_pattern_closed_form_matches_exact_derivative(approximate, form, seed):
    rng = np.random.default_rng(seed)
    shape = tuple(int(d) for d in rng.integers(1, 7, size=int(rng.integers(1, 4))))
    x = (3 * rng.standard_normal(shape)).astype(np.float32)
    nodes = _erf_nodes(**form) if approximate == "none" else _tanh_nodes(**form)
    model = _model(nodes, shape)
    fast, fast_ops, dy = _grads(model, ["x"], {"x": x})
    plain, plain_ops, _ = _grads(model, ["x"], {"x": x}, op_by_op=True)
    want = dy["y_grad"] * _exact(x, approximate)
    np.testing.assert_allclose(fast["x"], want, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(fast["x"], plain["x"], rtol=2e-5, atol=2e-6)
    assert len(fast_ops) < len(plain_ops), (fast_ops, plain_ops)
    if approximate == "none":
        assert "Neg" not in fast_ops and "Div" not in fast_ops and "Sum" not in fast_ops


def _if_reading(name: str, out: str):
    """A true ``cond`` and ``If(cond)`` whose branches both return ``-name`` (an outer-scope read) as ``out``."""
    def branch(tag):
        vi = helper.make_tensor_value_info(f"{out}_{tag}", TensorProto.FLOAT, [3, 4])
        return helper.make_graph([helper.make_node("Neg", [name], [f"{out}_{tag}"])], tag, [], [vi])

    cond = helper.make_node("Constant", [], ["cond"], value=numpy_helper.from_array(np.asarray(True)))
    return [cond, helper.make_node("If", ["cond"], [out], then_branch=branch("then"), else_branch=branch("else"))]


MISMATCHES = [
    ("another sqrt 2", _erf_nodes(sqrt2=1.4142), ()),
    ("another half", _erf_nodes(half=0.6), ()),
    ("another k", _tanh_nodes(k=0.05), ()),
    ("erf read twice", _erf_nodes() + [helper.make_node("Mul", ["e", "e"], ["z"])], ("z",)),
    ("s an output", _erf_nodes(), ("s",)),
    ("b read twice", _erf_nodes(order="dynamo") + [helper.make_node("Neg", ["b"], ["z"])], ("z",)),
    ("tanh read twice", _tanh_nodes() + [helper.make_node("Neg", ["t"], ["z"])], ("z",)),
    ("x^3 read twice", _tanh_nodes(cube="mul") + [helper.make_node("Neg", ["x3"], ["z"])], ("z",)),
    ("b read in a subgraph", _erf_nodes() + _if_reading("b", "z"), ("z",)),
]


@pytest.mark.parametrize("nodes,extra", [m[1:] for m in MISMATCHES], ids=[m[0] for m in MISMATCHES])
def test_gelu_pattern_that_does_not_match_exactly_stays_op_by_op(nodes, extra):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    model = _model(nodes, (3, 4), extra)
    fast, fast_ops, _ = _grads(model, ["x"], {"x": x})
    plain, plain_ops, _ = _grads(model, ["x"], {"x": x}, op_by_op=True)
    assert fast_ops == plain_ops
    np.testing.assert_array_equal(fast["x"], plain["x"])


def test_gelu_pattern_backward_reads_no_x():
    """The closed form reads the forward's s and b (and dy), not x: x need not live until the backward."""
    v = build_vjp(_model(_erf_nodes(order="dynamo"), (4, 5)), wrt=["x"])
    read = {i for n in v.backward.graph.node for i in n.input}
    assert {"s", "hb"} <= read and "x" not in read and "b" not in read


@pytest.mark.parametrize("approximate,form", [FORMS[0], FORMS[1], FORMS[4]])
def test_gelu_pattern_hessian_vector_product_matches_op_by_op(approximate, form):
    """Forward over reverse through the closed form: the same gradient and H v as the op-by-op backward."""
    from onnx_autodiff import hvp

    nodes = _erf_nodes(**form) if approximate == "none" else _tanh_nodes(**form)
    nodes = nodes + [helper.make_node("Mul", ["y", "y"], ["yy"]),
                     helper.make_node("ReduceSum", ["yy"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((3, 4)).astype(np.float32), "x.tangent": rng.standard_normal((3, 4)).astype(
        np.float32)}
    out = {}
    for closed in (True, False):
        with _op_by_op(not closed):
            out[closed] = run_ort(hvp(model, "x"), feeds)
    for k in ("x.grad", "x.hvp"):
        np.testing.assert_allclose(out[True][k], out[False][k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,approximate", [("gpt2", "tanh"), ("bert", "none")])
def test_gelu_patterns_match_transformers_exports(name, approximate):
    """transformers' GPT-2 (NewGELUActivation, the tanh form written out) and BERT (the erf form), exported by the
    TorchScript exporter at opset 17: one group per layer."""
    from gradient_rules.elementwise import gelu_patterns
    from onnx_autodiff.graph import GraphView
    from tests.hf_models import build, export

    module, inputs = build(name)
    model = export(module, inputs, "ts17")
    found = gelu_patterns(GraphView.of_model(model), list(model.graph.node))
    kinds = [next(a.s.decode() for a in node.attribute if a.name == "approximate") for node, _ in found]
    assert kinds == [approximate] * 2  # the tiny models have two layers


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_op_gradient_matches_exact_derivative(approximate):
    """The Gelu op (opset 20): the erf form in the patterns' closed form, 10 backward nodes (was 11)."""
    rng = np.random.default_rng(6)
    x = (3 * rng.standard_normal((3, 5, 4))).astype(np.float32)
    model = _model([helper.make_node("Gelu", ["x"], ["y"], approximate=approximate)], x.shape, opset=20)
    grads, ops, dy = _grads(model, ["x"], {"x": x})
    np.testing.assert_allclose(grads["x"], dy["y_grad"] * _exact(x, approximate), rtol=2e-5, atol=2e-6)
    if approximate == "none":
        assert len(ops) == 10 and "Neg" not in ops, ops
