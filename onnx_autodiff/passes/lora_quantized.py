"""LoRA over quantized weights: onnxruntime's ``com.microsoft`` MatMulNBits, and a MatMul whose weight is
``DequantizeLinear`` of an integer (int4/int8, blocked or per axis) initializer.

The rewrite adds the adapter branch beside such a node as beside a float one; the quantized weight stays
as it is (the forward keeps the quantized op, the backward reaches the activation through it, see
gradient_rules/quantized.py). Merging folds the adapters into a float weight: the merged layer becomes a
plain MatMul of dequant(W) + delta (re-quantizing it would change the logits by the quantization error).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..graph import FLOAT_TYPES
from ..model.weights import placeholder

MS_DOMAIN = "com.microsoft"


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def quantized_candidate(node: onnx.NodeProto, inits: dict, producers: dict):
    """``(weight, quant, n_in, n_out, dtype)`` for a MatMulNBits node or a MatMul of a DequantizeLinear'd
    rank-2 initializer, else None. ``weight``: the packed (integer) initializer; ``quant``: ``nbits`` or
    ``dequantize_linear``; ``dtype``: the float type the layer computes in (its scales')."""
    if node.op_type == "MatMulNBits" and node.domain == MS_DOMAIN and len(node.input) >= 3:
        a = _attrs(node)
        b, scales = node.input[1], node.input[2]
        if b not in inits or scales not in inits or a.get("weight_prepacked", 0):
            return None
        return b, "nbits", int(a["K"]), int(a["N"]), inits[scales].data_type
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
        return None
    dq = producers.get(node.input[1])
    if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits or len(dq.input) < 2:
        return None
    w, scale = inits[dq.input[0]], inits.get(dq.input[1])
    if len(w.dims) != 2 or w.data_type in FLOAT_TYPES or scale is None:
        return None
    return dq.input[0], "dequantize_linear", int(w.dims[0]), int(w.dims[1]), scale.data_type


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """The codes of uint8 ``packed`` [..., bytes] as [..., bytes * 8 / bits], low bits first."""
    per = 8 // bits
    shifts = (bits * np.arange(per)).astype(np.uint8)
    codes = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)


def dequantize_nbits(node: onnx.NodeProto, value: Callable) -> np.ndarray:
    """MatMulNBits' weight as float [N, K] (onnxruntime's contrib-operator spec: (code - zero point) * scale,
    blocks of ``block_size`` along K, zero points packed like B or unpacked, 2^(bits-1) by default)."""
    a = _attrs(node)
    k, n, bits, block = int(a["K"]), int(a["N"]), int(a.get("bits", 4)), int(a["block_size"])
    blocks = -(-k // block)
    scales = np.asarray(value(node.input[2]))
    dt = scales.dtype
    codes = unpack(np.asarray(value(node.input[1])), bits).reshape(n, blocks, block).astype(np.float64)
    zp_name = node.input[3] if len(node.input) > 3 else ""
    if not zp_name:
        zp = np.full((n, blocks), 2.0 ** (bits - 1))
    else:
        zp = np.asarray(value(zp_name))
        zp = unpack(zp.reshape(n, -1), bits)[:, :blocks] if zp.dtype == np.uint8 else zp.reshape(n, blocks)
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


def merge_quantized(g: onnx.GraphProto, layer: dict, delta: np.ndarray, value: Callable, detached: bool,
                    merged: dict) -> set[str]:
    """Replace the quantized layer by a plain MatMul of dequant(W) + delta (``delta`` as the node reads W:
    [N, K] for MatMulNBits, [K, N] for DequantizeLinear's), writing the layer's original output. Returns
    the names of the nodes to drop."""
    node = next(n for n in g.node if n.name == layer["node"])
    if layer["quant"] == "nbits":
        base = dequantize_nbits(node, value)
        w = (base.astype(np.float64) + delta).T
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


def drop_unread(g: onnx.GraphProto, names: set[str]) -> None:
    """Remove the initializers among ``names`` that no node reads any more (a merged layer's quantized
    weight, scales and zero points)."""
    read = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    keep = [t for t in g.initializer if t.name in read or t.name not in names]
    del g.initializer[:]
    g.initializer.extend(keep)
