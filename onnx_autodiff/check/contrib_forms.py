"""Standard-ONNX forms (opset 18 and newer) of onnxruntime's contrib ops, written from onnxruntime's operator
documentation, for a float64 reference where onnxruntime has float32 kernels only.

``gradcheck(expand=expand_contrib)`` (``onnx-autodiff check``) runs a model of these ops in float64 with each
node replaced by its form, while the backward stays the one its rule built; the rule cases
(``onnx_autodiff/conformance/cases/contrib_*.py``) first hold each form to onnxruntime's float32 kernel. They are
independent of the rules: a rule recomputes what its backward needs in its own way. Each form is a ``rewrite.Rule``
(``FORMS``), written with the rules' builder and reading the sizes it needs from the model; the forms here cover
what the rules train: a
GroupQueryAttention over an empty past, a MatMulNBits whose quantized weight is an initializer (the form
multiplies by its dequantized copy, a constant: the weight gets no gradient), a DynamicQuantizeMatMul (the float
product its straight-through gradient is the gradient of).
"""
from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..engine.builder import Emitter, GradBuilder
from ..errors import GradcheckError
from ..graph import GraphView, normalize_domain, used_names
from ..passes.rewrite import Facts, Rule, apply_rules, replacement
from ..training.lora.quantized import dequantize_nbits

_MS = "com.microsoft"


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _f32(g: GradBuilder, value) -> str:
    return g.const(value, dtype=np.float32)


def _rms(g: GradBuilder, x: str, axes: list[int], eps: float, centred: bool):
    """(xhat, mean, invstd) of x over ``axes`` (kept)."""
    ax = g.ints(axes)
    mean = g.ReduceMean(x, ax, keepdims=1) if centred else None
    c = g.Sub(x, mean) if centred else x
    inv = g.Reciprocal(g.Sqrt(g.Add(g.ReduceMean(g.Mul(c, c), ax, keepdims=1), g.CastLike(_f32(g, eps), x))))
    return g.Mul(c, inv), mean, inv


def _simplified_layer_norm(g: GradBuilder, node: onnx.NodeProto, rank: int) -> list:
    """y = x / sqrt(mean(x^2 over axes axis..) + epsilon) * scale for x of ``rank``; outputs y, inv_std_var."""
    attrs = _attrs(node)
    x, scale = node.input[:2]
    axis = attrs.get("axis", -1) % rank
    xhat, _, inv = _rms(g, x, list(range(axis, rank)), attrs.get("epsilon", 1e-5), False)
    return [g.Mul(xhat, scale), g.Identity(inv) if len(node.output) > 1 and node.output[1] else None]


def _skip_norm(g: GradBuilder, node: onnx.NodeProto) -> list:
    """s = input + skip (+ bias); y = norm(s) * gamma (+ beta) over the last axis; outputs y, mean,
    inv_std_var, s (the simplified form's mean is zeros)."""
    attrs = _attrs(node)
    centred = node.op_type == "SkipLayerNormalization"
    ins = list(node.input) + [""] * 5
    bias = ins[4] if centred else ins[3]
    s = g.Add(ins[0], ins[1])
    if bias:
        s = g.Add(s, bias)
    xhat, mean, inv = _rms(g, s, [-1], attrs.get("epsilon", 1e-12 if centred else 1e-5), centred)
    y = g.Mul(xhat, ins[2])
    outs = list(node.output) + [""] * 4
    y = g.Add(y, ins[3]) if centred and ins[3] else g.Identity(y)
    m = None
    if outs[1]:
        m = g.Identity(mean if centred else g.Mul(inv, g.CastLike(_f32(g, 0.0), inv)))
    return [y, m, g.Identity(inv) if outs[2] else None, g.Identity(s) if outs[3] else None]


