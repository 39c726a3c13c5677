"""Fixes to a bundle's one-graph step model for runtime quirks that are not a missing op (``Target.quirks``,
``engine/targets.py``); ``driver/bundle.py`` applies them before writing ``step.onnx``.

* ``transposed-shared-weight`` (OpenVINO 2026.4, CPU plugin): when one constant is the weight (input B)
  of two products that read it in different orientations (``x @ W`` and ``dy @ Transpose(W)``, or Gemm's
  transB), the second computes with the first one's orientation (silently where the weight is square;
  measured on a LoRA step of a tiny Llama, whose frozen base weights are constants that the backward reads
  transposed). We write the second product with the constant on the left, ``(W @ A^T)^T``, which
  OpenVINO computes right.
* ``symbolic-value-info`` (tract 0.23.9): tract plans for concrete input shapes and then cannot unify a
  symbolic dim of an intermediate ``value_info`` (``B,S,64``) with the concrete one (``2,8,64``); we drop
  the intermediate value_info entries that hold a symbolic dim (they are hints, not part of the step).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..engine.targets import Target, get_target
from ..graph import infer_tensor_info


def fix_step_for_target(step: onnx.ModelProto, target: str | Target | None) -> None:
    """Apply, in place, the fixes for the quirks of ``target`` to the one-graph ``step`` model."""
    quirks = get_target(target).quirks
    if "transposed-shared-weight" in quirks:
        _constant_on_the_left(step)
    if "symbolic-value-info" in quirks:
        kept = [vi for vi in step.graph.value_info if not _symbolic(vi)]
        del step.graph.value_info[:]
        step.graph.value_info.extend(kept)


def _symbolic(vi: onnx.ValueInfoProto) -> bool:
    t = vi.type.tensor_type
    return t.HasField("shape") and any(not d.HasField("dim_value") for d in t.shape.dim)


def _swap_last_two(rank: int) -> list[int]:
    return list(range(rank - 2)) + [rank - 1, rank - 2]


def _attr(n: onnx.NodeProto, name: str, default=0):
    return next((helper.get_attribute_value(a) for a in n.attribute if a.name == name), default)


class _Weights:
    """The 2-D initializers that MatMul/Gemm nodes read as B, each use with its orientation: the product
    reads ``W`` ("N") or ``W^T`` ("T"), through a Transpose node or Gemm's transB."""

    def __init__(self, g: onnx.GraphProto):
        inits = {t.name: t for t in g.initializer if len(t.dims) == 2}
        producer = {o: n for n in g.node for o in n.output}
        self.uses: dict[str, list] = {}
        for k, n in enumerate(g.node):
            if n.op_type not in ("MatMul", "Gemm") or n.domain not in ("", "ai.onnx") or len(n.input) < 2:
                continue
            b, flip = n.input[1], False
            p = producer.get(b)
            if p is not None and p.op_type == "Transpose" and list(_attr(p, "perm", [])) in ([], [1, 0]):
                b, flip = p.input[0], True
            if b in inits:
                flip ^= n.op_type == "Gemm" and bool(_attr(n, "transB"))
                self.uses.setdefault(b, []).append((k, "T" if flip else "N"))

    def misoriented(self) -> dict[int, tuple[str, str]]:
        """{node index: (weight, orientation)} of the uses whose orientation differs from the weight's first
        use (the forward's), for the weights read both ways."""
        out = {}
        for w, uses in self.uses.items():
            first = uses[0][1]
            out.update({k: (w, o) for k, o in uses if o != first})
        return out


def _left(w: str, orient: str, base: str, nodes: list) -> str:
    """``W_eff^T`` for a product that reads ``W_eff`` (``W`` itself when the product reads ``W^T``)."""
    if orient == "T":
        return w
    nodes.append(helper.make_node("Transpose", [w], [f"{base}/w_t"], name=f"{base}/w_t_node"))
    return f"{base}/w_t"


def _product_with_weight_on_the_left(n: onnx.NodeProto, w: str, orient: str, rank: int | None) -> list | None:
    """``A @ W_eff`` (MatMul) or ``alpha op(A) W_eff`` (Gemm without C) as ``(W_eff^T @ A^T)^T``; None when the
    rank of A is unknown or the Gemm adds C."""
    base, nodes = n.name or n.output[0], []
    if n.op_type == "MatMul":
        if rank is None or rank < 2:
            return None
        perm = _swap_last_two(rank)
        left = _left(w, orient, base, nodes)
        return nodes + [
            helper.make_node("Transpose", [n.input[0]], [f"{base}/a_t"], name=f"{base}/a_t_node", perm=perm),
            helper.make_node("MatMul", [left, f"{base}/a_t"], [f"{base}/w_a_t"], name=f"{base}/w_a_t_node"),
            helper.make_node("Transpose", [f"{base}/w_a_t"], list(n.output), name=n.name, perm=perm)]
    if len(n.input) > 2 and n.input[2]:
        return None
    left = _left(w, orient, base, nodes)
    gemm = helper.make_node("Gemm", [left, n.input[0]], [f"{base}/w_a_t"], name=f"{base}/w_a_t_node",
                            alpha=float(_attr(n, "alpha", 1.0)), transB=0 if _attr(n, "transA") else 1)
    return nodes + [gemm, helper.make_node("Transpose", [f"{base}/w_a_t"], list(n.output), name=n.name, perm=[1, 0])]


def _constant_on_the_left(step: onnx.ModelProto) -> None:
    """Each MatMul/Gemm that reads a constant weight in the other orientation than the weight's first use
    computes the product with the constant as its left operand (or, where that form needs what we do not
    know, reads a transposed copy of the constant)."""
    g = step.graph
    todo = _Weights(g).misoriented()
    if not todo:
        return
    info = infer_tensor_info(step)
    inits = {t.name: t for t in g.initializer}
    nodes = []
    for k, n in enumerate(g.node):
        if k not in todo:
            nodes.append(n)
            continue
        w, orient = todo[k]
        a = info.get(n.input[0])
        new = _product_with_weight_on_the_left(n, w, orient, len(a.shape) if a and a.shape is not None else None)
        if new is None:  # a copy of the constant in the orientation this product reads, as a plain MatMul-able B
            arr = numpy_helper.to_array(inits[w])
            copy = numpy_helper.from_array(np.ascontiguousarray(arr.T if orient == "T" else arr), f"{n.name}/{w}_copy")
            g.initializer.append(copy)
            new = [_with_b(n, copy.name)]
        nodes += new
    del g.node[:]
    g.node.extend(nodes)
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    for n in [n for n in g.node if n.op_type == "Transpose" and not any(o in used for o in n.output)]:
        g.node.remove(n)


def _with_b(n: onnx.NodeProto, b: str) -> onnx.NodeProto:
    """``n`` reading ``b`` as its B input, untransposed (transB dropped)."""
    m = onnx.NodeProto()
    m.CopyFrom(n)
    m.input[1] = b
    kept = [a for a in m.attribute if a.name != "transB"]
    del m.attribute[:]
    m.attribute.extend(kept)
    return m
