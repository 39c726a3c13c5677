"""onnxruntime's attention ops as onnxruntime-genai's model builder emits them: com.microsoft
GroupQueryAttention and RotaryEmbedding.

GroupQueryAttention (onnxruntime's contrib-operator spec, checked against its CPU kernel in
onnx_autodiff/conformance/cases/contrib_attention.py): q, k, v come packed in ``query`` ([B, S, (N + 2 Nkv) H]) or
apart; with ``do_rotary`` q and k are rotated by ``cos_cache`` / ``sin_cache`` rows 0..S-1 on their first
2 * cos_cache.shape[1] features (halves, or pairs when ``rotary_interleaved``); query head h reads kv head
h // (N / Nkv); query i of batch b sees key j when j < seqlens_k[b] + 1 and, when ``causal`` (the default),
j <= i; with ``local_window_size`` w > 0 (causal only) the last w keys up to c = min(i, seqlens_k[b]), the
current one counted: c - j < w (onnxruntime's CPU kernel, measured: a padded query past the sequence's end sees
the window that ends at its last token); scores s are scaled by ``scale`` (default 1 / sqrt(H)), then with
``softcap`` > 0 become softcap * tanh(s / softcap) before the mask and softmax; ``present_key`` /
``present_value`` are the (rotated) keys and the values as [B, Nkv, S, H].

A windowed KV cache (``sliding_window_cache=1``, the model builder's default for Gemma2/Gemma3's local layers):
past and present are window-sized buffers of capacity C (the past's dim 2, at least ``local_window_size`` W) and
the op evicts internally. Per batch entry T = seqlens_k[b] + 1 tokens are known after the step, P = T - S of
them cached before it; with P = 0 the past buffer is not read (its rows hold no valid position), the output is
that of the full-length cache over the same S tokens (the local window above), and present rows [0, L) hold the
last L = L(T) keys / values (L = T when T <= C, else T - G ceil((T - C) / G) with G = C - W + 1), rows [L, C)
unspecified. onnxruntime's CPU kernel refuses a row with T < S (padding) there ("seqlens_k[b] = .. is too small
for sequence_length"), so such a model trains on whole rows only.

The backward recomputes the attention probabilities in standard ONNX (q, k, v of a few hundred tokens: the
[B, N, S, S] matrix the kernel also forms) and differentiates them; gradients arriving at the present
outputs join those of k and v (a windowed cache's present, whose rows [L, C) are unspecified, is refused on the
loss path). Training runs the prompt form only: the past key/value inputs must be empty, or for a windowed cache
hold no valid position (T <= S; the backward stops with an error naming its Reshape when they do), and the
variants that the backward does not model are refused by name: smooth softmax, a quantized KV cache, the qk
output, position ids, attention bias, head sinks, q/k norm weights, query lengths.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from onnx_autodiff.rule_api import GradBuilder, GradientRuleError, Grads, NodeView, StandIn, gradient_rule, type_rule

_MS = "com.microsoft"
_HALF = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
# attributes whose non-default values change what the op computes in ways the backward does not model
_GQA_REFUSED = {"smooth_softmax": 0, "qk_output": 0,
                "kv_cache_bit_width": 0, "k_quant_type": "NONE", "v_quant_type": "NONE"}
_GQA_INPUTS = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
               "cos_cache", "sin_cache", "position_ids", "attention_bias", "head_sink", "k_scale", "v_scale",
               "q_norm_weight", "k_norm_weight", "query_seqlens"]
_GQA_OUTPUTS = ["output", "present_key", "present_value", "output_qk"]


def _refuse_variants(node: NodeView) -> None:
    for name, default in _GQA_REFUSED.items():
        if node.has_attr(name) and node.attr(name) not in (default, None, ""):
            raise GradientRuleError(
                f"{node}: {name}={node.attr(name)!r}; the GroupQueryAttention gradient handles {name}={default!r} "
                "only (full causal or bidirectional attention over an unquantized, empty KV cache)")
    for i in range(9, len(node.inputs)):
        if node.input(i):
            raise GradientRuleError(f"{node}: input {_GQA_INPUTS[i]!r} is set; the GroupQueryAttention gradient "
                                    "supports query/key/value, an empty past, seqlens_k, total_sequence_length and "
                                    "the cos/sin caches")
    if node.output(3):
        raise GradientRuleError(f"{node}: output {_GQA_OUTPUTS[3]!r} is set (qk_output); not supported in training")
    if int(node.attr("local_window_size", -1) or -1) > 0 and not int(node.attr("causal", 1)):
        raise GradientRuleError(f"{node}: local_window_size={node.attr('local_window_size')} with causal=0; "
                                "onnxruntime takes a local window on causal attention only")
    if windowed(node) and int(node.attr("local_window_size", -1) or -1) <= 0:
        raise GradientRuleError(f"{node}: sliding_window_cache=1 with local_window_size="
                                f"{node.attr('local_window_size', -1)}; onnxruntime needs a local window (> 0) for a "
                                "window-sized KV cache")
    for i in (3, 4, 7, 8):
        if node.needs_grad(i):
            raise GradientRuleError(f"{node}: {_GQA_INPUTS[i]} gets no gradient; freeze it (the KV cache is empty "
                                    "in training, and the rotary caches are constants of the base)")


def windowed(node: NodeView) -> bool:
    """Whether ``node`` keeps a window-sized KV cache (``sliding_window_cache=1``)."""
    return bool(int(node.attr("sliding_window_cache", 0) or 0))


def rotate(g: GradBuilder, x: str, cos: str, sin: str, rotary_dim: int, head: int, interleaved: bool,
           inverse: bool, rank: int = 4) -> str:
    """x [..., head] (of ``rank``) rotated on its first ``rotary_dim`` features by angles whose cos / sin
    broadcast against x[..., :rotary_dim / 2]: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) for the two halves or,
    ``interleaved``, the even and odd features. ``inverse``: the rotation back (by -angle), which is the
    rotation's transpose."""
    half = rotary_dim // 2
    part, rest = (x, None) if rotary_dim == head else g.split(x, rank - 1, [rotary_dim, head - rotary_dim])
    if interleaved:
        pairs = g.Reshape(part, g.ints([0] * (rank - 1) + [half, 2]))
        x1, x2 = (g.squeeze(t, [rank]) for t in g.split(pairs, rank, [1, 1]))
    else:
        x1, x2 = g.split(part, rank - 1, [half, half])
    if inverse:
        o1, o2 = g.Add(g.Mul(x1, cos), g.Mul(x2, sin)), g.Sub(g.Mul(x2, cos), g.Mul(x1, sin))
    else:
        o1, o2 = g.Sub(g.Mul(x1, cos), g.Mul(x2, sin)), g.Add(g.Mul(x2, cos), g.Mul(x1, sin))
    if interleaved:
        both = g.Concat(g.unsqueeze(o1, [rank]), g.unsqueeze(o2, [rank]), axis=rank)
        out = g.Reshape(both, g.ints([0] * (rank - 1) + [rotary_dim]))
    else:
        out = g.Concat(o1, o2, axis=rank - 1)
    return out if rest is None else g.Concat(out, rest, axis=rank - 1)


