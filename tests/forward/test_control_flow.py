"""Forward mode through If, Scan and Loop (their JVP rules push the tangents through the bodies): the JVP
against the reverse mode exactly, and against central differences; and one tangent node per control-flow
node, not the fallback's tape and reverse sweeps."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

import onnx_autodiff as oa
from tests.rules.test_control_flow import (
    feeds_for,
    if_feeds,
    if_model,
    loop_model,
    loop_outer_model,
    loop_with_if_on_iteration,
    nested_if_model,
    outer_w_scan_model,
    scan_model,
)
from tests.torch_export import session

SCANS = {"scan": lambda: scan_model(), "scan-reverse-axis1": lambda: scan_model(1, 1, 1, 1),
         "scan-opset11": lambda: scan_model(opset=11), "scan-outer-weight": outer_w_scan_model}
LOOPS = {"loop": lambda: loop_model(), "loop-cond": lambda: loop_model(with_cond=True),
         "loop-outer": lambda: loop_outer_model(), "loop-outer-cond": lambda: loop_outer_model(with_cond=True)}


@pytest.mark.parametrize("name", list(SCANS) + list(LOOPS))
def test_scan_and_loop_jvp_match_the_gradient(name):
    model = (SCANS | LOOPS)[name]()
    wrt = [i.name for i in model.graph.input if i.name in ("h0", "W", "W0", "xs")]
    report = oa.jvp_check(model, feeds_for(model), wrt=wrt)
    assert report.ok and len(report.checks) == len(wrt), str(report)


@pytest.mark.parametrize("taken", [True, False], ids=["then", "else"])
@pytest.mark.parametrize("kind", ["constant", "dynamic"])
def test_if_jvp_matches_the_gradient(kind, taken):
    model = if_model(taken if kind == "constant" else None)
    feeds = if_feeds(model) if kind == "constant" else if_feeds(model, cond=taken)
    report = oa.jvp_check(model, feeds, wrt=["a", "b", "c"])
    assert report.ok and len(report.checks) == 3, str(report)


@pytest.mark.parametrize("cond", [True, None], ids=["constant", "dynamic"])
@pytest.mark.parametrize("cond2", [True, False])
def test_nested_if_jvp_matches_the_gradient(cond, cond2):
    model = nested_if_model(cond)
    conds = {k: v for k, v in (("cond", True), ("cond2", cond2)) if k in {i.name for i in model.graph.input}}
    report = oa.jvp_check(model, if_feeds(model, **conds), wrt=["a", "b", "c"])
    assert report.ok, str(report)


def test_scan_jvp_matches_central_differences():
    model = scan_model()
    feeds = feeds_for(model)
    wrt = ["h0", "W0", "xs"]
    out = oa.jvp(model, wrt)
    rng = np.random.default_rng(3)
    v = {w: rng.standard_normal(feeds[w].shape) for w in wrt}
    got = session(out).run(["ys.tangent"], {**feeds, **{f"{w}.tangent": v[w] for w in wrt}})[0]
    run = session(model)
    eps = 1e-6
    plus = run.run(["ys"], {w: feeds[w] + eps * v[w] for w in wrt})[0]
    minus = run.run(["ys"], {w: feeds[w] - eps * v[w] for w in wrt})[0]
    np.testing.assert_allclose(got, (plus - minus) / (2 * eps), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", ["scan", "loop-outer", "if"])
def test_one_tangent_node_per_control_flow_node(name):
    model = {**SCANS, **LOOPS, "if": lambda: if_model(None)}[name]()
    wrt = [i.name for i in model.graph.input if i.type.tensor_type.elem_type == TensorProto.DOUBLE]
    ops = [n.op_type for n in oa.jvp(model, wrt).graph.node]
    assert ops == [ops[0], ops[0]], ops


def test_if_inside_a_loop_body_matches_the_gradient():
    model = loop_with_if_on_iteration()
    report = oa.jvp_check(model, feeds_for(model), wrt=["h0", "W", "xs"])
    assert report.ok and len(report.checks) == 3, str(report)
