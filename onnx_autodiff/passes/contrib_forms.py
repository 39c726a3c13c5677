"""Standard-ONNX forms (opset 18 and newer) of onnxruntime's contrib ops, written from onnxruntime's operator
documentation, for a float64 reference where onnxruntime has float32 kernels only.

``gradcheck(expand=expand_contrib)`` (``onnx-autodiff check``) runs a model of these ops in float64 with each
node replaced by its form, while the backward stays the one its rule built; the rule cases
(``onnx_autodiff/conformance/cases/contrib_*.py``) first hold each form to onnxruntime's float32 kernel. They are
independent of the rules: a rule recomputes what its backward needs in its own way. ``FORMS`` maps (domain, op) to a
function of the node and what the model tells of its shapes; the forms here cover what the rules train: a
GroupQueryAttention over an empty past, a MatMulNBits whose quantized weight is an initializer (the form
multiplies by its dequantized copy, a constant: the weight gets no gradient), a DynamicQuantizeMatMul (the float
product its straight-through gradient is the gradient of).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import GradcheckError
from ..graph import infer_tensor_info, normalize_domain
from .lora_quantized import dequantize_nbits


class Nodes:
    """Nodes named under ``<node>/form``; ``n.Op(inputs..., attrs)`` returns the output name."""

    def __init__(self, node: onnx.NodeProto):
        self.scope = f"{node.name}/form"
        self.nodes: list[onnx.NodeProto] = []
        self.attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        name = out or f"{self.scope}/{op_type}_{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], name=f"{self.scope}/n{len(self.nodes)}",
                                           **attrs))
        return name

    def __getattr__(self, op_type: str):
        if op_type[:1].isupper():
            return lambda *inputs, **attrs: self.op(op_type, *inputs, **attrs)
        raise AttributeError(op_type)

    def const(self, value, dtype=np.float32) -> str:
        return self.op("Constant", value=numpy_helper.from_array(np.asarray(value, dtype=dtype)))

    def ints(self, values) -> str:
        return self.const(np.asarray(values, np.int64).reshape(-1), np.int64)

    def identity(self, x: str, out: str) -> None:
        if out:
            self.op("Identity", x, out=out)


def _rms(n: Nodes, x: str, axes: list[int], eps: float, centred: bool):
    """(xhat, mean, invstd) of x over ``axes`` (kept)."""
    ax = n.ints(axes)
    mean = n.ReduceMean(x, ax, keepdims=1) if centred else None
    c = n.Sub(x, mean) if centred else x
    inv = n.Reciprocal(n.Sqrt(n.Add(n.ReduceMean(n.Mul(c, c), ax, keepdims=1), n.CastLike(n.const(eps), x))))
    return n.Mul(c, inv), mean, inv


def simplified_layer_norm(rank: int):
    """y = x / sqrt(mean(x^2 over axes axis..) + epsilon) * scale for x of ``rank``; outputs y, inv_std_var."""
    def form(node: onnx.NodeProto) -> list[onnx.NodeProto]:
        n = Nodes(node)
        x, scale = node.input[:2]
        axis = n.attrs.get("axis", -1) % rank
        xhat, _, inv = _rms(n, x, list(range(axis, rank)), n.attrs.get("epsilon", 1e-5), False)
        n.op("Mul", xhat, scale, out=node.output[0])
        if len(node.output) > 1:
            n.identity(inv, node.output[1])
        return n.nodes

    return form


def skip_norm(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """s = input + skip (+ bias); y = norm(s) * gamma (+ beta) over the last axis; outputs y, mean,
    inv_std_var, s (the simplified form's mean is zeros)."""
    n = Nodes(node)
    centred = node.op_type == "SkipLayerNormalization"
    ins = list(node.input) + [""] * 5
    bias = ins[4] if centred else ins[3]
    s = n.Add(ins[0], ins[1])
    if bias:
        s = n.Add(s, bias)
    xhat, mean, inv = _rms(n, s, [-1], n.attrs.get("epsilon", 1e-12 if centred else 1e-5), centred)
    y = n.Mul(xhat, ins[2])
    outs = list(node.output) + [""] * 4
    if centred and ins[3]:
        n.op("Add", y, ins[3], out=outs[0])
    else:
        n.identity(y, outs[0])
    if outs[1]:
        n.identity(mean if centred else n.Mul(inv, n.CastLike(n.const(0.0), inv)), outs[1])
    n.identity(inv, outs[2])
    n.identity(s, outs[3])
    return n.nodes


def _rotate(n: Nodes, x: str, cos: str, sin: str, rotary_dim: int, head: int, interleaved: bool,
            batched: bool = False) -> str:
    """x [B, S, N, head] rotated on its first ``rotary_dim`` features by cos/sin [S, rotary_dim / 2] (or
    [B, S, rotary_dim / 2] when ``batched``), broadcast over the heads: halves (x1, x2) or interleaved pairs
    -> (x1 c - x2 s, x2 c + x1 s)."""
    half = rotary_dim // 2
    heads = n.ints([2 if batched else 1])
    c, s = n.Unsqueeze(cos, heads), n.Unsqueeze(sin, heads)
    rot = n.Slice(x, n.ints([0]), n.ints([rotary_dim]), n.ints([3]))
    if interleaved:
        pairs = n.Reshape(rot, n.ints([0, 0, 0, half, 2]))
        x1 = n.Squeeze(n.Slice(pairs, n.ints([0]), n.ints([1]), n.ints([4])), n.ints([4]))
        x2 = n.Squeeze(n.Slice(pairs, n.ints([1]), n.ints([2]), n.ints([4])), n.ints([4]))
    else:
        x1 = n.Slice(rot, n.ints([0]), n.ints([half]), n.ints([3]))
        x2 = n.Slice(rot, n.ints([half]), n.ints([rotary_dim]), n.ints([3]))
    o1 = n.Sub(n.Mul(x1, c), n.Mul(x2, s))
    o2 = n.Add(n.Mul(x2, c), n.Mul(x1, s))
    if interleaved:
        out = n.Reshape(n.Concat(n.Unsqueeze(o1, n.ints([4])), n.Unsqueeze(o2, n.ints([4])), axis=4),
                        n.ints([0, 0, 0, rotary_dim]))
    else:
        out = n.Concat(o1, o2, axis=3)
    if rotary_dim < head:
        out = n.Concat(out, n.Slice(x, n.ints([rotary_dim]), n.ints([head]), n.ints([3])), axis=3)
    return out


def group_query_attention(head: int, cos_width: int = 0):
    """GroupQueryAttention with an empty past: rotary on q and k at positions 0..S-1 (cos/sin rows 0..S-1,
    ``cos_width`` columns), query head h reads kv head h // (num_heads / kv_num_heads), key j is seen by query
    i of batch b when j < seqlens_k[b] + 1 (and j <= i when causal, and min(i, seqlens_k[b]) - j <
    local_window_size when that is > 0); scores s -> softcap * tanh(s / softcap) when softcap > 0; outputs
    (B, S, num_heads * head), present key and value (B, kv_num_heads, S, head) with the rotated keys."""
    return lambda node: _gqa(node, head, cos_width)


def _gqa(node: onnx.NodeProto, head: int, cos_width: int) -> list[onnx.NodeProto]:
    n = Nodes(node)
    nh, kvh = n.attrs["num_heads"], n.attrs["kv_num_heads"]
    ins = list(node.input) + [""] * 9
    if ins[1]:
        q, k, v = ins[:3]
    else:
        bounds = np.cumsum([0, nh * head, kvh * head, kvh * head])
        q, k, v = (n.Slice(ins[0], n.ints([a]), n.ints([b]), n.ints([2])) for a, b in zip(bounds[:-1], bounds[1:]))
    q4 = n.Reshape(q, n.ints([0, 0, nh, head]))
    k4 = n.Reshape(k, n.ints([0, 0, kvh, head]))
    v4 = n.Reshape(v, n.ints([0, 0, kvh, head]))
    seq = n.Slice(n.Shape(q), n.ints([1]), n.ints([2]), n.ints([0]))
    if n.attrs.get("do_rotary", 0):
        cos = n.Slice(ins[7], n.ints([0]), seq, n.ints([0]))
        sin = n.Slice(ins[8], n.ints([0]), seq, n.ints([0]))
        rd = 2 * cos_width
        inter = bool(n.attrs.get("rotary_interleaved", 0))
        q4, k4 = (_rotate(n, t, cos, sin, rd, head, inter) for t in (q4, k4))
    qh = n.Reshape(n.Transpose(q4, perm=[0, 2, 1, 3]), n.ints([0, kvh, nh // kvh, -1, head]))
    kh = n.Transpose(k4, perm=[0, 2, 1, 3])
    vh = n.Transpose(v4, perm=[0, 2, 1, 3])
    scale = n.attrs.get("scale", 0.0) or 1.0 / np.sqrt(head)
    scores = n.Mul(n.MatMul(qh, n.Unsqueeze(n.Transpose(kh, perm=[0, 1, 3, 2]), n.ints([2]))),
                   n.CastLike(n.const(scale), q))
    cap = n.attrs.get("softcap", 0.0)
    if cap > 0:
        cap = n.CastLike(n.const(cap), q)
        scores = n.Mul(n.Tanh(n.Div(scores, cap)), cap)
    pos = n.Range(n.const(0, np.int64), n.Squeeze(seq, n.ints([0])), n.const(1, np.int64))
    j = n.Reshape(pos, n.ints([1, 1, 1, 1, -1]))
    total = n.Add(n.Cast(ins[5], to=TensorProto.INT64), n.const(1, np.int64))
    seen = n.Less(j, n.Reshape(total, n.ints([-1, 1, 1, 1, 1])))
    if n.attrs.get("causal", 1):
        i = n.Reshape(pos, n.ints([1, 1, 1, -1, 1]))
        seen = n.And(seen, n.Not(n.Greater(j, i)))
        if n.attrs.get("local_window_size", -1) > 0:
            last = n.Min(i, n.Sub(n.Reshape(total, n.ints([-1, 1, 1, 1, 1])), n.const(1, np.int64)))
            seen = n.And(seen, n.Less(n.Sub(last, j), n.const(n.attrs["local_window_size"], np.int64)))
    lowest = n.CastLike(n.const(np.finfo(np.float32).min), q)
    p = n.Softmax(n.Where(seen, scores, lowest), axis=-1)
    o = n.MatMul(p, n.Unsqueeze(vh, n.ints([2])))
    o = n.Reshape(o, n.ints([0, nh, -1, head]))
    n.op("Reshape", n.Transpose(o, perm=[0, 2, 1, 3]), n.ints([0, 0, nh * head]), out=node.output[0])
    outs = list(node.output) + ["", ""]
    n.identity(kh, outs[1])
    n.identity(vh, outs[2])
    return n.nodes


def rotary_embedding(heads: int, head: int, offset: bool):
    """com.microsoft RotaryEmbedding on a (B, S, heads * head) input, position_ids (B, S) or, with ``offset``,
    (1,) (positions start there): cos/sin rows gathered by position, then the rotation of ``_rotate``."""
    def form(node: onnx.NodeProto) -> list[onnx.NodeProto]:
        n = Nodes(node)
        x, pos_ids, cos_cache, sin_cache = node.input[:4]
        rd = n.attrs.get("rotary_embedding_dim", 0) or head
        if offset:
            seq = n.Squeeze(n.Slice(n.Shape(x), n.ints([1]), n.ints([2]), n.ints([0])), n.ints([0]))
            start = n.Squeeze(pos_ids, n.ints([0]))
            pos = n.Unsqueeze(n.Range(start, n.Add(start, seq), n.const(1, np.int64)), n.ints([0]))
        else:
            pos = pos_ids
        cos, sin = n.Gather(cos_cache, pos), n.Gather(sin_cache, pos)  # [B or 1, S, rd / 2]
        x4 = n.Reshape(x, n.ints([0, 0, heads, head]))
        out = _rotate(n, x4, cos, sin, rd, head, bool(n.attrs.get("interleaved", 0)), batched=True)
        n.op("Reshape", out, n.ints([0, 0, heads * head]), out=node.output[0])
        return n.nodes

    return form


def matmul_nbits(value: Callable[[str], np.ndarray]):
    """MatMulNBits as MatMul(A, dequant(B)^T) (+ bias), the dequantized weight a constant of A's type."""
    def form(node: onnx.NodeProto) -> list[onnx.NodeProto]:
        n = Nodes(node)
        w = dequantize_nbits(node, value)
        y = n.MatMul(node.input[0], n.const(w.T, w.dtype))
        ins = list(node.input) + [""] * 6
        if ins[5]:
            y = n.Add(y, ins[5])
        n.identity(y, node.output[0])
        return n.nodes

    return form


def dynamic_quantize_matmul(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """DynamicQuantizeMatMul as A @ ((B - b_zero_point) * b_scale) (+ bias): the float product the kernel
    approximates (it rounds A to uint8 over A's range first), in A's type."""
    n = Nodes(node)
    ins = list(node.input) + [""] * 5
    w = n.CastLike(ins[1], ins[2])
    if ins[3]:
        w = n.Sub(w, n.CastLike(ins[3], ins[2]))
    w = n.CastLike(n.Mul(w, ins[2]), ins[0])
    y = n.MatMul(ins[0], w)
    if ins[4]:
        y = n.Add(y, ins[4])
    n.identity(y, node.output[0])
    return n.nodes


def _width(info, name: str) -> int | None:
    i = info.get(name)
    d = i.shape[-1] if i is not None and i.shape else None
    return d if isinstance(d, int) else None


def _form_of(node: onnx.NodeProto, info, value):
    """The form of ``node`` with the sizes it needs read from the model, or None for an op without one."""
    op, domain = node.op_type, normalize_domain(node.domain)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if op == "SimplifiedLayerNormalization" and domain in ("", "com.microsoft"):
        x = info.get(node.input[0])
        return simplified_layer_norm(len(x.shape)) if x is not None and x.shape is not None else None
    if domain != "com.microsoft":
        return None
    if op in ("SkipSimplifiedLayerNormalization", "SkipLayerNormalization"):
        return skip_norm
    if op == "MatMulNBits":
        return matmul_nbits(value)
    if op == "DynamicQuantizeMatMul":
        return dynamic_quantize_matmul
    if op == "GroupQueryAttention":
        width = _width(info, node.input[0])
        nh, kvh = attrs["num_heads"], attrs["kv_num_heads"]
        packed = len(node.input) < 2 or not node.input[1]
        if width is None:
            return None
        head = width // (nh + 2 * kvh) if packed else width // nh
        cos = _width(info, node.input[7]) if attrs.get("do_rotary", 0) and len(node.input) > 7 else 0
        return group_query_attention(head, cos or 0)
    if op == "RotaryEmbedding":
        width, cos = _width(info, node.input[0]), _width(info, node.input[2])
        if width is None or cos is None:
            return None
        head = width // attrs["num_heads"] if attrs.get("num_heads") else 2 * cos
        positions = info.get(node.input[1])
        offset = positions is not None and positions.shape is not None and len(positions.shape) == 1
        return rotary_embedding(width // head, head, offset)
    return None


def has_contrib_ops(model: onnx.ModelProto) -> bool:
    """Whether ``model`` has a node of onnxruntime's (com.microsoft, or SimplifiedLayerNormalization, which
    onnxruntime registers in the default domain): ops it runs in float32 only, which ``expand_contrib`` replaces."""
    return any(normalize_domain(n.domain) == "com.microsoft" or n.op_type == "SimplifiedLayerNormalization"
               for n in model.graph.node)


def expand_contrib(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with every contrib node of the main graph that has a form replaced by it (outputs keep
    their names). GradcheckError naming the node for a com.microsoft op without a form."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    info = infer_tensor_info(out)
    inits = {t.name: t for t in g.initializer}

    def value(name: str) -> np.ndarray:
        if name not in inits:
            raise GradcheckError(f"{name!r} is not an initializer: the float64 form of its node needs its value")
        return numpy_helper.to_array(inits[name])

    nodes = []
    for node in g.node:
        form = _form_of(node, info, value)
        if form is None and normalize_domain(node.domain) == "com.microsoft":
            raise GradcheckError(f"node {node.name!r} ({node.op_type}, com.microsoft): onnxruntime runs it in float32 "
                                 "only and there is no standard-ONNX form of it here to check in float64; check "
                                 "it in float32 (--float32, float64=False)")
        nodes.extend(form(node) if form is not None else [node])
    del g.node[:]
    g.node.extend(nodes)
    if not any(o.domain in ("", "ai.onnx") and o.version >= 18 for o in out.opset_import):
        raise GradcheckError("the standard forms of the contrib ops need opset 18 or newer")
    return out


__all__ = ["Nodes", "simplified_layer_norm", "skip_norm", "group_query_attention", "rotary_embedding",
           "matmul_nbits", "expand_contrib", "has_contrib_ops"]
