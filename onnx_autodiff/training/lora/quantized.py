"""LoRA over quantized weights: onnxruntime's ``com.microsoft`` MatMulNBits, a MatMul whose weight is
``DequantizeLinear`` of an integer (int4/int8, blocked or per axis) initializer, and the dynamically quantized
product of onnxruntime's ``quantize_dynamic`` (``DynamicQuantizeLinear`` + ``MatMulInteger`` + ``Cast`` + scale
``Mul``, the layer's input the DynamicQuantizeLinear's, its output the last Mul's).

The rewrite adds the adapter branch beside such a node as beside a float one; the quantized weight stays
as it is (the forward keeps the quantized op, the backward reaches the activation through it, see
gradient_rules/quantized.py). Merging folds the adapters into a float weight: the merged layer becomes a
plain MatMul of dequant(W) + delta (re-quantizing it would change the logits by the quantization error).

``lora={..., "base_backward": "int8"}`` (opt-in; default ``"float32"``): each frozen MatMulNBits whose input
depends on an adapter gets its weight re-quantized once here, at build time, to int8 per column of the logical
[N, K] weight (``<B>.int8_backward``: the int8 codes + 128 as uint8 [N, K], and ``<B>.int8_backward_scale``
float32 [K], symmetric); the
MatMulNBits gradient rule then computes dA = dY @ W in 8 bits with standard ops (gradient_rules/quantized.py,
``int8_input_grad``): dY quantized per row at run time, MatMulInteger, the two scales applied after.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...graph import FLOAT_TYPES, walk_graph
from ...model.weights import placeholder

MS_DOMAIN = "com.microsoft"
BASE_BACKWARDS = ("float32", "int8")  # lora={"base_backward": ...}: how dA reaches through the frozen base
_CHUNK_ROWS = 4096  # rows of a weight dequantized at a time (the lm_head's [151936, 896] in 0.5 GB pieces)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def dynamic_product(node: onnx.NodeProto, inits: dict, producers: dict) -> dict | None:
    """The nodes of a dynamically quantized product whose last ``Mul`` is ``node``: ``{"quantize", "matmul",
    "cast", "scales", "out"}`` and its ``weight``, ``scale``, ``zero_point`` initializers, else None."""
    if node.op_type != "Mul" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return None
    for k in (0, 1):
        cast, scales = producers.get(node.input[k]), producers.get(node.input[1 - k])
        if cast is None or cast.op_type != "Cast" or scales is None or scales.op_type != "Mul":
            continue
        mm = producers.get(cast.input[0])
        if mm is None or mm.op_type != "MatMulInteger" or len(mm.input) < 3 or mm.input[1] not in inits:
            continue
        dq = producers.get(mm.input[0])
        if dq is None or dq.op_type != "DynamicQuantizeLinear" or dq.output[1] not in scales.input:
            continue
        scale = scales.input[1] if scales.input[0] == dq.output[1] else scales.input[0]
        zp = mm.input[3] if len(mm.input) > 3 and mm.input[3] else ""
        if scale not in inits or (zp and zp not in inits) or len(inits[mm.input[1]].dims) != 2:
            continue
        return {"quantize": dq, "matmul": mm, "cast": cast, "scales": scales, "out": node, "weight": mm.input[1],
                "scale": scale, "zero_point": zp}
    return None


def quantized_candidate(node: onnx.NodeProto, inits: dict, producers: dict):
    """``(weight, quant, n_in, n_out, dtype, input)`` for a MatMulNBits node, a MatMul of a DequantizeLinear'd
    rank-2 initializer or the last Mul of a dynamically quantized product, else None. ``weight``: the packed
    (integer) initializer; ``quant``: ``nbits``, ``dequantize_linear`` or ``dynamic``; ``dtype``: the float type
    the layer computes in (its scales'); ``input``: the layer's float input."""
    if node.op_type == "MatMulNBits" and node.domain == MS_DOMAIN and len(node.input) >= 3:
        a = _attrs(node)
        b, scales = node.input[1], node.input[2]
        if b not in inits or scales not in inits or a.get("weight_prepacked", 0):
            return None
        return b, "nbits", int(a["K"]), int(a["N"]), inits[scales].data_type, node.input[0]
    product = dynamic_product(node, inits, producers)
    if product is not None:
        k, n = (int(d) for d in inits[product["weight"]].dims)
        return product["weight"], "dynamic", k, n, inits[product["scale"]].data_type, product["quantize"].input[0]
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
        return None
    dq = producers.get(node.input[1])
    if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits or len(dq.input) < 2:
        return None
    w, scale = inits[dq.input[0]], inits.get(dq.input[1])
    if len(w.dims) != 2 or w.data_type in FLOAT_TYPES or scale is None:
        return None
    return dq.input[0], "dequantize_linear", int(w.dims[0]), int(w.dims[1]), scale.data_type, node.input[0]


# (domain, op) -> positions of the quantization constants it reads (scales, zero points)
_QUANT_CONSTANTS = {("", "DequantizeLinear"): (1, 2), ("", "QuantizeLinear"): (1, 2),
                    (MS_DOMAIN, "MatMulNBits"): (2, 3), (MS_DOMAIN, "GatherBlockQuantized"): (2, 3),
                    (MS_DOMAIN, "DynamicQuantizeMatMul"): (2, 3)}


def quantization_constants(graph: onnx.GraphProto) -> set[str]:
    """The scales and zero points ``graph``'s quantized ops read, and the weight scale that onnxruntime's
    ``quantize_dynamic`` multiplies with a DynamicQuantizeLinear scale (``Mul(s_x, s_w)``): constants of a quantized
    base, not parameters."""
    names = set()
    dynamic_scales = {n.output[1] for n in graph.node if n.op_type == "DynamicQuantizeLinear" and len(n.output) > 1}
    for n in graph.node:
        domain = "" if n.domain == "ai.onnx" else n.domain
        names.update(n.input[i] for i in _QUANT_CONSTANTS.get((domain, n.op_type), ()) if i < len(n.input))
        if n.op_type == "Mul" and len(n.input) == 2 and set(n.input) & dynamic_scales:
            names.update(set(n.input) - dynamic_scales)
    names.discard("")
    return names


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """The codes of uint8 ``packed`` [..., bytes] as [..., bytes * 8 / bits], low bits first."""
    per = 8 // bits
    shifts = (bits * np.arange(per)).astype(np.uint8)
    codes = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)


def _zero_points(node: onnx.NodeProto, value: Callable, n: int, blocks: int, bits: int) -> np.ndarray | None:
    """MatMulNBits' zero points as [N, blocks] (packed like B or given unpacked), or None where it has none."""
    name = node.input[3] if len(node.input) > 3 else ""
    if not name:
        return None
    zp = np.asarray(value(name))
    return unpack(zp.reshape(n, -1), bits)[:, :blocks] if zp.dtype == np.uint8 else zp.reshape(n, blocks)


def dequantize_nbits(node: onnx.NodeProto, value: Callable) -> np.ndarray:
    """MatMulNBits' weight as float [N, K] (onnxruntime's contrib-operator spec: (code - zero point) * scale,
    blocks of ``block_size`` along K, zero points packed like B or unpacked, 2^(bits-1) by default)."""
    a = _attrs(node)
    k, n, bits, block = int(a["K"]), int(a["N"]), int(a.get("bits", 4)), int(a["block_size"])
    blocks = -(-k // block)
    scales = np.asarray(value(node.input[2]))
    dt = scales.dtype
    codes = unpack(np.asarray(value(node.input[1])), bits).reshape(n, blocks, block).astype(np.float64)
    zp = _zero_points(node, value, n, blocks, bits)
    if zp is None:
        zp = np.full((n, blocks), 2.0 ** (bits - 1))
    w = (codes - zp.astype(np.float64)[..., None]) * scales.reshape(n, blocks, 1).astype(np.float64)
    return w.reshape(n, blocks * block)[:, :k].astype(dt)


def dequantize_linear(node: onnx.NodeProto, value: Callable) -> np.ndarray:
    """DequantizeLinear of a rank-2 initializer: per tensor, per axis or blocked along ``axis``."""
    a = _attrs(node)
    x = np.asarray(value(node.input[0])).astype(np.float64)
    scale = np.asarray(value(node.input[1]))
    dt = scale.dtype
    zp_name = node.input[2] if len(node.input) > 2 else ""
    zp = np.asarray(value(zp_name)).astype(np.float64) if zp_name else np.zeros(scale.shape)
    s = scale.astype(np.float64)
    axis, block = int(a.get("axis", 1)) % 2, int(a.get("block_size", 0))
    if block:
        s, zp = (np.repeat(t, block, axis=axis).take(range(x.shape[axis]), axis=axis) for t in (s, zp))
    elif s.ndim == 1 and s.size > 1:
        shape = [1, 1]
        shape[axis] = -1
        s, zp = s.reshape(shape), zp.reshape(shape)
    return ((x - zp) * s).astype(dt)


def dequantize_int8(product: dict, value: Callable) -> np.ndarray:
    """The float [K, N] weight of a dynamically quantized product: (W - zero point) * scale, per tensor or per
    column."""
    w = np.asarray(value(product["weight"])).astype(np.float64)
    scale = np.asarray(value(product["scale"]))
    zp = np.asarray(value(product["zero_point"])).astype(np.float64) if product["zero_point"] else 0.0
    return ((w - zp) * scale.astype(np.float64)).astype(scale.dtype)


def merge_quantized(g: onnx.GraphProto, layer: dict, delta: np.ndarray, value: Callable, detached: bool,
                    merged: dict) -> set[str]:
    """Replace the quantized layer by a plain MatMul of dequant(W) + delta (``delta`` as the node reads W:
    [N, K] for MatMulNBits, [K, N] for DequantizeLinear's and the dynamic product's), writing the layer's
    original output. Returns the names of the nodes to drop (a dynamic product's DynamicQuantizeLinear goes when
    nothing reads it any more: ``drop_unread``)."""
    node = next(n for n in g.node if n.output and n.output[0] == layer["base_output"])
    product = None
    if layer["quant"] == "nbits":
        base = dequantize_nbits(node, value)
        w = (base.astype(np.float64) + delta).T
    elif layer["quant"] == "dynamic":
        producers = {o: n for n in g.node for o in n.output}
        product = dynamic_product(node, _initializer_names(g), producers)
        base = dequantize_int8(product, value)
        w = base.astype(np.float64) + delta
    else:
        dq = next(n for n in g.node if node.input[1] in n.output)
        base = dequantize_linear(dq, value)
        w = base.astype(np.float64) + delta
    name = f"{layer['weight']}.merged"
    arr = np.ascontiguousarray(w.astype(base.dtype))
    if detached:
        g.initializer.append(placeholder(name, arr))
        merged[name] = arr
    else:
        g.initializer.append(numpy_helper.from_array(arr, name))
    if layer["quant"] == "dequantize_linear":
        node.input[1] = name
        node.output[0] = layer["output"]
        read = {i for n in g.node for i in n.input} | {o.name for o in g.output}
        return set() if dq.output[0] in read else {dq.name}
    if product is not None:
        mm = helper.make_node("MatMul", [layer.get("input") or product["quantize"].input[0], name],
                              [layer["output"]], name=f"{node.name}/merged")
        g.node.insert(list(g.node).index(node) + 1, mm)
        return {product[k].name for k in ("matmul", "cast", "scales", "out")}
    bias = node.input[5] if len(node.input) > 5 else ""
    out = layer["output"]
    mm = helper.make_node("MatMul", [node.input[0], name], [f"{out}/merged" if bias else out],
                          name=f"{node.name}/merged")
    new = [mm] + ([helper.make_node("Add", [mm.output[0], bias], [out], name=f"{node.name}/merged_bias")]
                  if bias else [])
    at = list(g.node).index(node)
    for k, n in enumerate(new):
        g.node.insert(at + 1 + k, n)
    return {node.name}


def int8_backward_names(packed: str) -> tuple[str, str]:
    """The initializers of the int8 backward of the MatMulNBits whose packed weight is ``packed``: the weight
    (its int8 codes + 128, uint8 [N, K]) and its scale per column (float32 [K]); the gradient rule looks for exactly
    these names. uint8 around 128, not int8: onnxruntime's u8 x s8 kernel on AVX2 without VNNI adds pairs of
    products in saturating int16 (255 * 127 * 2 > 32767: 19% error measured on random codes); u8 x u8 is exact."""
    return f"{packed}.int8_backward", f"{packed}.int8_backward_scale"


def _code_table(bits: int, zero: float) -> np.ndarray:
    """float32 [256, 8 / bits]: the codes of each byte value, low bits first, less ``zero`` (one gather unpacks
    and converts a whole chunk: numpy's shifts broadcast over a trailing axis of 2 took most of the time)."""
    shifts = bits * np.arange(8 // bits)
    return (((np.arange(256)[:, None] >> shifts) & ((1 << bits) - 1)) - zero).astype(np.float32)


def _nbits_rows(node: onnx.NodeProto, packed: np.ndarray, scales: np.ndarray, zp, lo: int, hi: int) -> np.ndarray:
    """Rows ``lo:hi`` of MatMulNBits' weight as float32 [hi - lo, K] ((code - zero point) * scale is one rounding
    of exact values, the same as ``dequantize_nbits``'s float64 cast to float32)."""
    a = _attrs(node)
    k, bits, block = int(a["K"]), int(a.get("bits", 4)), int(a["block_size"])
    blocks = scales.shape[1]
    table = _code_table(bits, 2.0 ** (bits - 1) if zp is None else 0.0)
    w = np.take(table, packed[lo:hi], axis=0).reshape(hi - lo, blocks, block)  # 4x faster than table[...]
    if zp is not None:
        w -= zp[lo:hi, :, None]
    w *= scales[lo:hi, :, None]
    return w.reshape(hi - lo, blocks * block)[:, :k]


def int8_columns(node: onnx.NodeProto, value: Callable) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' weight W [N, K] as int8 codes per column and their float32 scales [K]: scale_k = max_n
    |W[n, k]| / 127, code = round(W / scale_k) (a zero column: scale 1, codes 0). Two passes over row chunks, so
    the float32 weight is never whole in memory."""
    a = _attrs(node)
    k, n, bits = int(a["K"]), int(a["N"]), int(a.get("bits", 4))
    blocks = -(-k // int(a["block_size"]))
    packed = np.asarray(value(node.input[1])).reshape(n, blocks, -1)
    scales = np.asarray(value(node.input[2])).astype(np.float32).reshape(n, blocks)
    zp = _zero_points(node, value, n, blocks, bits)
    zp = None if zp is None else zp.astype(np.float32)
    chunks = [(lo, min(lo + _CHUNK_ROWS, n)) for lo in range(0, n, _CHUNK_ROWS)]
    amax = np.zeros(k, np.float32)
    for lo, hi in chunks:
        w = _nbits_rows(node, packed, scales, zp, lo, hi)
        np.maximum(amax, np.abs(w, out=w).max(0), out=amax)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    codes = np.empty((n, k), np.int8)
    for lo, hi in chunks:
        w = _nbits_rows(node, packed, scales, zp, lo, hi)
        w /= scale
        np.rint(w, out=w)
        np.clip(w, -127, 127, out=w)
        codes[lo:hi] = w
    return codes, scale


def add_int8_backward(g: onnx.GraphProto, adapters: list[str], value: Callable, store: dict) -> list[str]:
    """For each float32 MatMulNBits of ``g`` whose input depends on one of ``adapters`` (the only ones the
    backward goes through), its weight re-quantized for the int8 backward (``int8_backward_names``): the arrays
    go to ``store``, their placeholders to ``g``. Returns the MatMulNBits nodes' names."""
    downstream = set(adapters)
    for n in g.node:  # the graph is topologically sorted
        if any(i in downstream for i in n.input):
            downstream.update(o for o in n.output if o)
    inits = _initializer_names(g)
    done = []
    for n in g.node:
        if n.op_type != "MatMulNBits" or n.domain != MS_DOMAIN or not n.input or n.input[0] not in downstream:
            continue
        if len(n.input) < 3 or n.input[2] not in inits or inits[n.input[2]].data_type != onnx.TensorProto.FLOAT \
                or n.input[1] not in inits or _attrs(n).get("weight_prepacked", 0):
            continue  # a float16 layer or a weight that is not a constant keeps the float backward
        names = int8_backward_names(n.input[1])
        if names[0] in inits:
            continue
        codes, scale = int8_columns(n, value)
        for name, arr in zip(names, (codes.view(np.uint8) ^ np.uint8(0x80), scale)):  # + 128 (the sign bit flipped)
            store[name] = arr
            g.initializer.append(placeholder(name, arr))
            inits[name] = g.initializer[-1]
        done.append(n.name)
    return done


def _initializer_names(g: onnx.GraphProto) -> dict:
    return {t.name: t for t in g.initializer}


def drop_unread(g: onnx.GraphProto, names: set[str]) -> None:
    """Remove the DynamicQuantizeLinear nodes whose outputs nothing reads any more and the initializers among
    ``names`` that no node reads any more (a merged layer's quantized weight, scales and zero points)."""
    def reads() -> set[str]:
        return {i for sg in walk_graph(g) for n in sg.node for i in n.input} | {o.name for o in g.output}

    read = reads()
    dead = [n for n in g.node if n.op_type == "DynamicQuantizeLinear" and not set(n.output) & read]
    for n in dead:
        g.node.remove(n)
    read = reads()
    keep = [t for t in g.initializer if t.name in read or t.name not in names]
    del g.initializer[:]
    g.initializer.extend(keep)