def _rotate(g: GradBuilder, x: str, cos: str, sin: str, rotary_dim: int, head: int, interleaved: bool,
            batched: bool = False) -> str:
    """x [B, S, N, head] rotated on its first ``rotary_dim`` features by cos/sin [S, rotary_dim / 2] (or
    [B, S, rotary_dim / 2] when ``batched``), broadcast over the heads: halves (x1, x2) or interleaved pairs
    -> (x1 c - x2 s, x2 c + x1 s)."""
    half = rotary_dim // 2
    heads = g.ints([2 if batched else 1])
    c, s = g.Unsqueeze(cos, heads), g.Unsqueeze(sin, heads)
    rot = g.Slice(x, g.ints([0]), g.ints([rotary_dim]), g.ints([3]))
    if interleaved:
        pairs = g.Reshape(rot, g.ints([0, 0, 0, half, 2]))
        x1 = g.Squeeze(g.Slice(pairs, g.ints([0]), g.ints([1]), g.ints([4])), g.ints([4]))
        x2 = g.Squeeze(g.Slice(pairs, g.ints([1]), g.ints([2]), g.ints([4])), g.ints([4]))
    else:
        x1 = g.Slice(rot, g.ints([0]), g.ints([half]), g.ints([3]))
        x2 = g.Slice(rot, g.ints([half]), g.ints([rotary_dim]), g.ints([3]))
    o1 = g.Sub(g.Mul(x1, c), g.Mul(x2, s))
    o2 = g.Add(g.Mul(x2, c), g.Mul(x1, s))
    if interleaved:
        out = g.Reshape(g.Concat(g.Unsqueeze(o1, g.ints([4])), g.Unsqueeze(o2, g.ints([4])), axis=4),
                        g.ints([0, 0, 0, rotary_dim]))
    else:
        out = g.Concat(o1, o2, axis=3)
    if rotary_dim < head:
        out = g.Concat(out, g.Slice(x, g.ints([rotary_dim]), g.ints([head]), g.ints([3])), axis=3)
    return out


