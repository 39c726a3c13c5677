"""Quantized weights: onnxruntime's ``com.microsoft`` MatMulNBits, DynamicQuantizeMatMul and GatherBlockQuantized
(their gradient and type rules), the dynamically quantized product of onnxruntime's ``quantize_dynamic``
(``DynamicQuantizeLinear`` + ``MatMulInteger`` + scale ``Mul``, differentiated as one DynamicQuantizeMatMul), and
the scale of DequantizeLinear.

The gradient reaches the activation through the quantized product; the packed weight, its scales and
zero points are constants of the base model and get none. The backward dequantizes the weight with
standard ONNX ops (no contrib kernel beyond the forward one the model already runs).

Packing, as onnxruntime's contrib-operator spec states it: the logical weight is [N, K], quantized in
blocks of ``block_size`` along K; B is uint8 [N, k_blocks, block_size * bits / 8] with the codes of a
block packed low bits first; scales are [N, k_blocks]; zero points are either packed like B per row
(uint8 [N, ceil(k_blocks * bits / 8)]) or unpacked in A's type ([N, k_blocks]), and default to
2^(bits - 1). The weight is (code - zero point) * scale and Y = A @ weight^T (+ bias).
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from onnx_autodiff.rule_api import (
    GradBuilder,
    GradientRuleError,
    Grads,
    NodeView,
    StandIn,
    gradient_group,
    gradient_rule,
    type_rule,
)

_MS = "com.microsoft"
_QUANT_INPUTS = {1: "packed weight B", 2: "scales", 3: "zero_points", 4: "g_idx"}


def unpack_codes(g: GradBuilder, packed: str, rank: int, bits: int, like: str) -> str:
    """The codes of uint8 ``packed`` (of ``rank``) [..., bytes] as [..., bytes, 8 / bits] in ``like``'s float type,
    low bits first: code j of a byte is floor(byte / 2^(j bits)) - 2^bits floor(byte / 2^((j+1) bits))
    (exact in float: the values are integers below 256 and the divisors powers of two)."""
    per = 8 // bits
    dt = g.np_dtype(like)
    x = g.unsqueeze(g.Cast(packed, to=g.dtype(like)), [rank])
    low = g.const(np.power(2.0, bits * np.arange(per)), dtype=dt)
    high = g.const(np.power(2.0, bits * np.arange(1, per + 1)), dtype=dt)
    shifted = g.Floor(g.Div(x, low))
    above = g.Floor(g.Div(x, high))
    return g.Sub(shifted, g.Mul(above, g.const(2.0 ** bits, dtype=dt)))


def _zero_points(g: GradBuilder, zp: str | None, n: int, k_blocks: int, bits: int, like: str) -> str:
    """The zero points as [N, k_blocks, 1] in ``like``'s float type."""
    dt = g.np_dtype(like)
    if zp is None:
        return g.const(2.0 ** (bits - 1), dtype=dt)
    if g.dtype(zp) == TensorProto.UINT8:
        codes = unpack_codes(g, g.Reshape(zp, g.ints([n, -1])), 2, bits, like)
        flat = g.Reshape(codes, g.ints([n, -1]))
        zp_f = g.slice(flat, [0], [k_blocks], [1])
    else:
        zp_f = g.cast_like(zp, like)
    return g.Reshape(zp_f, g.ints([n, k_blocks, 1]))


