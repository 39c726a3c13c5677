"""Ops without a hand rule differentiated through the function body of their schema.

Each op here has no registered rule and no no-gradient declaration, so lowering a Gradient through
it expands the node into its body (at the model's opset) and differentiates that. float64 cases run
through the finite-difference check; ops onnxruntime runs only in float32 (its native kernel is
used for the forward) are held against torch float64 autograd.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper

import onnx_autodiff as oa
from onnx_autodiff.conformance.cases import function_ops as function_op_cases
from onnx_autodiff.engine.function_ops import expand_function_nodes, function_body, without_subgraphs
from onnx_autodiff.engine.registry import find_rule, is_non_differentiable
from onnx_autodiff.errors import UnsupportedOperatorError
from onnx_autodiff.graph import used_names
from onnx_autodiff.testing import In, RuleCase, check_rule_case, rule_case_model
from tests.rules.test_conv_torch import assert_matches_torch

TRAIN = "ai.onnx.preview.training"


def ints(v):
    return In(value=np.asarray(v, dtype=np.int64), dtype="int64")


def f32(*shape, **kw):
    return In(shape, dtype="float32", **kw)


FLOAT64 = [c for c in function_op_cases.CASES if c.float64]


def _lowered_gradient(case: RuleCase):
    model, feeds, wrt = rule_case_model(case)
    g = model.graph
    g.node.append(helper.make_node("Gradient", wrt, [f"{w}_grad" for w in wrt], name="grad", domain=TRAIN,
                                   xs=wrt, y=g.output[0].name))
    model.opset_import.append(helper.make_opsetid(TRAIN, 1))
    return oa.lower(model)


def _no_rule(op: str, opset: int):
    assert find_rule("", op, opset) is None and not is_non_differentiable("", op), (
        f"{op} now has a rule or a no-gradient declaration: this test exercises function expansion")


@pytest.mark.parametrize("case", FLOAT64, ids=[c.name for c in FLOAT64])
def test_function_op_gradcheck(case):
    _no_rule(case.op, case.opset)
    report = check_rule_case(case)
    assert report.ok and report.checks, str(report)
    assert case.op not in {n.op_type for n in _lowered_gradient(case).graph.node}


# ---- float32-only ops: the lowered gradient against torch float64 autograd ------------------------
def mvn(axes):
    def fn(x0):
        mean = x0.mean(dim=axes, keepdim=True)
        var = (x0 ** 2).mean(dim=axes, keepdim=True) - mean ** 2
        return (x0 - mean) / (var.sqrt() + 1e-9)
    return fn


def rotary(x0, x1, x2):
    """RotaryEmbedding on [batch, heads, seq, head] with [batch, seq, head/2] caches, halves rotated."""
    half = x0.shape[-1] // 2
    a, b = x0[..., :half], x0[..., half:]
    cos, sin = x1[:, None], x2[:, None]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


TORCH = [
    (RuleCase("MeanVarianceNormalization", [f32(2, 3, 4, 5)], attrs={"axes": [0, 2, 3]}, opset=18, id="opset18"),
     mvn([0, 2, 3])),
    (RuleCase("MeanVarianceNormalization", [f32(2, 3, 4)], attrs={"axes": [1]}, opset=13, id="axis1-opset13"),
     mvn([1])),
    (RuleCase("RotaryEmbedding", [f32(2, 2, 3, 4), f32(2, 3, 2), f32(2, 3, 2)], opset=23, id="cdf"), rotary),
]


@pytest.mark.parametrize("case,fn", TORCH, ids=[c.name for c, _ in TORCH])
def test_function_op_against_torch(case, fn):
    _no_rule(case.op, case.opset)
    assert_matches_torch(case, fn)


def test_default_attribute_is_substituted():
    """MVN without ``axes``: the body's ``@axes`` reference takes the schema default [0, 2, 3]
    (onnx's own shape inference of the body misses this, so the model is typed by hand)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 4, 2)).astype(np.float32)
    v = rng.standard_normal((3, 2, 4, 2)).astype(np.float32)
    vi = lambda n: helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [3, 2, 4, 2])  # noqa: E731
    nodes = [helper.make_node("MeanVarianceNormalization", ["x"], ["y"], name="mvn"),
             helper.make_node("Mul", ["y", "v"], ["yv"], name="mul"),
             helper.make_node("ReduceSum", ["yv"], ["s"], name="sum", keepdims=0),
             helper.make_node("Gradient", ["x"], ["dx"], name="grad", domain=TRAIN, xs=["x"], y="s")]
    model = helper.make_model(helper.make_graph(nodes, "mvn", [vi("x"), vi("v")], [vi("y"), vi("dx")]),
                              opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid(TRAIN, 1)])
    model.ir_version = 10
    y, dx = ort.InferenceSession(oa.lower(model).SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "v": v})
    t = torch.tensor(x.astype(np.float64), requires_grad=True)
    ref = mvn([0, 2, 3])(t)
    (ref * torch.tensor(v.astype(np.float64))).sum().backward()
    np.testing.assert_allclose(y, ref.detach().numpy(), rtol=1e-4, atol=1e-5)
    grad = t.grad.numpy()
    assert np.abs(dx - grad).max() <= 1e-4 * np.abs(grad).max()


@pytest.mark.parametrize("case", [c for c, _ in TORCH] + FLOAT64[:1],
                         ids=[c.name for c, _ in TORCH] + [FLOAT64[0].name])
