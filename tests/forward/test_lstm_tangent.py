"""The LSTM's closed-form tangent (gradient_rules/lstm_tangent.py): the fused node replaced by one unrolled
recurrence that carries primal and tangent together, held against the reverse mode (jvp_check, float64) and
against the form before it (the fused node kept, the tangents pushed through an unrolled copy)."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnx_autodiff as oa
from onnx_autodiff.engine.builder import emit_options
from tests.models import model, vi

F = TensorProto.FLOAT


def lstm(t=4, b=3, i=5, h=6, bias=True, h0=True, c0=True, outputs=("y", "yh", "yc"), direction="forward"):
    rng = np.random.default_rng(t + h)
    inits = {"W": rng.uniform(-0.8, 0.8, (1, 4 * h, i)), "R": rng.uniform(-0.8, 0.8, (1, 4 * h, h))}
    if bias:
        inits["B"] = rng.uniform(-0.5, 0.5, (1, 8 * h))
    inputs = [vi("x", [t, b, i], F)]
    if h0:
        inputs.append(vi("h0", [1, b, h], F))
    if c0:
        inputs.append(vi("c0", [1, b, h], F))
    names = ["x", "W", "R", "B" if bias else "", "", "h0" if h0 else "", "c0" if c0 else ""]
    outs = [o if o in outputs else "" for o in ("y", "yh", "yc")]
    shapes = {"y": [t, 1, b, h], "yh": [1, b, h], "yc": [1, b, h]}
    node = helper.make_node("LSTM", names, outs, hidden_size=h, direction=direction, name="node")
    m = model([node], inputs, [vi(o, shapes[o], F) for o in outs if o],
              {k: v.astype(np.float32) for k, v in inits.items()})
    feeds = {v.name: rng.standard_normal([d.dim_value for d in v.type.tensor_type.shape.dim]).astype(np.float32)
             for v in inputs}
    return m, feeds


def run(m, feeds):
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in m.graph.output], s.run(None, feeds)))


def tangents_for(m, feeds, wrt, seed=7, dtype=np.float32):
    """A random tangent for each name of ``wrt`` (an initializer or a feed), shaped like it."""
    rng = np.random.default_rng(seed)
    shapes = {**{t.name: tuple(t.dims) for t in m.graph.initializer}, **{k: v.shape for k, v in feeds.items()}}
    return {f"{w}.tangent": rng.standard_normal(shapes[w]).astype(dtype) for w in wrt}


VARIANTS = [dict(), dict(bias=False, h0=False, c0=False), dict(outputs=("yh",)), dict(outputs=("yc",), c0=False),
            dict(t=1), dict(h0=False)]


def jvp_against_option(kw, **option):
    """The JVP models of ``lstm(**kw)`` with respect to everything, built by default and under ``emit_options(
    **option)``, held to the same tangents (and outputs); returned as (default, optioned)."""
    m, feeds = lstm(**kw)
    wrt = [t.name for t in m.graph.initializer] + [k for k in feeds if k != "x"] + ["x"]
    new = oa.jvp(m, wrt)
    with emit_options(**option):
        old = oa.jvp(m, wrt)
    tangents = tangents_for(m, feeds, wrt)
    a, b = run(new, {**feeds, **tangents}), run(old, {**feeds, **tangents})
    assert a.keys() == b.keys() and len(a) == 2 * len(m.graph.output)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-5 * float(np.abs(b[k]).max()), err_msg=k)
    return new, old


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "all")
def test_closed_form_matches_the_unrolled_push_and_drops_the_fused_node(kw):
    fast, old = jvp_against_option(kw, lstm_tangent=False)
    assert [n.op_type for n in old.graph.node].count("LSTM") == 1
    assert "LSTM" not in [n.op_type for n in fast.graph.node]


@pytest.mark.parametrize("kw", VARIANTS[:4], ids=["all", "bare", "yh-only", "yc-only"])
def test_closed_form_against_the_reverse_mode(kw):
    m, feeds = lstm(**kw)
    assert oa.jvp_check(m, feeds).ok


def test_other_directions_keep_the_unrolled_push():
    m, feeds = lstm(direction="reverse")
    assert "LSTM" in [n.op_type for n in oa.jvp(m, ["W"]).graph.node]
    assert oa.jvp_check(m, feeds, wrt=["W", "x"]).ok
