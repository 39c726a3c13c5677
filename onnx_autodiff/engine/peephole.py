"""Peephole rewrites of emitted backward nodes: transposes around matrix products, and a Sum of
zero-padded blocks that tile an axis (a Concat).

A Linear layer exported without constant folding reads ``MatMul(X, Transpose(W))`` with W trainable
state. Its backward, rule by rule, is ``dX = dY @ Transpose(Transpose(W))`` (``Gemm(dY, Transpose(W),
transB=1)`` for a 2-D X) and ``dW = Transpose(X^T @ dY)``. Here the first becomes ``dY @ W`` (the
forward Transpose then has one reader, the forward MatMul, and onnxruntime folds it into that product
as a FusedMatMul), the second one Gemm with its operands swapped, ``dY^T @ X``.

An attention layer exported with one stacked in-projection picks q, k and v with ``Gather(index 0 / 1
/ 2)``; each Gather's gradient pads its dy with zeros back to the stacked shape, and the three are
summed. That is ``Concat(dq, dk, dv)``: one write of the result, where Pad and Sum wrote it four times
and read it three. Only emitted nodes are changed; the forward graph stays as it is.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..graph import attr_value, node_inputs
from .peephole_views import view_rewrites


def peephole(nodes: list[onnx.NodeProto], view, keep: set[str], options: dict | None = None) -> list[onnx.NodeProto]:
    """Both rewrites on ``nodes`` (emitted, in order); ``view`` is the GraphView they were emitted
    against (producers of the graph's own tensors, shapes); ``keep`` are names read outside. ``options``
    (the emitter's): ``fold_transposes`` / ``concat_pads`` / ``pooled_relu_mask`` / ``compose_views`` False
    skip a rewrite (tests compare the forms); ``compose_views`` is ``peephole_views.py``'s."""
    options = options or {}
    if options.get("fold_transposes", True):
        nodes = fold_transposes(nodes, view.producer, keep)
    if options.get("concat_pads", True):
        nodes = pads_to_concat(nodes, keep, view.shape)
    if options.get("pooled_relu_mask", True):
        nodes = pooled_relu_mask(nodes, view.producer, keep)
    if options.get("compose_views", True):
        nodes = view_rewrites(nodes, keep, view.shape)
    return nodes


def _perm(node: onnx.NodeProto) -> list[int] | None:
    perm = attr_value(node, "perm")
    return None if perm is None else list(perm)


def _producers(nodes: list[onnx.NodeProto]) -> dict[str, onnx.NodeProto]:
    """Each tensor's producing node among ``nodes``."""
    return {o: n for n in nodes for o in n.output[:] if o}  # [:]: see graph.py's docstring


def _uses(nodes: list[onnx.NodeProto]) -> Counter:
    """How many times ``nodes`` read each tensor."""
    return Counter(i for n in nodes for i in node_inputs(n))


def _absorb_operand_transposes(gemm: onnx.NodeProto, made: dict, producer: dict) -> None:
    """Gemm(Transpose(a), b) reads a with its trans flag flipped (2-D operands, perm [1, 0])."""
    flags = {"transA": int(attr_value(gemm, "transA", 0)), "transB": int(attr_value(gemm, "transB", 0))}
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
    made = _producers(nodes)
    # only a Transpose reads the use counts: without one, skip reading every node's inputs
    uses = _uses(nodes) if any(n.op_type == "Transpose" for n in nodes) else Counter()
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
            ta, tb = int(attr_value(inner, "transA", 0)), int(attr_value(inner, "transB", 0))
            alpha = float(attr_value(inner, "alpha", 1.0))
            swapped = helper.make_node("Gemm", [b, a], [n.output[0]], name=inner.name, transA=1 - tb or None,
                                       transB=1 - ta or None, alpha=None if alpha == 1.0 else alpha)
            inner.CopyFrom(swapped)
            drop.add(id(n))
            del made[src]  # the Gemm now writes the Transpose's output: a later fold must find it there
            made[n.output[0]] = inner
    if not drop:
        return nodes
    out = [n for n in nodes if id(n) not in drop]
    if alias:
        for n in out:
            n.input[:] = [alias.get(i, i) for i in n.input]
    return out


def _constant(made: dict, name: str):
    node = made.get(name)
    if node is None or node.op_type != "Constant" or len(node.attribute) != 1 or node.attribute[0].name != "value":
        return None
    return numpy_helper.to_array(node.attribute[0].t)


def _padded_block(pad: onnx.NodeProto, made: dict):
    """(axis, begin, end pad) of a zero Pad along one axis, else None."""
    if pad.op_type != "Pad" or pad.domain not in ("", "ai.onnx") or len(pad.input) < 2:
        return None
    if len(pad.input) > 2 and any(pad.input[2:]) or any(a.name == "mode" and a.s not in (b"constant",)
                                                       for a in pad.attribute):
        return None
    pads = _constant(made, pad.input[1])
    if pads is None or pads.ndim != 1 or pads.size % 2:
        return None
    r = pads.size // 2
    axes = [k for k in range(r) if pads[k] or pads[r + k]]
    if len(axes) != 1 or np.any(pads < 0):
        return None
    return axes[0], int(pads[axes[0]]), int(pads[r + axes[0]])


def pads_to_concat(nodes: list[onnx.NodeProto], keep: set[str], shape) -> list[onnx.NodeProto]:
    """``Sum(Pad(a), Pad(b), ...)``, where each Pad (read once) puts its block between zeros along the
    same axis and the blocks tile that axis without gap or overlap, as ``Concat(a, b, ..., axis)``.
    ``shape(name)`` gives the padded tensors' shapes (the axis length must be known)."""
    if not any(n.op_type == "Pad" for n in nodes):
        return nodes  # nothing to rewrite: skip the producer and use maps
    made, uses = _producers(nodes), _uses(nodes)
    drop: set[int] = set()
    for n in nodes:
        if n.op_type != "Sum" or n.domain not in ("", "ai.onnx") or len(n.input) < 2:
            continue
        pads = [made.get(i) for i in n.input]
        if any(p is None or uses.get(i) != 1 or i in keep for p, i in zip(pads, n.input)):
            continue
        blocks = [_padded_block(p, made) for p in pads]
        if any(b is None for b in blocks) or len({b[0] for b in blocks}) != 1:
            continue
        axis = blocks[0][0]
        shapes = {shape(i) for i in n.input}  # one shape, static along the axis: no broadcasting Sum
        full = shapes.pop() if len(shapes) == 1 else None
        total = full[axis] if full is not None and len(full) > axis else None
        if not isinstance(total, int):
            continue
        order = sorted(range(len(blocks)), key=lambda k: blocks[k][1])
        spans = [(blocks[k][1], total - blocks[k][2]) for k in order]  # [begin, end) of each block
        if spans[0][0] != 0 or spans[-1][1] != total or any(a[1] != b[0] or a[0] >= a[1]
                                                            for a, b in zip(spans, spans[1:] + [(total, total)])):
            continue
        n.CopyFrom(helper.make_node("Concat", [pads[k].input[0] for k in order], list(n.output), name=n.name,
                                    axis=axis))
        drop.update(id(pads[k]) for k in order)
    return [n for n in nodes if id(n) not in drop] if drop else nodes


def _relu_mask(made: dict, mask: str) -> tuple[str, onnx.NodeProto, np.ndarray] | None:
    """(r, the Cast, the zero) of a Relu derivative ``Cast(Greater(r, 0))``, else None."""
    cast = made.get(mask)
    if cast is None or cast.op_type != "Cast" or cast.domain not in ("", "ai.onnx"):
        return None
    greater = made.get(cast.input[0])
    if greater is None or greater.op_type != "Greater" or greater.domain not in ("", "ai.onnx"):
        return None
    zero = _constant(made, greater.input[1])
    if zero is None or zero.size != 1 or zero.reshape(-1)[0] != 0:
        return None
    return greater.input[0], cast, zero


def _pooled_relu(unpool: onnx.NodeProto, made: dict, producer: dict) -> tuple[str, str] | None:
    """(r, y) when ``unpool`` scatters at the Indices of a MaxPool (y its first output) of ``Relu(r)``."""
    if unpool.op_type != "MaxUnpool" or unpool.domain not in ("", "ai.onnx"):
        return None
    pool = made.get(unpool.input[1]) or producer.get(unpool.input[1])
    if (pool is None or pool.op_type != "MaxPool" or pool.domain not in ("", "ai.onnx") or len(pool.output) < 2
            or pool.output[1] != unpool.input[1] or not pool.output[0]):
        return None
    relu = made.get(pool.input[0]) or producer.get(pool.input[0])
    if relu is None or relu.op_type != "Relu" or relu.domain not in ("", "ai.onnx"):
        return None
    return relu.input[0], pool.output[0]


def pooled_relu_mask(nodes: list[onnx.NodeProto], producer: dict[str, onnx.NodeProto], keep: set[str]
                     ) -> list[onnx.NodeProto]:
    """``MaxUnpool(dz, I) * Cast(r > 0)``, I the Indices of ``MaxPool(Relu(r))`` and the MaxUnpool read once, as
    ``MaxUnpool(dz * Cast(y > 0), I)`` (module docstring). The Relu mask's nodes stay for the clean-up to drop
    when nothing else reads them."""
    if not any(n.op_type == "MaxUnpool" for n in nodes):
        return nodes
    made, uses = _producers(nodes), _uses(nodes)
    at = {id(n): k for k, n in enumerate(nodes)}
    insert: dict[int, list[onnx.NodeProto]] = {}
    drop: set[int] = set()
    for n in nodes:
        if n.op_type != "Mul" or n.domain not in ("", "ai.onnx") or n.output[0] in keep:
            continue
        for a, b in ((0, 1), (1, 0)):
            unpool, mask = made.get(n.input[a]), _relu_mask(made, n.input[b])
            if unpool is None or mask is None or uses.get(n.input[a]) != 1 or n.input[a] in keep:
                continue
            pooled = _pooled_relu(unpool, made, producer)
            if pooled is None or pooled[0] != mask[0]:
                continue
            _mask_before_unpool(unpool, n, pooled[1], mask, insert.setdefault(at[id(unpool)], []))
            drop.add(id(n))
            break
    if not drop:
        return nodes
    out = []
    for k, n in enumerate(nodes):
        out.extend(insert.get(k, []))
        if id(n) not in drop:
            out.append(n)
    return out


def _mask_before_unpool(unpool: onnx.NodeProto, mul: onnx.NodeProto, y: str, mask, new: list) -> None:
    """Rewrite ``unpool`` to scatter ``dz * Cast(y > 0)`` into ``mul``'s output; the three nodes that make it
    go into ``new`` (to run right before the MaxUnpool)."""
    _, cast, zero = mask
    base = mul.output[0]
    names = [f"{base}/pooled/{s}" for s in ("zero", "positive", "mask", "masked")]
    new += [helper.make_node("Constant", [], [names[0]], name=names[0], value=numpy_helper.from_array(zero)),
            helper.make_node("Greater", [y, names[0]], [names[1]], name=names[1]),
            helper.make_node("Cast", [names[1]], [names[2]], name=names[2], to=int(attr_value(cast, "to"))),
            helper.make_node("Mul", [unpool.input[0], names[2]], [names[3]], name=names[3])]
    unpool.input[0] = names[3]
    unpool.output[0] = base