class _Attention:
    """The attention of one GroupQueryAttention node, recomputed: q5 [B, Nkv, G, S, H], k5 / v5
    [B, Nkv, 1, S, H], probabilities p [B, Nkv, G, S, S]."""

    def __init__(self, g: GradBuilder, node: NodeView):
        self.g, self.node = g, node
        g.require(14, "the GroupQueryAttention gradient (Reshape with allowzero)")
        self.n, self.nkv = int(node.attr("num_heads")), int(node.attr("kv_num_heads"))
        if self.nkv < 1 or self.n % self.nkv:
            raise GradientRuleError(f"{node}: num_heads={self.n} is not a multiple of kv_num_heads={self.nkv}")
        query = node.inputs[0]
        self.packed = node.input(1) is None
        width = (g.shape(query) or (None,))[-1]
        heads = self.n + 2 * self.nkv if self.packed else self.n
        if not isinstance(width, int) or width % heads:
            raise GradientRuleError(f"{node}: the gradient needs the static hidden size of {query!r} "
                                    f"(a multiple of {heads} heads), got {width!r}")
        self.h = width // heads
        self.dtype = g.dtype(query)
        self.compute = TensorProto.FLOAT if self.dtype in _HALF else self.dtype
        self.scale_value = float(node.attr("scale", 0.0) or 0.0) or 1.0 / np.sqrt(self.h)
        self.seq = g.dim(query, 1)
        self._rotary()
        q, k, v = self._qkv()
        self.scale = self._guarded_scale(q)
        self.q4, self.k4 = (self.rotate(t, inverse=False) for t in (q, k))
        self.v4 = v
        g5 = [0, self.nkv, self.n // self.nkv, -1, self.h]
        self.q5 = g.Reshape(g.Transpose(self.q4, perm=[0, 2, 1, 3]), g.ints(g5))
        self.k5 = g.unsqueeze(g.Transpose(self.k4, perm=[0, 2, 1, 3]), [2])
        self.v5 = g.unsqueeze(g.Transpose(self.v4, perm=[0, 2, 1, 3]), [2])
        scores = g.Mul(g.MatMul(self.q5, g.Transpose(self.k5, perm=[0, 1, 2, 4, 3])), self.scale)
        self.softcap = float(node.attr("softcap", 0.0) or 0.0)
        if self.softcap > 0:  # s -> c tanh(s / c); the backward reads tanh
            cap = g.const(self.softcap, like=scores)
            self.tanh = g.Tanh(g.Div(scores, cap))
            scores = g.Mul(self.tanh, cap)
        lowest = g.const(np.finfo(g.np_dtype(scores)).min, like=scores)
        self.p = g.Softmax(g.Where(self._seen(), scores, lowest), axis=-1)

    def up(self, x: str) -> str:
        return x if self.g.dtype(x) == self.compute else self.g.Cast(x, to=self.compute)

    def down(self, x: str) -> str:
        return x if self.compute == self.dtype else self.g.Cast(x, to=self.dtype)

    def _qkv(self):
        g, node, n, nkv, h = self.g, self.node, self.n, self.nkv, self.h
        if self.packed:
            parts = g.split(self.up(node.inputs[0]), 2, [n * h, nkv * h, nkv * h])
        else:
            parts = [self.up(node.inputs[i]) for i in range(3)]
        return [g.Reshape(p, g.ints([0, 0, heads, h])) for p, heads in zip(parts, (n, nkv, nkv))]

    def _guarded_scale(self, like: str) -> str:
        """The score scale, plus the sum of the past key and value reshaped to no elements: 0 when the past is
        empty, and a failing Reshape (named under this node's gradient) when it is not. A windowed cache's past
        buffer is not empty (its capacity): there the guard is on P = max(seqlens_k) + 1 - S, the positions it
        holds, a Range of max(P, 0) elements reshaped to none."""
        g, scale = self.g, self.g.const(self.scale_value, like=like)
        if windowed(self.node):
            one = g.const(1, dtype=np.int64)
            known = g.Add(g.ReduceMax(g.Cast(self.node.inputs[5], to=TensorProto.INT64), keepdims=0), one)
            held = g.Range(g.const(0, dtype=np.int64), g.Sub(known, g.squeeze(self.seq, [0])), one)
            empty = g.Reshape(held, g.ints([0]), allowzero=1)
            return g.Add(scale, g.Cast(g.reduce_sum(empty, None, keepdims=False), to=self.compute))
        for i in (3, 4):
            past = self.node.input(i)
            if past is not None:
                empty = g.Reshape(past, g.ints([0]), allowzero=1)
                scale = g.Add(scale, self.up(g.reduce_sum(empty, None, keepdims=False)))
        return scale

    def _rotary(self) -> None:
        g, node = self.g, self.node
        self.rotary = bool(node.attr("do_rotary", 0))
        if not self.rotary:
            return
        cos, sin = node.input(7), node.input(8)
        if cos is None or sin is None:
            raise GradientRuleError(f"{node}: do_rotary=1 without cos_cache and sin_cache")
        half = (g.shape(cos) or (None, None))[-1]
        if not isinstance(half, int) or 2 * half > self.h:
            raise GradientRuleError(f"{node}: the gradient needs the static width of {cos!r} (at most head_size / 2)")
        self.rotary_dim = 2 * half
        self.interleaved = bool(node.attr("rotary_interleaved", 0))
        rows = [g.unsqueeze(g.op("Slice", self.up(t), g.ints([0]), self.seq, g.ints([0])), [1]) for t in (cos, sin)]
        self.cos, self.sin = rows  # [S, 1, rotary_dim / 2]

    def rotate(self, x: str, inverse: bool) -> str:
        """x [B, S, heads, H] rotated (or rotated back)."""
        if not self.rotary:
            return x
        return rotate(self.g, x, self.cos, self.sin, self.rotary_dim, self.h, self.interleaved, inverse)

    def _seen(self) -> str:
        """[B, 1, 1, S, S]: key j is seen by query i (j < seqlens_k[b] + 1, and j <= i when causal)."""
        g, node = self.g, self.node
        one = g.const(1, dtype=np.int64)
        pos = g.Range(g.const(0, dtype=np.int64), g.squeeze(self.seq, [0]), one)
        j = g.Reshape(pos, g.ints([1, 1, 1, 1, -1]))
        total = g.Reshape(g.Add(g.Cast(node.inputs[5], to=TensorProto.INT64), one), g.ints([-1, 1, 1, 1, 1]))
        seen = g.Less(j, total)
        if int(node.attr("causal", 1)):
            i = g.Reshape(pos, g.ints([1, 1, 1, -1, 1]))
            seen = g.And(seen, g.Not(g.Greater(j, i)))
            window = int(node.attr("local_window_size", -1) or -1)
            if window > 0:  # the last `window` keys up to min(i, seqlens_k), that one counted
                last = g.Min(i, g.Sub(total, one))
                seen = g.And(seen, g.Less(g.Sub(last, j), g.const(window, dtype=np.int64)))
        return seen

    def backward(self, dout: str) -> tuple[str, str, str]:
        """(dq, dk, dv) as [B, S, heads, H] before the rotation's transpose (dk, dv [B, Nkv, S, H])."""
        g = self.g
        do5 = g.Reshape(g.Transpose(g.Reshape(self.up(dout), g.ints([0, 0, self.n, self.h])), perm=[0, 2, 1, 3]),
                        g.ints([0, self.nkv, self.n // self.nkv, -1, self.h]))
        dv = g.reduce_sum(g.MatMul(g.Transpose(self.p, perm=[0, 1, 2, 4, 3]), do5), [2], keepdims=False)
        dp = g.MatMul(do5, g.Transpose(self.v5, perm=[0, 1, 2, 4, 3]))
        centred = g.Sub(dp, g.reduce_sum(g.Mul(dp, self.p), [4], keepdims=True))
        dcapped = g.Mul(self.p, centred)
        if self.softcap > 0:  # d(c tanh(s / c)) / ds = 1 - tanh^2
            dcapped = g.Mul(dcapped, g.Sub(g.const(1.0, like=self.tanh), g.Mul(self.tanh, self.tanh)))
        dscores = g.Mul(dcapped, self.scale)
        dq = g.Transpose(g.Reshape(g.MatMul(dscores, self.k5), g.ints([0, self.n, -1, self.h])), perm=[0, 2, 1, 3])
        dk = g.reduce_sum(g.MatMul(g.Transpose(dscores, perm=[0, 1, 2, 4, 3]), self.q5), [2], keepdims=False)
        return dq, dk, dv


@gradient_rule("GroupQueryAttention", domain=_MS)
def group_query_attention_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Gradients of query (packed) or query, key and value; none of the KV cache, lengths or rotary caches."""
    _refuse_variants(node)
    dout, dpresent_k, dpresent_v = (list(dy) + [None] * 3)[:3]
    grads: list = [None] * len(node.inputs)
    wanted = [node.needs_grad(i) for i in range(3)]
    if not any(wanted) or (dout is None and dpresent_k is None and dpresent_v is None):
        return grads
    if windowed(node) and (dpresent_k is not None or dpresent_v is not None):
        raise GradientRuleError(f"{node}: sliding_window_cache=1 and its present key/value reach the loss; the "
                                "gradient models the attention output only (a window-sized cache's rows past the "
                                "resident ones are unspecified): take the loss from the output, or rebuild the "
                                "model with a full-length cache (builder: --extra_options windowed_kv_cache=false)")
    att = _Attention(g, node)
    if dout is not None:
        dq, dk, dv = att.backward(dout)
    else:
        dq = g.zeros_like(att.q4)
        dk = dv = None
    for d, pres in ((0, dpresent_k), (1, dpresent_v)):
        if pres is not None:
            extra = att.up(pres)
            if d == 0:
                dk = extra if dk is None else g.Add(dk, extra)
            else:
                dv = extra if dv is None else g.Add(dv, extra)
    dk = g.zeros_like(att.k4) if dk is None else g.Transpose(dk, perm=[0, 2, 1, 3])
    dv = g.zeros_like(att.v4) if dv is None else g.Transpose(dv, perm=[0, 2, 1, 3])
    dq, dk = att.rotate(dq, inverse=True), att.rotate(dk, inverse=True)
    flat = [att.down(g.Reshape(t, g.ints([0, 0, -1]))) for t in (dq, dk, dv)]
    if att.packed:
        grads[0] = g.Concat(*flat, axis=2)
    else:
        for i in range(3):
            grads[i] = flat[i] if wanted[i] else None
    return grads


@gradient_rule("RotaryEmbedding", domain=_MS)
def rotary_embedding_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """y = x rotated by the cos / sin rows of its positions (position_ids [B, S], or [1]: positions from that
    offset), on [B, S, N * H] or [B, N, S, H] input: dx is dy rotated back. The caches get no gradient."""
    dz, = dy
    grads: list = [None] * len(node.inputs)
    for i, what in ((1, "position_ids"), (2, "cos_cache"), (3, "sin_cache")):
        if node.needs_grad(i):
            raise GradientRuleError(f"{node}: {what} gets no gradient; freeze it")
    for name, default in (("is_packed_batching", 0), ("scale", 1.0)):
        if node.has_attr(name) and node.attr(name) != default:
            raise GradientRuleError(f"{node}: {name}={node.attr(name)!r}; the RotaryEmbedding gradient handles "
                                    f"{name}={default!r} only")
    if dz is None or not node.needs_grad(0):
        return grads
    x, pos, cos, sin = node.inputs[:4]
    shape, cos_shape, pos_rank = g.shape(x), g.shape(cos), g.rank(pos)
    if shape is None or len(shape) not in (3, 4) or not isinstance(shape[-1], int) or cos_shape is None \
            or not isinstance(cos_shape[-1], int) or pos_rank not in (1, 2):
        raise GradientRuleError(f"{node}: the gradient needs the static last dims of {x!r} (rank 3 or 4) and "
                                f"{cos!r}, and position_ids of rank 1 or 2")
    rotary_dim = int(node.attr("rotary_embedding_dim", 0) or 0) or 2 * cos_shape[-1]
    if len(shape) == 4:
        head, heads = shape[-1], None
    else:
        heads = int(node.attr("num_heads", 0) or 0) or shape[-1] // rotary_dim
        head = shape[-1] // heads
    seq_axis = 2 if len(shape) == 4 else 1
    if pos_rank == 1:  # an offset: positions pos[0] .. pos[0] + S - 1
        start = g.squeeze(g.Cast(pos, to=TensorProto.INT64), [0])
        seq = g.squeeze(g.dim(x, seq_axis), [0])
        pos = g.unsqueeze(g.Range(start, g.Add(start, seq), g.const(1, dtype=np.int64)), [0])
    rows = [g.unsqueeze(g.Gather(g.cast_like(t, dz), pos), [1 if len(shape) == 4 else 2]) for t in (cos, sin)]
    d = dz if heads is None else g.Reshape(dz, g.ints([0, 0, heads, head]))
    dx = rotate(g, d, rows[0], rows[1], rotary_dim, head, bool(node.attr("interleaved", 0)), inverse=True)
    grads[0] = dx if heads is None else g.Reshape(dx, g.ints([0, 0, heads * head]))
    return grads


@type_rule("GroupQueryAttention", domain=_MS)
def group_query_attention_type(s: StandIn, node: NodeView) -> None:
    """output: [B, S, N * H] (the query part of packed q/k/v); present key / value: the past along the
    sequence, then the new keys / values as [B, Nkv, S, H] (a windowed cache's: the past's shape, its capacity).
    output_qk stays unknown."""
    n, nkv = int(node.attr("num_heads")), int(node.attr("kv_num_heads"))
    query = node.inputs[0]
    if node.input(1) is None:
        heads = s.Reshape(query, s.ints([0, 0, n + 2 * nkv, -1]))
        parts = [s.Slice(heads, s.ints([a]), s.ints([b]), s.ints([2])) for a, b in ((0, n), (n, n + nkv),
                                                                                     (n + nkv, n + 2 * nkv))]
        s.op("Reshape", parts[0], s.ints([0, 0, -1]), out=node.outputs[0])
        kv = parts[1:]
    else:
        s.op("Identity", query, out=node.outputs[0])
        kv = [s.Reshape(node.inputs[i], s.ints([0, 0, nkv, -1])) for i in (1, 2)]
    for out, new, past in ((1, kv[0], node.input(3)), (2, kv[1], node.input(4))):
        if node.output(out) is None:
            continue
        bnsh = s.Transpose(new, perm=[0, 2, 1, 3])
        if past is not None and windowed(node):  # [B, Nkv, C, H]: the past's capacity, the head size of the new
            s.op("Add", past, s.reduce_mean(bnsh, [2]), out=node.outputs[out])
        elif past is None:
            s.op("Identity", bnsh, out=node.outputs[out])
        else:
            s.op("Concat", past, bnsh, out=node.outputs[out], axis=2)


@type_rule("RotaryEmbedding", domain=_MS)
def rotary_embedding_type(s: StandIn, node: NodeView) -> None:
    """output like input."""
    s.op("Identity", node.inputs[0], out=node.outputs[0])
