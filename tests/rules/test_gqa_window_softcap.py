"""GroupQueryAttention's softcap and local window (the builder's Gemma2 / Gemma3 attention) against a float64 numpy
reference of the documented formula: onnxruntime's float32 kernel and our standard form (in float64) give it. The
rule's gradient is held to finite differences over that form in the sweep (conformance/cases/contrib_attention.py)."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_autodiff.check.gradcheck import to_float64
from onnx_autodiff.conformance.cases.contrib_attention import CASES
from onnx_autodiff.errors import GradientRuleError
from onnx_autodiff.partial.vjp import build_vjp
from onnx_autodiff.testing.rule_cases import rule_case_model, substitute

_CASES = {c.id: c for c in CASES if c.op == "GroupQueryAttention"}


def _rotate(x, cos, sin, interleaved):
    """x [B, S, heads, H] on its first 2 * cos.shape[1] features, positions 0..S-1."""
    half = cos.shape[1]
    c, s = cos[: x.shape[1], None, :], sin[: x.shape[1], None, :]
    part = x[..., : 2 * half]
    x1, x2 = (part[..., 0::2], part[..., 1::2]) if interleaved else (part[..., :half], part[..., half:])
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    out = np.stack([o1, o2], -1).reshape(part.shape) if interleaved else np.concatenate([o1, o2], -1)
    return np.concatenate([out, x[..., 2 * half:]], -1)


def reference(attrs: dict, q, k, v, seqlens, cos=None, sin=None):
    """The op's documented formula in float64: scores q k^T * scale, softcap * tanh(scores / softcap), key j
    seen by query i when j <= seqlens[b] and causally j <= i and min(i, seqlens[b]) - j < local_window_size."""
    n, nkv = attrs["num_heads"], attrs["kv_num_heads"]
    b, s = q.shape[:2]
    h = q.shape[-1] // n
    q, k, v = (t.reshape(b, s, -1, h) for t in (q, k, v))
    if attrs.get("do_rotary"):
        q, k = (_rotate(t, cos, sin, attrs.get("rotary_interleaved", 0)) for t in (q, k))
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
    k, v = np.repeat(k, n // nkv, 1), np.repeat(v, n // nkv, 1)
    scores = q @ k.transpose(0, 1, 3, 2) * (attrs.get("scale") or 1 / np.sqrt(h))
    cap = attrs.get("softcap", 0.0)
    if cap > 0:
        scores = cap * np.tanh(scores / cap)
    i, j, last = np.arange(s)[None, :, None], np.arange(s)[None, None, :], np.asarray(seqlens)[:, None, None]
    seen = (j <= last) & (j <= i)
    if attrs.get("local_window_size", -1) > 0:
        seen &= np.minimum(i, last) - j < attrs["local_window_size"]
    scores = np.where(seen[:, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ v).transpose(0, 2, 1, 3).reshape(b, s, n * h)


@pytest.mark.parametrize("case_id", ["softcap", "local-window-padded", "window-softcap-separate"])
def test_kernel_and_form_give_the_documented_formula(case_id):
    case = _CASES[case_id]
    model, feeds, _ = rule_case_model(case)
    values = {**feeds, **{t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}}
    x = [values.get(f"x{i}") for i in range(9)]
    if x[1] is None:
        nh, nkv = case.attrs["num_heads"], case.attrs["kv_num_heads"]
        h = x[0].shape[-1] // (nh + 2 * nkv)
        q, k, v = np.split(x[0].astype(np.float64), [nh * h, (nh + nkv) * h], axis=-1)
    else:
        q, k, v = (t.astype(np.float64) for t in x[:3])
    want = reference(case.attrs, q, k, v, x[5], *(t if t is None else t.astype(np.float64) for t in x[7:9]))

    kernel = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(kernel, want, rtol=1e-5, atol=1e-5)
    form64 = to_float64(substitute(case.reference)(model))
    got = ort.InferenceSession(form64.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {name: a.astype(np.float64) if a.dtype == np.float32 else a for name, a in feeds.items()})[0]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    if case.attrs.get("softcap"):  # the cap bends these scores: without it the output differs
        plain = reference({**case.attrs, "softcap": 0.0}, q, k, v, x[5],
                          *(t if t is None else t.astype(np.float64) for t in x[7:9]))
        assert np.abs(plain - want).max() > 1e-2


def test_a_local_window_without_causal_is_refused():
    case = _CASES["local-window-padded"]
    model, _, wrt = rule_case_model(case)
    node = model.graph.node[0]
    node.attribute.append(onnx.helper.make_attribute("causal", 0))
    with pytest.raises(GradientRuleError, match="local_window_size=3 with causal=0"):
        build_vjp(model, wrt=wrt, outputs=["y0"])