def _gqa(g: GradBuilder, node: onnx.NodeProto, head: int, cos_width: int) -> list:
    """GroupQueryAttention with an empty past, or a window-sized past holding no position
    (``group_query_attention``)."""
    attrs = _attrs(node)
    nh, kvh = attrs["num_heads"], attrs["kv_num_heads"]
    ins = list(node.input) + [""] * 9
    if ins[1]:
        q, k, v = ins[:3]
    else:
        bounds = np.cumsum([0, nh * head, kvh * head, kvh * head])
        q, k, v = (g.Slice(ins[0], g.ints([a]), g.ints([b]), g.ints([2])) for a, b in zip(bounds[:-1], bounds[1:]))
    q4 = g.Reshape(q, g.ints([0, 0, nh, head]))
    k4 = g.Reshape(k, g.ints([0, 0, kvh, head]))
    v4 = g.Reshape(v, g.ints([0, 0, kvh, head]))
    seq = g.Slice(g.Shape(q), g.ints([1]), g.ints([2]), g.ints([0]))
    if attrs.get("do_rotary", 0):
        cos = g.Slice(ins[7], g.ints([0]), seq, g.ints([0]))
        sin = g.Slice(ins[8], g.ints([0]), seq, g.ints([0]))
        inter = bool(attrs.get("rotary_interleaved", 0))
        q4, k4 = (_rotate(g, t, cos, sin, 2 * cos_width, head, inter) for t in (q4, k4))
    qh = g.Reshape(g.Transpose(q4, perm=[0, 2, 1, 3]), g.ints([0, kvh, nh // kvh, -1, head]))
    kh = g.Transpose(k4, perm=[0, 2, 1, 3])
    vh = g.Transpose(v4, perm=[0, 2, 1, 3])
    scale = attrs.get("scale", 0.0) or 1.0 / np.sqrt(head)
    scores = g.Mul(g.MatMul(qh, g.Unsqueeze(g.Transpose(kh, perm=[0, 1, 3, 2]), g.ints([2]))),
                   g.CastLike(_f32(g, scale), q))
    cap = attrs.get("softcap", 0.0)
    if cap > 0:
        cap = g.CastLike(_f32(g, cap), q)
        scores = g.Mul(g.Tanh(g.Div(scores, cap)), cap)
    pos = g.Range(g.const(0, dtype=np.int64), g.Squeeze(seq, g.ints([0])), g.const(1, dtype=np.int64))
    j = g.Reshape(pos, g.ints([1, 1, 1, 1, -1]))
    total = g.Add(g.Cast(ins[5], to=TensorProto.INT64), g.const(1, dtype=np.int64))
    seen = g.Less(j, g.Reshape(total, g.ints([-1, 1, 1, 1, 1])))
    if attrs.get("causal", 1):
        i = g.Reshape(pos, g.ints([1, 1, 1, -1, 1]))
        seen = g.And(seen, g.Not(g.Greater(j, i)))
        if attrs.get("local_window_size", -1) > 0:
            last = g.Min(i, g.Sub(g.Reshape(total, g.ints([-1, 1, 1, 1, 1])), g.const(1, dtype=np.int64)))
            seen = g.And(seen, g.Less(g.Sub(last, j), g.const(attrs["local_window_size"], dtype=np.int64)))
    lowest = g.CastLike(_f32(g, np.finfo(np.float32).min), q)
    p = g.Softmax(g.Where(seen, scores, lowest), axis=-1)
    o = g.MatMul(p, g.Unsqueeze(vh, g.ints([2])))
    o = g.Reshape(o, g.ints([0, nh, -1, head]))
    y = g.Reshape(g.Transpose(o, perm=[0, 2, 1, 3]), g.ints([0, 0, nh * head]))
    outs = list(node.output) + ["", ""]
    if attrs.get("sliding_window_cache", 0) and ins[3]:
        kh, vh = (_window_rows(g, t, ins[3], seq, attrs["local_window_size"]) for t in (kh, vh))
    return [y, g.Identity(kh) if outs[1] else None, g.Identity(vh) if outs[2] else None]


def _window_rows(g: GradBuilder, x: str, past: str, seq: str, window: int) -> str:
    """A window-sized present (``sliding_window_cache=1``) of the S new rows of x [B, Nkv, S, H] over a past buffer
    of capacity C that holds no position (T = S tokens known): rows [0, L) the last L of x, L = S when S <= C, else
    S - G ceil((S - C) / G) with G = C - W + 1; rows [L, C), unspecified in the op, zeros here."""
    one = g.const(1, dtype=np.int64)
    cap = g.Slice(g.Shape(past), g.ints([2]), g.ints([3]), g.ints([0]))
    grain = g.Sub(g.Add(cap, one), g.const(window, dtype=np.int64))
    over = g.Sub(seq, cap)
    kept = g.Where(g.Greater(over, g.const(0, dtype=np.int64)),
                   g.Sub(seq, g.Mul(grain, g.Div(g.Sub(g.Add(over, grain), one), grain))), seq)
    rows = g.Slice(x, g.Sub(seq, kept), seq, g.ints([2]))
    pads = g.Concat(g.ints([0] * 6), g.Sub(cap, kept), g.ints([0]), axis=0)  # zeros after row L on axis 2
    return g.Pad(rows, pads)


def _rotary(g: GradBuilder, node: onnx.NodeProto, heads: int, head: int, offset: bool) -> list:
    """com.microsoft RotaryEmbedding (``rotary_embedding``)."""
    attrs = _attrs(node)
    x, pos_ids, cos_cache, sin_cache = node.input[:4]
    rd = attrs.get("rotary_embedding_dim", 0) or head
    if offset:
        seq = g.Squeeze(g.Slice(g.Shape(x), g.ints([1]), g.ints([2]), g.ints([0])), g.ints([0]))
        start = g.Squeeze(pos_ids, g.ints([0]))
        pos = g.Unsqueeze(g.Range(start, g.Add(start, seq), g.const(1, dtype=np.int64)), g.ints([0]))
    else:
        pos = pos_ids
    cos, sin = g.Gather(cos_cache, pos), g.Gather(sin_cache, pos)  # [B or 1, S, rd / 2]
    x4 = g.Reshape(x, g.ints([0, 0, heads, head]))
    out = _rotate(g, x4, cos, sin, rd, head, bool(attrs.get("interleaved", 0)), batched=True)
    return [g.Reshape(out, g.ints([0, 0, heads * head]))]


def _matmul_nbits(g: GradBuilder, node: onnx.NodeProto, value: Callable[[str], np.ndarray]) -> list:
    """MatMulNBits as MatMul(A, dequant(B)^T) (+ bias), the dequantized weight a constant of A's type."""
    w = dequantize_nbits(node, value)
    y = g.MatMul(node.input[0], g.const(w.T, dtype=w.dtype))
    ins = list(node.input) + [""] * 6
    if ins[5]:
        y = g.Add(y, ins[5])
    return [g.Identity(y)]


def _dynamic_quantize_matmul(g: GradBuilder, node: onnx.NodeProto) -> list:
    """DynamicQuantizeMatMul as A @ ((B - b_zero_point) * b_scale) (+ bias): the float product the kernel
    approximates (it rounds A to uint8 over A's range first), in A's type."""
    ins = list(node.input) + [""] * 5
    w = g.CastLike(ins[1], ins[2])
    if ins[3]:
        w = g.Sub(w, g.CastLike(ins[3], ins[2]))
    w = g.CastLike(g.Mul(w, ins[2]), ins[0])
    y = g.MatMul(ins[0], w)
    if ins[4]:
        y = g.Add(y, ins[4])
    return [g.Identity(y)]


# ---- the forms as functions of one node (the rule cases' references) -----------------------------
def _nodes_of(build: Callable) -> Callable[[onnx.NodeProto], list[onnx.NodeProto]]:
    """``form(node) -> nodes``: what ``build(g, node)`` emits, writing the node's outputs."""
    def form(node: onnx.NodeProto) -> list[onnx.NodeProto]:
        em = Emitter(GraphView([], {}, {"": 18}), set(node.input) | set(node.output))
        return replacement(em, node, "form", build)

    return form


def simplified_layer_norm(rank: int):
    """y = x / sqrt(mean(x^2 over axes axis..) + epsilon) * scale for x of ``rank``; outputs y, inv_std_var."""
    return _nodes_of(lambda g, node: _simplified_layer_norm(g, node, rank))


skip_norm = _nodes_of(_skip_norm)
skip_norm.__doc__ = _skip_norm.__doc__
dynamic_quantize_matmul = _nodes_of(_dynamic_quantize_matmul)
dynamic_quantize_matmul.__doc__ = _dynamic_quantize_matmul.__doc__


def group_query_attention(head: int, cos_width: int = 0):
    """GroupQueryAttention with an empty past: rotary on q and k at positions 0..S-1 (cos/sin rows 0..S-1,
    ``cos_width`` columns), query head h reads kv head h // (num_heads / kv_num_heads), key j is seen by query
    i of batch b when j < seqlens_k[b] + 1 (and j <= i when causal, and min(i, seqlens_k[b]) - j <
    local_window_size when that is > 0); scores s -> softcap * tanh(s / softcap) when softcap > 0; outputs
    (B, S, num_heads * head), present key and value (B, kv_num_heads, S, head) with the rotated keys; with
    ``sliding_window_cache=1`` (a past buffer of capacity C, none of its rows valid: seqlens_k[b] + 1 = S) the
    present is the window layout (B, kv_num_heads, C, head): its first L rows the last L keys / values, L = S when
    S <= C, else S - G ceil((S - C) / G) with G = C - local_window_size + 1, zeros after."""
    return _nodes_of(lambda g, node: _gqa(g, node, head, cos_width))


def rotary_embedding(heads: int, head: int, offset: bool):
    """com.microsoft RotaryEmbedding on a (B, S, heads * head) input, position_ids (B, S) or, with ``offset``,
    (1,) (positions start there): cos/sin rows gathered by position, then the rotation of ``_rotate``."""
    return _nodes_of(lambda g, node: _rotary(g, node, heads, head, offset))


def matmul_nbits(value: Callable[[str], np.ndarray]):
    """MatMulNBits as MatMul(A, dequant(B)^T) (+ bias), the dequantized weight a constant of A's type."""
    return _nodes_of(lambda g, node: _matmul_nbits(g, node, value))


# ---- the forms as rules over a model (expand_contrib) ---------------------------------------------
def _width(facts: Facts, name: str) -> int | None:
    s = facts.shape(name) if name else None
    d = s[-1] if s else None
    return d if isinstance(d, int) else None


def _gqa_sizes(node: onnx.NodeProto, facts: Facts) -> tuple[int, int] | None:
    """(head size, cos/sin width) of a GroupQueryAttention, or None when its input's width is unknown."""
    attrs = _attrs(node)
    width = _width(facts, node.input[0])
    if width is None:
        return None
    nh, kvh = attrs["num_heads"], attrs["kv_num_heads"]
    packed = len(node.input) < 2 or not node.input[1]
    head = width // (nh + 2 * kvh) if packed else width // nh
    cos = _width(facts, node.input[7]) if attrs.get("do_rotary", 0) and len(node.input) > 7 else 0
    return head, cos or 0


def _rotary_sizes(node: onnx.NodeProto, facts: Facts) -> tuple[int, int, bool] | None:
    """(heads, head size, whether the positions are one offset) of a RotaryEmbedding, or None."""
    attrs = _attrs(node)
    width, cos = _width(facts, node.input[0]), _width(facts, node.input[2])
    if width is None or cos is None:
        return None
    head = width // attrs["num_heads"] if attrs.get("num_heads") else 2 * cos
    positions = facts.shape(node.input[1])
    return width // head, head, positions is not None and len(positions) == 1


def _initializer_value(facts: Facts) -> Callable[[str], np.ndarray]:
    inits = {t.name: t for t in facts.graph.initializer}

    def value(name: str) -> np.ndarray:
        if name not in inits:
            raise GradcheckError(f"{name!r} is not an initializer: the float64 form of its node needs its value")
        return numpy_helper.to_array(inits[name])

    return value


def _simplified_rule(domain: str) -> Rule:
    return Rule("SimplifiedLayerNormalization",
                lambda g, node, facts, ctx: _simplified_layer_norm(g, node, facts.rank(node.input[0])),
                lambda node, facts, ctx: facts.rank(node.input[0]) is not None, domain=domain)


FORMS = [
    _simplified_rule(""), _simplified_rule(_MS),
    Rule("SkipSimplifiedLayerNormalization", lambda g, node, facts, ctx: _skip_norm(g, node), domain=_MS),
    Rule("SkipLayerNormalization", lambda g, node, facts, ctx: _skip_norm(g, node), domain=_MS),
    Rule("MatMulNBits", lambda g, node, facts, ctx: _matmul_nbits(g, node, _initializer_value(facts)), domain=_MS),
    Rule("DynamicQuantizeMatMul", lambda g, node, facts, ctx: _dynamic_quantize_matmul(g, node), domain=_MS),
    Rule("GroupQueryAttention", lambda g, node, facts, ctx: _gqa(g, node, *_gqa_sizes(node, facts)),
         lambda node, facts, ctx: _gqa_sizes(node, facts) is not None, domain=_MS),
    Rule("RotaryEmbedding", lambda g, node, facts, ctx: _rotary(g, node, *_rotary_sizes(node, facts)),
         lambda node, facts, ctx: _rotary_sizes(node, facts) is not None, domain=_MS),
]


def has_contrib_ops(model: onnx.ModelProto) -> bool:
    """Whether ``model`` has a node of onnxruntime's (com.microsoft, or SimplifiedLayerNormalization, which
    onnxruntime registers in the default domain): ops it runs in float32 only, which ``expand_contrib`` replaces."""
    return any(normalize_domain(n.domain) == _MS or n.op_type == "SimplifiedLayerNormalization"
               for n in model.graph.node)


def expand_contrib(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with every contrib node of the main graph that has a form replaced by it (outputs keep
    their names). GradcheckError naming the node for a com.microsoft op without a form."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    apply_rules(out, FORMS, SimpleNamespace(taken=used_names(out), added=set()), "form")
    left = next((n for n in out.graph.node if normalize_domain(n.domain) == _MS), None)
    if left is not None:
        raise GradcheckError(f"node {left.name!r} ({left.op_type}, com.microsoft): onnxruntime runs it in float32 "
                             "only and there is no standard-ONNX form of it here to check in float64; check "
                             "it in float32 (--float32, float64=False)")
    if not any(o.domain in ("", "ai.onnx") and o.version >= 18 for o in out.opset_import):
        raise GradcheckError("the standard forms of the contrib ops need opset 18 or newer")
    return out


__all__ = ["FORMS", "simplified_layer_norm", "skip_norm", "group_query_attention", "rotary_embedding",
           "matmul_nbits", "expand_contrib", "has_contrib_ops"]