def test_expanded_forward_matches_the_native_kernel(case):
    """The instantiated body (attributes and their schema defaults substituted) computes what
    onnxruntime's own kernel computes."""
    model, feeds, _ = rule_case_model(case)
    expanded = onnx.ModelProto()
    expanded.CopyFrom(model)
    assert expand_function_nodes(expanded, lambda n: n.op_type == case.op, used_names(expanded))
    assert case.op not in {n.op_type for n in expanded.graph.node}
    onnx.checker.check_model(expanded, full_check=True)
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]  # noqa: E731
    np.testing.assert_allclose(run(expanded), run(model), rtol=1e-5, atol=1e-6)


def test_body_with_control_flow_is_not_expanded():
    """AffineGrid's body branches with If; the walk would not see the branches' reads, so the op
    stays a missing rule rather than getting a silent zero gradient."""
    case = RuleCase("AffineGrid", [In((2, 2, 3)), ints([2, 1, 3, 4])], opset=20)
    body = function_body(rule_case_model(case)[0].graph.node[0], 20)
    assert body is not None and not without_subgraphs(body)
    with pytest.raises(UnsupportedOperatorError, match="AffineGrid"):
        _lowered_gradient(case)


def test_no_body_at_the_model_opset_stays_a_missing_rule():
    """MVN has bodies for opsets 13 and 18: none before 13, and never one newer than the model."""
    node = helper.make_node("MeanVarianceNormalization", ["x"], ["y"])
    assert function_body(node, 8) is None
    assert function_body(node, 13).opset_import[0].version <= 13


def test_expansion_leaves_ops_with_rules_alone():
    case = RuleCase("LayerNormalization", [In((2, 3)), In((3,)), In((3,))], opset=17)
    assert find_rule("", "LayerNormalization", 17) is not None
    assert "LayerNormalization" in {n.op_type for n in _lowered_gradient(case).graph.node}


def test_second_order_through_an_expanded_body():
    """Every op of an expanded body has a rule, so the gradient can be differentiated again."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, [2, 3])
    nodes = [
        helper.make_node("Swish", ["x"], ["y"], name="swish", alpha=0.7),
        helper.make_node("Gradient", ["x"], ["dx"], name="g1", domain=TRAIN, xs=["x"], y="y"),
        helper.make_node("Gradient", ["x"], ["ddx"], name="g2", domain=TRAIN, xs=["x"], y="dx"),
    ]
    out = helper.make_tensor_value_info("ddx", onnx.TensorProto.DOUBLE, [2, 3])
    model = helper.make_model(helper.make_graph(nodes, "second", [x], [out]),
                              opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid(TRAIN, 1)])
    model.ir_version = 10
    xv = np.random.default_rng(0).standard_normal((2, 3))
    got = ort.InferenceSession(oa.lower(model).SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": xv})[0]
    t = torch.tensor(xv, requires_grad=True)
    y = t * torch.sigmoid(float(np.float32(0.7)) * t)  # the attribute is a float32
    (d,) = torch.autograd.grad(y.sum(), t, create_graph=True)
    (dd,) = torch.autograd.grad(d.sum(), t)
    np.testing.assert_allclose(got, dd.numpy(), rtol=1e-10)


@pytest.mark.parametrize("kind", ["If", "Scan"])
def test_function_op_in_a_body_gradcheck(kind):
    """A function op without a rule inside a branch or a loop body on the gradient path is expanded there too
    (it was "no gradient rule for node ...: op 'RMSNormalization'")."""
    D = onnx.TensorProto.DOUBLE
    vi = helper.make_tensor_value_info
    rms = helper.make_node("RMSNormalization", ["h_in", "gamma"], ["h_norm"], axis=-1)
    if kind == "If":
        then = helper.make_graph([helper.make_node("Identity", ["x"], ["h_in"]), rms], "then", [],
                                 [vi("h_norm", D, [2, 3])])
        other = helper.make_graph([helper.make_node("Sin", ["x"], ["s"])], "else", [], [vi("s", D, [2, 3])])
        nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)]
        inputs = [vi("x", D, [2, 3]), vi("gamma", D, [3]), vi("cond", onnx.TensorProto.BOOL, [])]
        outputs = [vi("y", D, [2, 3])]
    else:
        body = helper.make_graph([helper.make_node("Add", ["h", "x_t"], ["h_in"]), rms,
                                  helper.make_node("Tanh", ["h_norm"], ["h_next"]),
                                  helper.make_node("Identity", ["h_next"], ["y_t"])], "cell",
                                 [vi("h", D, [2, 3]), vi("x_t", D, [2, 3])],
                                 [vi("h_next", D, [2, 3]), vi("y_t", D, [2, 3])])
        nodes = [helper.make_node("Scan", ["h0", "x"], ["h_T", "y"], body=body, num_scan_inputs=1)]
        inputs = [vi("h0", D, [2, 3]), vi("x", D, [4, 2, 3]), vi("gamma", D, [3])]
        outputs = [vi("h_T", D, [2, 3]), vi("y", D, [4, 2, 3])]
    model = helper.make_model(helper.make_graph(nodes, "body", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 11
    onnx.checker.check_model(model, full_check=True)
    rng = np.random.default_rng(3)
    feeds = {i.name: rng.uniform(0.3, 1.5, [d.dim_value for d in i.type.tensor_type.shape.dim])
             for i in inputs if i.type.tensor_type.elem_type == D}
    if kind == "If":
        feeds["cond"] = np.array(True)
    wrt = [n for n in feeds if n != "cond"]
    report = oa.gradcheck(model, feeds, wrt=wrt)
    assert report.ok and len(report.checks) == len(wrt), str(report)
