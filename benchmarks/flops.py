"""FLOPs of a model's products, counted from shapes: the bound beside a measured step / forward ratio.

Only MatMul, Gemm, Conv and ConvTranspose are counted (a multiply-add is 2 FLOPs; Gemm's bias and every
elementwise op are left out): they are where a CNN's or a transformer's time goes, and a clean backward
costs about two forwards of them, so ``step FLOPs / forward FLOPs`` is about 3 whatever the runtime does.
Shapes come from onnx's shape inference (``onnx_autodiff.tensor_info``) after the graph inputs named in
``shapes`` are given those sizes; a counted node whose shapes stay unknown is listed, not guessed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import onnx

COUNTED = ("MatMul", "Gemm", "Conv", "ConvTranspose")


@dataclass
class Flops:
    by_op: dict[str, int] = field(default_factory=dict)  # op type -> FLOPs of its nodes
    unknown: list[str] = field(default_factory=list)  # counted op types' nodes whose shapes are not known

    @property
    def total(self) -> int:
        return sum(self.by_op.values())


def node_flops(op_type: str, ins: list, out: tuple | None, attrs: dict) -> int | None:
    """FLOPs of one node from its input shapes ``ins`` and first output's shape ``out`` (None: unknown)."""
    if op_type not in COUNTED:
        raise ValueError(f"no FLOP count for {op_type}; counted: {COUNTED}")
    if op_type == "MatMul":  # [..., M, K] x [..., K, N] -> [..., M, N]; a 1-D side is a vector
        a = ins[0]
        return None if a is None or out is None else 2 * math.prod(out) * a[-1]
    if op_type == "Gemm":  # A [M, K] (or [K, M] with transA) x B -> Y [M, N]
        a = ins[0]
        return None if a is None or out is None else 2 * math.prod(out) * a[0 if attrs.get("transA") else 1]
    w = ins[1] if len(ins) > 1 else None
    if w is None:
        return None
    if op_type == "Conv":  # W [M, C/group, k...]: every output element is a (C/group) x prod(k) dot product
        return None if out is None else 2 * math.prod(out) * math.prod(w[1:])
    x = ins[0]  # ConvTranspose: W [C, M/group, k...], every input element scatters into (M/group) x prod(k)
    return None if x is None else 2 * math.prod(x) * math.prod(w[1:])


def _fixed(model: onnx.ModelProto, shapes: dict[str, tuple]) -> onnx.ModelProto:
    """A copy of ``model`` without its graph's initializer data (their shapes kept as inputs) and with the
    graph inputs of ``shapes`` given those sizes: shape inference needs no weights, and a symbolic batch
    dim becomes a number."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    inputs = {i.name for i in g.input}
    keep = []
    for t in g.initializer:
        if t.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) and math.prod(t.dims) <= 64:
            keep.append(t)  # shape arithmetic: its values matter
        elif t.name not in inputs:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    del g.initializer[:]
    g.initializer.extend(keep)
    for i in g.input:
        if i.name in shapes:
            dims = i.type.tensor_type.shape.dim
            for d, size in zip(dims, shapes[i.name]):
                d.Clear()
                d.dim_value = int(size)
    return m


def model_flops(model: onnx.ModelProto | str, shapes: dict[str, tuple] | None = None) -> Flops:
    """The FLOPs of ``model``'s products (its main graph), the inputs of ``shapes`` set to those sizes."""
    from onnx_autodiff.tensor_info import infer_tensor_info

    if isinstance(model, str):
        model = onnx.load(model, load_external_data=False)
    fixed = _fixed(model, shapes or {})
    info = infer_tensor_info(fixed)

    def shape(name: str):
        i = info.get(name)
        dims = None if i is None else i.shape
        return tuple(dims) if dims is not None and all(isinstance(d, int) for d in dims) else None
    out = Flops()
    for node in fixed.graph.node:
        if node.op_type not in COUNTED or node.domain not in ("", "ai.onnx"):
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        n = node_flops(node.op_type, [shape(i) for i in node.input], shape(node.output[0]), attrs)
        if n is None:
            out.unknown.append(node.name or node.output[0])
        else:
            out.by_op[node.op_type] = out.by_op.get(node.op_type, 0) + n
    return out
