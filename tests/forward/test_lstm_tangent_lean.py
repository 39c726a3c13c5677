"""The LSTM tangent's lean step (``lstm_tangent_lean``, gradient_rules/lstm_tangent.py: the cell gate's rows
pre-scaled so one Sigmoid gives every gate): held against the step before it (``lstm_tangent_lean=False``) and
against central differences of the fused LSTM node in float64."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import onnx_autodiff as oa
from tests.forward.test_lstm_tangent import VARIANTS, jvp_against_option, run, tangents_for
from tests.models import model, vi


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "all")
def test_lean_step_matches_the_step_before_it(kw):
    lean, before = jvp_against_option(kw, lstm_tangent_lean=False)
    ops, ops_before = ([n.op_type for n in g.graph.node] for g in (lean, before))
    steps = kw.get("t", 4)
    assert ops.count("Sigmoid") == ops_before.count("Sigmoid") == steps
    assert ops.count("Tanh") == steps and ops_before.count("Tanh") == 2 * steps  # tanh(c) only: cc = 2 s - 1


def lstm64(t=5, b=2, i=3, h=4):
    """A small forward LSTM in float64 with every input (bias, initial h and c)."""
    rng = np.random.default_rng(3)
    d = TensorProto.DOUBLE
    inits = {"W": rng.uniform(-0.9, 0.9, (1, 4 * h, i)), "R": rng.uniform(-0.9, 0.9, (1, 4 * h, h)),
             "B": rng.uniform(-0.5, 0.5, (1, 8 * h))}
    inputs = [vi("x", [t, b, i], d), vi("h0", [1, b, h], d), vi("c0", [1, b, h], d)]
    node = helper.make_node("LSTM", ["x", "W", "R", "B", "", "h0", "c0"], ["y", "yh", "yc"], hidden_size=h,
                            name="node")
    outs = [vi("y", [t, 1, b, h], d), vi("yh", [1, b, h], d), vi("yc", [1, b, h], d)]
    m = model([node], inputs, outs, inits)
    feeds = {v.name: rng.standard_normal([dim.dim_value for dim in v.type.tensor_type.shape.dim]) for v in inputs}
    return m, feeds, inits


def lstm_reference(x, W, R, B, h0, c0):
    """ONNX's LSTM (one forward direction, gates i, o, f, c, default activations) in numpy."""
    sigmoid = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    h, c, ys, n = h0[0], c0[0], [], R.shape[-1]
    for x_t in x:
        a = x_t @ W[0].T + h @ R[0].T + B[0, :4 * n] + B[0, 4 * n:]
        i, o, f, cc = sigmoid(a[:, :n]), sigmoid(a[:, n:2 * n]), sigmoid(a[:, 2 * n:3 * n]), np.tanh(a[:, 3 * n:])
        c = f * c + i * cc
        h = o * np.tanh(c)
        ys.append(h)
    return {"y": np.stack(ys)[:, None], "yh": h[None], "yc": c[None]}


def test_reference_is_onnxruntimes_lstm():
    m, feeds, inits = lstm64()
    m32 = model(m.graph.node, [vi(v.name, [d.dim_value for d in v.type.tensor_type.shape.dim], TensorProto.FLOAT)
                               for v in m.graph.input],
                [vi(v.name, None, TensorProto.FLOAT) for v in m.graph.output],
                {k: v.astype(np.float32) for k, v in inits.items()})
    got = run(m32, {k: v.astype(np.float32) for k, v in feeds.items()})
    want = lstm_reference(**feeds, **inits)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_lean_step_against_central_differences():
    """float64 (onnxruntime's LSTM has no double kernel: central differences of the numpy reference)."""
    m, feeds, inits = lstm64()
    wrt = list(inits) + list(feeds)
    j = oa.jvp(m, wrt)
    assert "LSTM" not in [n.op_type for n in j.graph.node] and "Tanh" in [n.op_type for n in j.graph.node]
    tangents = tangents_for(m, feeds, wrt, dtype=np.float64)
    got = run(j, {**feeds, **tangents})

    def at(eps):  # the LSTM's outputs with every input moved by eps along its tangent
        return lstm_reference(**{k: v + eps * tangents[f"{k}.tangent"] for k, v in {**inits, **feeds}.items()})

    eps = 1e-5
    base, plus, minus = at(0.0), at(eps), at(-eps)
    assert set(got) == {"y", "yh", "yc", "y.tangent", "yh.tangent", "yc.tangent"}
    for k in ("y", "yh", "yc"):
        np.testing.assert_allclose(got[k], base[k], rtol=1e-12, atol=1e-14, err_msg=k)  # the replaced outputs
        central = (plus[k] - minus[k]) / (2 * eps)
        np.testing.assert_allclose(got[f"{k}.tangent"], central, rtol=1e-6, atol=1e-7 * float(np.abs(central).max()),
                                   err_msg=k)