def dequantized_weight(g: GradBuilder, node: NodeView, like: str) -> str:
    """The weight MatMulNBits multiplies by, as a float [N, K] tensor of ``like``'s type."""
    k, n = int(node.attr("K")), int(node.attr("N"))
    bits, block = int(node.attr("bits", 4)), int(node.attr("block_size"))
    if bits not in (2, 4, 8):
        raise GradientRuleError(f"{node}: bits={bits}; the MatMulNBits gradient handles 2, 4 and 8 bits")
    k_blocks = -(-k // block)
    if _run_time_dequantization(g, like) and (bits == 8 or g.has_op("BitShift")):
        w = _dequantize_linear(g, node, n, k_blocks, bits, block, like)
    else:
        codes = g.Reshape(unpack_codes(g, node.inputs[1], 3, bits, like), g.ints([n, k_blocks, block]))
        zp = _zero_points(g, node.input(3), n, k_blocks, bits, like)
        scales = g.Reshape(g.cast_like(node.inputs[2], like), g.ints([n, k_blocks, 1]))
        w = g.Reshape(g.Mul(g.Sub(codes, zp), scales), g.ints([n, k_blocks * block]))
    return w if k_blocks * block == k else g.slice(w, [0], [k], [1])


# Why the weight is dequantized by DequantizeLinear where it can be: the packed weight and its scales are
# constants, and onnxruntime folds constant subgraphs when it makes a session. Folded, the float chain above
# became every weight in float32 (2 GB for a Qwen2.5-0.5B-shaped int4 model) and, while it folded, several
# float32 temporaries of each (a session's creation peaked at 18 GB, 45 s). onnxruntime does not fold
# DequantizeLinear (it keeps quantized weights quantized), so the codes are unpacked in uint8 (folded: one byte a
# weight) and each weight is dequantized when the backward reads it, then freed (docs/benchmarks.md: the session's
# creation 48 -> 8 s, the run's peak 18.0 -> 7.8 GB). TrainingSession unpacks them once in numpy before onnxruntime
# sees the step (driver/prefold.py: onnxruntime's folding of BitShift/Mod was most of the session's creation).
def _run_time_dequantization(g: GradBuilder, like: str) -> bool:
    """DequantizeLinear per axis (opset 13) takes float scales, float16 and bfloat16 ones from opset 19."""
    dt = g.dtype(like)
    return g.opset >= 13 and (dt == TensorProto.FLOAT or (g.opset >= 19 and dt in (TensorProto.FLOAT16,
                                                                                     TensorProto.BFLOAT16)))


def _codes_uint8(g: GradBuilder, packed: str, rank: int, bits: int) -> str:
    """The codes of uint8 ``packed`` (of ``rank``) [..., bytes] as uint8 [..., bytes, 8 / bits], low bits first:
    code j is the byte shifted right past the codes below it, modulo 2^bits (not a left shift that drops the
    codes above: OpenVINO shifts uint8 left without wrapping)."""
    x = g.unsqueeze(packed, [rank])
    if bits == 8:
        return x
    shifted = g.BitShift(x, g.const([bits * j for j in range(8 // bits)], dtype=np.uint8), direction="RIGHT")
    return g.Mod(shifted, g.const([2 ** bits], dtype=np.uint8))


def _dequantize_linear(g: GradBuilder, node: NodeView, n: int, k_blocks: int, bits: int, block: int,
                       like: str) -> str:
    """[N, k_blocks * block] in ``like``'s type: DequantizeLinear of the codes as [N * k_blocks, block] along axis 0
    (a scale and zero point per block)."""
    rows = n * k_blocks
    codes = g.Reshape(_codes_uint8(g, node.inputs[1], 3, bits), g.ints([rows, block]))
    scales = g.Reshape(g.cast_like(node.inputs[2], like), g.ints([rows]))
    zp = node.input(3)
    if zp is None:
        zp_codes = g.Expand(g.const(np.uint8(2 ** (bits - 1))), g.ints([rows]))
    elif g.dtype(zp) == TensorProto.UINT8:
        unpacked = g.Reshape(_codes_uint8(g, g.Reshape(zp, g.ints([n, -1])), 2, bits), g.ints([n, -1]))
        zp_codes = g.Reshape(g.slice(unpacked, [0], [k_blocks], [1]), g.ints([rows]))
    else:  # zero points in the scales' type: (code - zp) * scale = code * scale - zp * scale
        w = g.DequantizeLinear(codes, scales, axis=0)
        shift = g.Mul(g.Reshape(g.cast_like(zp, like), g.ints([rows, 1])), g.Reshape(scales, g.ints([rows, 1])))
        return g.Reshape(g.Sub(w, shift), g.ints([n, k_blocks * block]))
    return g.Reshape(g.DequantizeLinear(codes, scales, zp_codes, axis=0), g.ints([n, k_blocks * block]))


@gradient_rule("MatMulNBits", domain=_MS)
def matmulnbits_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Y = A @ dequant(B)^T (+ bias): dA = dY @ dequant(B), dBias = dY summed over all but the last axis."""
    dz, = dy
    asked = [name for i, name in _QUANT_INPUTS.items() if node.needs_grad(i)]
    if asked:
        raise GradientRuleError(
            f"{node}: the quantized weight's {', '.join(asked)} get no gradient; freeze them "
            "(they are constants of the quantized base: train adapters beside it, e.g. lora=...)")
    if node.input(4) is not None:
        raise GradientRuleError(f"{node}: the deprecated g_idx input is not supported; re-quantize without it")
    if int(node.attr("weight_prepacked", 0)):
        raise GradientRuleError(f"{node}: weight_prepacked={node.attr('weight_prepacked')} (an execution "
                                "provider's private layout) cannot be dequantized in standard ONNX")
    a = node.inputs[0]
    da = None
    if node.needs_grad(0):
        int8 = _int8_weight(g, node)
        da = g.MatMul(dz, dequantized_weight(g, node, a)) if int8 is None else int8_input_grad(g, dz, *int8, a)
    bias = node.input(5)
    dbias = None
    if bias is not None and node.needs_grad(5):
        rank = g.rank(a)
        if rank is None:
            raise GradientRuleError(f"{node}: the bias gradient needs the rank of {a!r}; run shape inference")
        dbias = g.reduce_sum(dz, list(range(rank - 1)), keepdims=False)
    return [da, None, None, None, None, dbias]


# The opt-in 8-bit backward (``make_training_model(lora={..., "base_backward": "int8"})``): the LoRA rewrite stores
# the frozen weight re-quantized once to int8 per column of W [N, K] (training/lora/quantized.py), and dA = dY @ W
# runs on onnxruntime's int8 kernels: dY quantized per row to uint8 around 128 (per row, not per tensor: a
# cross-entropy gradient's one large entry per row would round the rest of the row to zero), MatMulInteger
# (u8 x u8 around 128, int32 sums: onnxruntime's u8 x s8 kernel saturates on AVX2 without VNNI, see
# training/lora/quantized.int8_backward_names), then the row's and the column's scales. Error: ~1% of dA per
# product; the adapters' gradients 1-4% (docs/llm.md).
_ACC_LIMIT = 2 ** 31 - 1  # MatMulInteger's int32 sums: at most 127 * 127 per term


def _int8_names(packed: str) -> tuple[str, str]:
    """The names ``training/lora/quantized.int8_backward_names`` gives the int8 weight and its scales (a rule
    imports only the rule API: tests/training/test_lora_int8_backward.py checks the two agree)."""
    return f"{packed}.int8_backward", f"{packed}.int8_backward_scale"


def _int8_weight(g: GradBuilder, node: NodeView) -> tuple[str, str, int, int] | None:
    """(weight codes uint8 [N, K] around 128, float scale [K], N, K) the LoRA rewrite stored for this node's int8
    backward, else None (the float32 backward, the default)."""
    k, n = int(node.attr("K")), int(node.attr("N"))
    w, scale = _int8_names(node.inputs[1])
    if g.dtype(w) is None and g.dtype(scale) is None:
        return None
    if (g.dtype(w), g.static_shape(w), g.dtype(scale), g.static_shape(scale)) != (
            TensorProto.UINT8, (n, k), g.dtype(node.inputs[0]), (k,)):
        raise GradientRuleError(f"{node}: its int8 backward needs {w!r} uint8 [{n}, {k}] and {scale!r} [{k}] in the "
                                f"input's type; make the training model again with lora={{..., 'base_backward': "
                                "'int8'}} (it writes them)")
    return w, scale, n, k


def int8_input_grad(g: GradBuilder, dz: str, w: str, scale: str, n: int, k: int, a: str) -> str:
    """dA = dY @ W in 8 bits, shaped like ``a``: ``w`` uint8 [N, K] around 128 with ``scale`` [K] per column,
    dY [..., N] quantized per row to uint8 around 128. The row's largest entry is taken apart (``_row_scales``):
    the scale is the second largest |entry| / 127, QuantizeLinear saturates the largest, and what it cut off is
    added back in float times its row of W. A cross-entropy gradient (softmax - one_hot) has one large entry per
    row beside many small ones; scaled by the large one, the small ones all round to zero, and their sum (the
    expectation of W's rows under the softmax, nearly the same for every token) goes missing from every row alike,
    so the adapters' gradients, sums over the tokens, lost ~10% (docs/llm.md). The contraction is split in pieces
    whose int32 sums cannot overflow (N > 133,143: an LM head over a large vocabulary)."""
    g.require(13, "the int8 backward's per-row QuantizeLinear")
    flat = g.Reshape(dz, g.ints([-1, n]))
    rows, spike, at = _row_scales(g, flat, n)
    scale_rows = g.Reshape(rows, g.ints([-1]))
    mid = g.const(np.uint8(128))
    q = g.QuantizeLinear(flat, scale_rows, g.Expand(mid, g.shape_of(scale_rows)), axis=0)
    pieces = -(-n * 127 * 127 // _ACC_LIMIT)
    sizes = [n // pieces + (1 if j < n % pieces else 0) for j in range(pieces)]
    parts = [g.Cast(g.MatMulInteger(qj, wj, mid, mid), to=g.dtype(dz))
             for qj, wj in zip(g.split(q, 1, sizes), g.split(w, 0, sizes))]
    acc = parts[0] if len(parts) == 1 else g.Sum(*parts)
    col = g.cast_like(scale, dz)
    dx = g.Mul(g.Mul(acc, rows), col)
    if spike is not None:  # + (spike - saturate(spike)) * W[argmax]
        bound = g.Mul(rows, g.const(127.0, like=dz))
        cut = g.Sub(spike, g.Min(g.Max(spike, g.Neg(bound)), bound))
        codes = g.Cast(g.Gather(w, g.Reshape(at, g.ints([-1])), axis=0), to=g.dtype(dz))
        w_rows = g.Mul(g.Sub(codes, g.const(128.0, like=dz)), col)
        dx = g.Add(dx, g.Mul(cut, w_rows))
    return g.reshape_like(dx, a)


def _row_scales(g: GradBuilder, flat: str, n: int) -> tuple[str, str | None, str | None]:
    """(scale [M, 1], largest entry [M, 1], its column [M, 1]) of each row of ``flat`` [M, N]: the scale is the
    second largest |entry| / 127 (at least the smallest normal float, so a zero row divides by no zero). N = 1:
    the largest |entry| / 127 and no spike."""
    tiny = g.const(np.finfo(np.float32).tiny, like=flat)
    inv = g.const(1.0 / 127.0, like=flat)
    mag = g.Abs(flat)
    if n < 2:
        return g.Max(g.Mul(mag, inv), tiny), None, None
    top, at = g.op("TopK", mag, g.ints([2]), outputs=2, axis=1)
    second = g.slice(top, [1], [2], [1])
    first_at = g.slice(at, [0], [1], [1])
    return g.Max(g.Mul(second, inv), tiny), g.GatherElements(flat, first_at, axis=1), first_at


@type_rule("MatMulNBits", domain=_MS)
def matmulnbits_type(s: StandIn, node: NodeView) -> None:
    """Y = A @ W for a [K, N] stand-in W in the scales' type (A's); a bias [N] does not change Y's shape."""
    w = s.zeros([int(node.attr("K")), int(node.attr("N"))], like=node.inputs[2])
    s.op("MatMul", node.inputs[0], w, out=node.outputs[0])


def _dequantized_int8(g: GradBuilder, w: str, scale: str, zp: str | None, like: str) -> str:
    """(W - zero point) * scale in ``like``'s float type: W [K, N] integer, the scale and zero point per tensor or
    per column [N] (a DequantizeLinear where it can be: not folded into a float32 copy of W, see above)."""
    if _run_time_dequantization(g, like):
        shape = g.static_shape(scale)
        if shape is not None and tuple(shape) in ((), (1,)):  # per tensor: DequantizeLinear takes a scalar
            scale = g.Reshape(scale, g.ints([]))
            zp = g.Reshape(zp, g.ints([])) if zp is not None else None
            return g.cast_like(g.DequantizeLinear(w, scale, zp), like)
        if shape is not None and len(shape) == 1:
            return g.cast_like(g.DequantizeLinear(w, scale, zp, axis=1), like)
    wf = g.cast_like(w, like)
    if zp is not None:
        wf = g.Sub(wf, g.cast_like(zp, like))
    return g.Mul(wf, g.cast_like(scale, like))


@gradient_rule("DynamicQuantizeMatMul", domain=_MS)
def dynamicquantizematmul_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Y = quant(A) @ dequant(B) (+ bias), A quantized to uint8 at run time over its own range: the gradient
    treats quant(A) as A (a straight-through estimate: the codes are a step function of A, and the range always
    covers A, so nothing is clipped): dA = dY @ dequant(B)^T; dBias = dY summed over all but the last axis. The
    int8 weight, its scale and zero point are constants of the quantized base and get none."""
    dz, = dy
    asked = [what for i, what in ((1, "weight B"), (2, "b_scale"), (3, "b_zero_point")) if node.needs_grad(i)]
    if asked:
        raise GradientRuleError(
            f"{node}: the quantized weight's {', '.join(asked)} get no gradient; freeze them "
            "(they are constants of the quantized base: train adapters beside it, e.g. lora=...)")
    a = node.inputs[0]
    da = None
    if node.needs_grad(0):
        w = _dequantized_int8(g, node.inputs[1], node.inputs[2], node.input(3), a)
        da = g.MatMul(dz, g.Transpose(w, perm=[1, 0]))
    dbias = None
    bias = node.input(4)
    if bias is not None and node.needs_grad(4):
        rank = g.rank(dz)
        if rank is None:
            raise GradientRuleError(f"{node}: the bias gradient needs the rank of the output; run shape inference")
        dbias = g.reduce_sum(dz, list(range(rank - 1)), keepdims=False)
    return [da, None, None, None, dbias]


@type_rule("DynamicQuantizeMatMul", domain=_MS)
def dynamicquantizematmul_type(s: StandIn, node: NodeView) -> None:
    """Y = A @ W for a stand-in W of B's shape in A's type; a bias [N] does not change Y's shape."""
    b = s.info(node.inputs[1])
    if b.shape is None or not all(isinstance(d, int) for d in b.shape):
        return
    s.op("MatMul", node.inputs[0], s.zeros(list(b.shape), like=node.inputs[0]), out=node.outputs[0])


def _only_reader(view, name: str, op: str):
    readers = view.consumers.get(name, [])
    if len(readers) == 1 and readers[0].op_type == op and readers[0].domain in ("", "ai.onnx"):
        return readers[0]
    return None


@gradient_group
def dynamic_int8_products(view, nodes) -> list:
    """onnxruntime's ``quantize_dynamic`` writes ``x @ W`` as ``q, s, z = DynamicQuantizeLinear(x)``,
    ``Mul(Cast(MatMulInteger(q, W_int8, z, W_zp)), Mul(s, W_scale))``: one DynamicQuantizeMatMul(x, W_int8,
    W_scale, W_zp) (onnxruntime fuses it so when it optimizes the graph). The DynamicQuantizeLinear joins the
    groups when nothing else reads it (several projections share it)."""
    names = {n.name for n in nodes}
    found, covered = [], {}
    for mm in nodes:
        if mm.op_type != "MatMulInteger" or mm.domain not in ("", "ai.onnx") or len(mm.input) < 3:
            continue
        dq = view.producer.get(mm.input[0])
        if dq is None or dq.op_type != "DynamicQuantizeLinear" or dq.name not in names or mm.input[2] != dq.output[2]:
            continue
        cast = _only_reader(view, mm.output[0], "Cast")
        out = _only_reader(view, cast.output[0], "Mul") if cast is not None else None
        if out is None:
            continue
        scales = view.producer.get(out.input[1] if out.input[0] == cast.output[0] else out.input[0])
        if scales is None or scales.op_type != "Mul" or dq.output[1] not in scales.input \
                or len(view.consumers.get(scales.output[0], [])) != 1:
            continue
        w_scale = scales.input[1] if scales.input[0] == dq.output[1] else scales.input[0]
        inputs = [dq.input[0], mm.input[1], w_scale] + ([mm.input[3]] if len(mm.input) > 3 and mm.input[3] else [])
        node = helper.make_node("DynamicQuantizeMatMul", inputs, [out.output[0]], name=out.name, domain=_MS)
        members = {mm.name, cast.name, out.name, scales.name}
        found.append((node, members))
        covered.setdefault(dq.name, (dq, set(), members))[1].update(members)
    for dq, members, first in covered.values():
        readers = {r.name for o in dq.output if o for r in view.consumers.get(o, [])}
        if readers <= members:
            first.add(dq.name)
    return found


@gradient_rule("GatherBlockQuantized", domain=_MS)
def gatherblockquantized_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """A quantized embedding: its data and indices are integers and get no gradient; the engine calls this
    only when the scales (or float zero points) are asked for, which are constants of the quantized base."""
    raise GradientRuleError(f"{node}: the quantized embedding's scales and zero points get no gradient; freeze "
                            "them (train adapters beside the quantized base, e.g. lora=...)")


@type_rule("GatherBlockQuantized", domain=_MS)
def gatherblockquantized_type(s: StandIn, node: NodeView) -> None:
    """Gather from a stand-in of the data's logical shape (uint8 data packs 8 / bits codes per byte along the
    last axis) in the scales' type."""
    data = s.info(node.inputs[0])
    if data.shape is None or not all(isinstance(d, int) for d in data.shape):
        return
    shape = list(data.shape)
    bits = int(node.attr("bits", 4))
    if data.dtype == TensorProto.UINT8 and bits < 8:
        shape[-1] *= 8 // bits
    logical = s.zeros(shape, like=node.inputs[2])
    s.op("Gather", logical, node.inputs[1], out=node.outputs[0], axis=int(node.attr("gather_axis", 0)))


@gradient_rule("DequantizeLinear", since=10)
def dequantizelinear_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """y = (x - zero_point) * scale, the scale per tensor, per axis or per block along ``axis``:
    dScale = dY * (x - zero_point) summed over what each scale covers. The integer (or float8) x and the
    zero point get none; (x - zero_point) is DequantizeLinear itself with a scale of ones."""
    dz, = dy
    if node.needs_grad(0) or node.needs_grad(2):
        raise GradientRuleError(f"{node}: the quantized input and its zero point get no gradient")
    x, scale = node.inputs[:2]
    ones = g.ones_like(scale)
    attrs = {a: node.attr(a) for a in ("axis", "block_size", "output_dtype") if node.has_attr(a)}
    centred = g.op("DequantizeLinear", x, ones, node.input(2), **attrs)
    t = g.Mul(dz, g.cast_like(centred, dz))
    rank, s_rank = g.rank(x), g.rank(scale)
    if rank is None or s_rank is None:
        raise GradientRuleError(f"{node}: the scale's gradient needs the ranks of {x!r} and {scale!r}")
    if s_rank == 0 or g.static_shape(scale) == (1,):  # one scale for the whole tensor
        ds = g.reduce_sum(t, None, keepdims=False)
        return [None, g.Reshape(ds, g.shape_of(scale))]
    axis = int(node.attr("axis", 1)) % rank
    block = int(node.attr("block_size", 0))
    if not block:
        return [None, g.reduce_sum(t, [k for k in range(rank) if k != axis], keepdims=False)]
    return [None, _block_sum(g, node, t, axis, block, scale)]


def _block_sum(g: GradBuilder, node: NodeView, t: str, axis: int, block: int, scale: str) -> str:
    """``t`` summed over each block of ``block`` entries along ``axis`` (the last block may be short)."""
    shape = g.static_shape(t) or g.static_shape(node.inputs[0])
    if shape is None:
        raise GradientRuleError(f"{node}: the blocked scale's gradient needs the static shape of {node.inputs[0]!r}")
    blocks = -(-shape[axis] // block)
    pads = [0] * (2 * len(shape))
    pads[len(shape) + axis] = blocks * block - shape[axis]
    padded = g.pad(t, pads)
    split = list(shape[:axis]) + [blocks, block] + list(shape[axis + 1:])
    return g.reduce_sum(g.Reshape(padded, g.ints(split)), [axis + 1], keepdims=False)
