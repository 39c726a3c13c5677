"""Peephole rewrites of emitted Transpose nodes: a transposed transpose, and a transposed Gemm.

A Linear layer exported without constant folding reads ``MatMul(X, Transpose(W))`` with W trainable
state. Its backward, rule by rule, is ``dX = dY @ Transpose(Transpose(W))`` (``Gemm(dY, Transpose(W),
transB=1)`` for a 2-D X) and ``dW = Transpose(X^T @ dY)``. Here the first becomes ``dY @ W`` (the
forward Transpose then has one reader, the forward MatMul, and onnxruntime folds it into that product
as a FusedMatMul), the second one Gemm with its operands swapped, ``dY^T @ X``. Only emitted nodes are changed; the forward graph stays as it is.
"""
from __future__ import annotations

import onnx
from onnx import helper

from ..graph import node_inputs

FOLD_TRANSPOSES = True  # tests switch it off to compare with the rule-by-rule graph


def _perm(node: onnx.NodeProto) -> list[int] | None:
    for a in node.attribute:
        if a.name == "perm":
            return list(a.ints)
    return None


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _absorb_operand_transposes(gemm: onnx.NodeProto, made: dict, producer: dict) -> None:
    """Gemm(Transpose(a), b) reads a with its trans flag flipped (2-D operands, perm [1, 0])."""
    flags = {"transA": int(_attr(gemm, "transA", 0)), "transB": int(_attr(gemm, "transB", 0))}
    changed = False
    for k, flag in ((0, "transA"), (1, "transB")):
        src = gemm.input[k]
        t = made.get(src) or producer.get(src)
        if t is not None and t.op_type == "Transpose" and t.domain in ("", "ai.onnx") and _perm(t) == [1, 0]:
            gemm.input[k] = t.input[0]
            flags[flag] = 1 - flags[flag]
            changed = True
    if changed:
        kept = [a for a in gemm.attribute if a.name not in flags]
        del gemm.attribute[:]
        gemm.attribute.extend(kept)
        gemm.attribute.extend(helper.make_attribute(k, v) for k, v in flags.items() if v)


def fold_transposes(nodes: list[onnx.NodeProto], producer: dict[str, onnx.NodeProto], keep: set[str]
                    ) -> list[onnx.NodeProto]:
    """``nodes`` (emitted, in order) with Transpose(Transpose(a)) read as a when the two perms undo each
    other, Transpose(perm=[1, 0]) of a Gemm without C, read once, turned into the swapped Gemm, and
    a Gemm operand that is a transposed matrix read untransposed with the Gemm's flag flipped.
    ``producer`` maps the graph's own tensors to their nodes; ``keep`` are names read outside."""
    if not FOLD_TRANSPOSES:
        return nodes
    made = {o: n for n in nodes for o in n.output if o}
    uses: dict[str, int] = {}
    for n in nodes:
        for i in node_inputs(n):
            uses[i] = uses.get(i, 0) + 1
    alias: dict[str, str] = {}
    drop: set[int] = set()
    for n in nodes:
        if alias:
            n.input[:] = [alias.get(i, i) for i in n.input]
        if n.op_type == "Gemm" and n.domain in ("", "ai.onnx"):
            _absorb_operand_transposes(n, made, producer)
            continue
        if n.op_type != "Transpose" or n.domain not in ("", "ai.onnx"):
            continue
        src = n.input[0]
        inner = made.get(src) or producer.get(src)
        if inner is None or inner.domain not in ("", "ai.onnx"):
            continue
        outer_perm = _perm(n)
        if inner.op_type == "Transpose":
            inner_perm = _perm(inner)
            if outer_perm is None or inner_perm is None or len(outer_perm) != len(inner_perm):
                continue  # a default perm reverses axes: fine too, but rare enough to leave
            if n.output[0] not in keep and all(inner_perm[p] == k for k, p in enumerate(outer_perm)):
                alias[n.output[0]] = inner.input[0]
                drop.add(id(n))
        elif (inner.op_type == "Gemm" and outer_perm == [1, 0] and src in made and uses.get(src) == 1
              and src not in keep and (len(inner.input) < 3 or not inner.input[2])):
            a, b = inner.input[0], inner.input[1]
            ta, tb = int(_attr(inner, "transA", 0)), int(_attr(inner, "transB", 0))
            alpha = float(_attr(inner, "alpha", 1.0))
            swapped = helper.make_node("Gemm", [b, a], [n.output[0]], name=inner.name, transA=1 - tb or None,
                                       transB=1 - ta or None, alpha=None if alpha == 1.0 else alpha)
            inner.CopyFrom(swapped)
            drop.add(id(n))
    if not drop:
        return nodes
    out = [n for n in nodes if id(n) not in drop]
    if alias:
        for n in out:
            n.input[:] = [alias.get(i, i) for i in n.input]
    return out
