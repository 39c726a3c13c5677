"""A standard-ONNX form of onnxruntime's ``GatherBlockQuantized`` (com.microsoft), for ``check``'s float64
reference: onnxruntime has float32/float16 kernels only, and a builder model with tied embeddings reads its
embedding through one (the lm_head's int4 weight, gathered by token id).

The form follows onnxruntime's contrib-operator documentation: ``data`` is quantized block-wise along
``quantize_axis`` (``block_size`` codes share a scale and a zero point); int4/uint4 data holds one code an
element, uint8 data one a byte (``bits=8``) or two (``bits=4``, the low nibble first, packed along the last axis,
its zero points packed the same way); without zero points uint8 codes are centred on 2^(bits-1), int4/uint4 ones on
0. The form dequantizes the whole table, ``(code - zero point) * scale``, in the scales' type, then Gathers along
``gather_axis``: memory for a reference, not for training (the gradient rule never dequantizes the table).
Written with the builder the gradient rules use (``engine/builder.py``).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from ..engine.builder import Emitter, GradBuilder, NodeView
from ..errors import GradcheckError
from ..graph import normalize_domain, opset_map, set_nodes
from ..passes.rewrite import Facts

MS_DOMAIN = "com.microsoft"
_CODES = {TensorProto.UINT8, TensorProto.INT4, TensorProto.UINT4}


def _codes(g: GradBuilder, x: str, rank: int, packed: bool) -> str:
    """int32 codes of ``x`` (of ``rank``); ``packed``: two 4-bit codes a byte along the last axis, low first."""
    codes = g.Cast(x, to=TensorProto.INT32)
    if not packed:
        return codes
    sixteen = g.const(np.int32(16))
    low, high = g.Mod(codes, sixteen), g.Div(codes, sixteen)
    pairs = g.Concat(g.unsqueeze(low, [rank]), g.unsqueeze(high, [rank]), axis=rank)
    return g.Reshape(pairs, g.ints([0] * (rank - 1) + [-1]))


def _refuse(node: NodeView, why: str) -> GradcheckError:
    return GradcheckError(f"node {node.name!r} (GatherBlockQuantized, com.microsoft): {why}; check it in float32 "
                          "(--float32, float64=False)")


def gather_block_quantized(g: GradBuilder, node: NodeView) -> str:
    """The output of GatherBlockQuantized ``node`` in standard ops (module docstring)."""
    data, indices, scales = node.inputs[:3]
    zero = node.input(3)
    bits, block = int(node.attr("bits", 4)), int(node.attr("block_size", 128))
    rank, kind = g.rank(data), g.dtype(data)
    if rank is None or kind not in _CODES:
        raise _refuse(node, "its data's rank or element type (uint8, int4, uint4) is unknown")
    if bits not in (4, 8) or (kind != TensorProto.UINT8 and bits != 4):
        raise _refuse(node, f"bits={bits} with {TensorProto.DataType.Name(kind)} data is not a documented form")
    gather_axis, axis = int(node.attr("gather_axis", 0)) % rank, int(node.attr("quantize_axis", 1)) % rank
    packed = kind == TensorProto.UINT8 and bits == 4
    if packed and axis != rank - 1:
        raise _refuse(node, "packed uint8 data quantized along an axis other than the last")
    codes = _codes(g, data, rank, packed)
    length = g.Squeeze(g.Slice(g.Shape(codes), g.ints([axis]), g.ints([axis + 1]), g.ints([0])), g.ints([0]))
    blocks = g.Div(g.Range(g.const(np.int64(0)), length, g.const(np.int64(1))), g.const(np.int64(block)))
    if zero is None:
        centre = 2 ** (bits - 1) if kind == TensorProto.UINT8 else 0
        centred = g.Sub(codes, g.const(np.int32(centre)))
    else:
        zp = _codes(g, zero, rank, packed)
        if packed:  # an odd count of blocks leaves a padding nibble
            count = g.Slice(g.Shape(scales), g.ints([axis]), g.ints([axis + 1]), g.ints([0]))
            zp = g.Slice(zp, g.ints([0]), count, g.ints([axis]))
        centred = g.Sub(codes, g.Gather(zp, blocks, axis=axis))
    kind = g.dtype(scales)
    centred = g.Cast(centred, to=kind) if kind is not None else g.cast_like(centred, scales)
    table = g.Mul(centred, g.Gather(scales, blocks, axis=axis))
    return g.Gather(table, indices, axis=gather_axis)


def has_gather_block_quantized(model: onnx.ModelProto) -> bool:
    return any(n.op_type == "GatherBlockQuantized" and normalize_domain(n.domain) == MS_DOMAIN
               for n in model.graph.node)


def expand_gather_block_quantized(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with each GatherBlockQuantized of its inference graph replaced by its standard form
    (the output keeps its name)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    if not has_gather_block_quantized(out):
        return out
    facts = Facts(out, graph)
    taken = {t.name for t in graph.initializer} | {i.name for i in graph.input}
    taken |= {o for n in graph.node for o in list(n.output) + [n.name]}
    opset = opset_map(out).get("", 0)
    nodes = []
    for n in graph.node:
        if n.op_type != "GatherBlockQuantized" or normalize_domain(n.domain) != MS_DOMAIN:
            nodes.append(n)
            continue
        em = Emitter(facts.view, taken)
        result = gather_block_quantized(GradBuilder(em, f"{n.name or n.op_type}/form"), NodeView(n, opset, []))
        for m in em.nodes:
            m.output[:] = [n.output[0] if o == result else o for o in m.output]
        nodes.extend(em.nodes)
    set_nodes(graph, nodes)
    return out


__all__ = ["gather_block_quantized", "expand_gather_block_quantized", "has_gather_block_quantized"]
