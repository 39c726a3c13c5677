"""The LSTM's HVP (issue 38): the backward recomputes the gates of all steps at once from Y
(``gradient_rules/lstm_backward.py``) and, in ``hvp``, takes those pre-activations and their tangents from the
forward's closed-form tangent instead of computing them again (and the sweep's per-step factors, with their
tangents). Held against the forms before it (``lstm_hvp_share_factors=False``, ``lstm_hvp_share=False``,
``lstm_batched_backward=False``) and against central differences of the gradient; the
batched backward as a plain gradient (``lstm_batched_backward=True``) against the step-by-step one, which
tests/rules/test_recurrent_torch.py holds against torch."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_autodiff as oa
from onnx_autodiff.engine.builder import emit_options
from tests.models import model, vi


def lstm_loss(dtype=TensorProto.FLOAT, t=4, b=3, i=5, h=6, bias=True, h0=True, c0=True, outputs=("y", "yh", "yc"),
              direction="forward", layout=0):
    """One LSTM node (every weight and state a graph input) and a scalar loss that reads the outputs asked for:
    sum(K * Y^2) + sum(Y_h * Y_c), or the parts of it those outputs allow."""
    dirs = 2 if direction == "bidirectional" else 1
    rng = np.random.default_rng(t + h + dirs)
    np_type = np.float64 if dtype == TensorProto.DOUBLE else np.float32
    x_shape = [b, t, i] if layout else [t, b, i]
    state = [b, dirs, h] if layout else [dirs, b, h]
    shapes = {"x": x_shape, "W": [dirs, 4 * h, i], "R": [dirs, 4 * h, h], "B": [dirs, 8 * h], "h0": state,
              "c0": state}
    used = {"x": True, "W": True, "R": True, "B": bias, "h0": h0, "c0": c0}
    names = [k if used[k] else "" for k in ("x", "W", "R", "B")] + ["", "h0" if h0 else "", "c0" if c0 else ""]
    outs = [o if o in outputs else "" for o in ("y", "yh", "yc")]
    nodes = [helper.make_node("LSTM", names, outs, hidden_size=h, direction=direction, layout=layout, name="lstm")]
    y_shape = [b, t, dirs, h] if layout else [t, dirs, b, h]
    terms = []
    if "y" in outputs:
        nodes += [helper.make_node("Mul", ["y", "y"], ["y2"]), helper.make_node("Mul", ["y2", "K"], ["ky2"]),
                  helper.make_node("ReduceSum", ["ky2"], ["l_y"], keepdims=0)]
        terms.append("l_y")
    states = [o for o in ("yh", "yc") if o in outputs]
    if states:  # Y_h * Y_c, or the one state squared
        nodes += [helper.make_node("Mul", [states[0], states[-1]], ["s2"]),
                  helper.make_node("ReduceSum", ["s2"], ["l_s"], keepdims=0)]
        terms.append("l_s")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    k = numpy_helper.from_array(rng.uniform(0.5, 1.5, y_shape).astype(np_type), "K")
    inputs = [k for k, u in used.items() if u]
    m = model(nodes, [vi(n, shapes[n], dtype) for n in inputs], [vi("loss", [], dtype)], [k])
    scale = {"W": 0.8, "R": 0.8, "B": 0.5}
    feeds = {n: (rng.uniform(-scale[n], scale[n], shapes[n]) if n in scale else rng.standard_normal(shapes[n])
                 ).astype(np_type) for n in inputs}
    tangents = {f"{n}.tangent": rng.standard_normal(shapes[n]).astype(np_type) for n in inputs}
    return m, inputs, feeds, tangents


def run(m, feeds):
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in m.graph.output], s.run(None, feeds)))


def count(m, op_type):
    return [n.op_type for n in m.graph.node].count(op_type)


VARIANTS = [dict(), dict(bias=False, h0=False, c0=False), dict(outputs=("yh",)), dict(outputs=("y",)),
            dict(outputs=("yc",), c0=False), dict(t=1), dict(direction="reverse"), dict(direction="bidirectional")]


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "all")
def test_hvp_matches_the_forms_before(kw):
    m, wrt, feeds, tangents = lstm_loss(**kw)
    new = oa.hvp(m, wrt)
    with emit_options(lstm_hvp_share_factors=False):
        only_a = oa.hvp(m, wrt)
    with emit_options(lstm_hvp_share=False, lstm_batched_backward=True):
        unshared = oa.hvp(m, wrt)
    with emit_options(lstm_batched_backward=False):
        old = oa.hvp(m, wrt)
    closed_form = kw.get("direction", "forward") == "forward" and not kw.get("layout")
    assert count(new, "LSTM") == (0 if closed_form else 1)
    if closed_form and "y" in kw.get("outputs", "y"):  # the backward's recomputation is gone
        assert count(new, "Sigmoid") == kw.get("t", 4)  # one a step, the forward's
        assert count(only_a, "Sigmoid") == count(new, "Sigmoid") + 1  # the gates over all steps, from Y
        assert count(only_a, "Gemm") < count(unshared, "Gemm")  # the pre-activations over all steps
    a = run(new, {**feeds, **tangents})
    for form in (only_a, unshared, old):
        b = run(form, {**feeds, **tangents})
        assert a.keys() == b.keys() and len(a) == 1 + 2 * len(wrt)
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-5 * float(np.abs(b[k]).max()), err_msg=k)


def assert_central_differences(h, wrt, feeds, tangents, nonzero=False):
    """The HVP model ``h`` (float64) against (g(w + e v) - g(w - e v)) / 2e of its own gradient outputs."""
    at = run(h, {**feeds, **tangents})
    eps = 1e-5
    side = [run(h, {**{w: feeds[w] + s * eps * tangents[f"{w}.tangent"] for w in wrt}, **tangents})
            for s in (1.0, -1.0)]
    for w in wrt:
        fd = (side[0][f"{w}.grad"] - side[1][f"{w}.grad"]) / (2 * eps)
        hv = at[f"{w}.hvp"]
        if nonzero:
            assert float(np.abs(hv).max()) > 1e-3, w  # a zero HVP would pass any difference
        np.testing.assert_allclose(hv, fd, rtol=1e-6, atol=1e-6 * float(np.abs(fd).max()), err_msg=w)


@pytest.mark.parametrize("kw", [dict(), dict(bias=False, h0=False, c0=False)], ids=["all", "bare"])
def test_hvp_against_central_differences_of_the_gradient(kw):
    """float64 (the HVP has no fused LSTM left to run): H v against (g(w + e v) - g(w - e v)) / 2e."""
    m, wrt, feeds, tangents = lstm_loss(TensorProto.DOUBLE, **kw)
    h = oa.hvp(m, wrt)
    assert count(h, "LSTM") == 0
    assert_central_differences(h, wrt, feeds, tangents, nonzero=True)


def gradient(m, wrt):
    out = m.__class__()
    out.CopyFrom(m)
    grads = [f"{w}.grad" for w in wrt]
    out.graph.node.append(helper.make_node("Gradient", wrt, grads, domain="ai.onnx.preview.training", xs=wrt,
                                           y="loss", name="grad"))
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in m.graph.input}
    out.graph.output.extend(vi(gname, shapes[w]) for gname, w in zip(grads, wrt))
    out.opset_import.append(helper.make_opsetid("ai.onnx.preview.training", 1))
    return oa.lower(out)


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "all")
def test_batched_gradient_matches_the_step_by_step_one(kw):
    m, wrt, feeds, _ = lstm_loss(**kw)
    with emit_options(lstm_batched_backward=True):
        new = gradient(m, wrt)
    old = gradient(m, wrt)
    assert count(new, "Sigmoid") < count(old, "Sigmoid") or "y" not in kw.get("outputs", "y")
    a, b = run(new, feeds), run(old, feeds)
    assert a.keys() == b.keys() and len(a) == 1 + len(wrt)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-5 * float(np.abs(b[k]).max()), err_msg=k)


def stacked(dtype=TensorProto.DOUBLE, t=3, b=2, i=4, h=5):
    """Two LSTMs, the second reading the first's Y: the tangent of an LSTM's X comes from another's closed form."""
    rng = np.random.default_rng(11)
    np_type = np.float64 if dtype == TensorProto.DOUBLE else np.float32
    shapes = {"x": [t, b, i], "W1": [1, 4 * h, i], "R1": [1, 4 * h, h], "B1": [1, 8 * h], "W2": [1, 4 * h, h],
              "R2": [1, 4 * h, h]}
    nodes = [helper.make_node("LSTM", ["x", "W1", "R1", "B1"], ["y1"], hidden_size=h, name="first"),
             helper.make_node("Squeeze", ["y1", "one"], ["x2"]),
             helper.make_node("LSTM", ["x2", "W2", "R2"], ["y2", "yh2"], hidden_size=h, name="second"),
             helper.make_node("Mul", ["y2", "y2"], ["y22"]),
             helper.make_node("ReduceSum", ["y22"], ["l_y"], keepdims=0),
             helper.make_node("ReduceSum", ["yh2"], ["l_h"], keepdims=0),
             helper.make_node("Add", ["l_y", "l_h"], ["loss"])]
    inits = [numpy_helper.from_array(np.array([1], np.int64), "one")]
    m = model(nodes, [vi(n, s, dtype) for n, s in shapes.items()], [vi("loss", [], dtype)], inits)
    feeds = {n: rng.uniform(-0.7, 0.7, s).astype(np_type) for n, s in shapes.items()}
    tangents = {f"{n}.tangent": rng.standard_normal(s).astype(np_type) for n, s in shapes.items()}
    return m, list(shapes), feeds, tangents


def test_stacked_lstms():
    """float64 against central differences, float32 against the form before."""
    m, wrt, feeds, tangents = stacked()
    h = oa.hvp(m, wrt)
    assert count(h, "LSTM") == 0 and count(h, "Sigmoid") == 2 * 3
    assert_central_differences(h, wrt, feeds, tangents)
    m, wrt, feeds, tangents = stacked(TensorProto.FLOAT)
    with emit_options(lstm_batched_backward=False):
        old = run(oa.hvp(m, wrt), {**feeds, **tangents})
    new = run(oa.hvp(m, wrt), {**feeds, **tangents})
    for k in new:
        np.testing.assert_allclose(new[k], old[k], rtol=1e-5, atol=1e-5 * float(np.abs(old[k]).max()), err_msg=k)
