"""Peephole rewrites of emitted backward nodes that only move data: chains of Reshape, Transpose, Squeeze
and Unsqueeze composed into one Transpose between two Reshapes, and a Concat of such chains turned into
the chain of one Concat.

An attention layer's backward merges its heads by the forward's split read backwards: each of dq, dk, dv
[b, h, s, d] goes through Reshape, Transpose and Reshape to [s, b, E], and the three are concatenated and
transposed again to [s, b, 3 E] (nn.MultiheadAttention's stacked projection; GPT-2's Split does the same
along E). Concatenating the three [b, h, s, d] first and moving the result once writes each element twice
(Concat, Transpose) where the chains wrote it three times.

A tensor is tracked as a permutation of its source's digits (the positions of the source's row-major
index); a Reshape that splits a digit refines it. The composite is ``Reshape(source, digits)``, one
``Transpose`` and a ``Reshape`` to the result's shape, digits that stay neighbours merged, and no
Transpose at all where the permutation is the identity (onnxruntime folds an identity Transpose wrongly:
microsoft/onnxruntime#32228).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..graph import attr_value, node_inputs

_VIEW_OPS = ("Reshape", "Transpose", "Squeeze", "Unsqueeze")


class _Digits:
    """A tensor's axes as lists of digits of a source tensor (ids; size-1 axes have none)."""

    def __init__(self, shape: tuple[int, ...]):
        self.size: dict[int, int] = {}
        self.order: list[int] = []  # the digits in the source's memory order
        self.axes: list[list[int]] = []
        for d in shape:
            self.axes.append([self._new(d)] if d != 1 else [])
        self.order = [k for ax in self.axes for k in ax]

    def _new(self, size: int) -> int:
        k = len(self.size)
        self.size[k] = size
        return k

    def shape(self) -> list[int]:
        return [int(np.prod([self.size[k] for k in ax], dtype=np.int64)) for ax in self.axes]

    def _split(self, k: int, outer: int) -> tuple[int, int]:
        a, b = self._new(outer), self._new(self.size[k] // outer)
        i = self.order.index(k)
        self.order[i:i + 1] = [a, b]
        return a, b

    def reshape(self, shape: list[int]) -> bool:
        flat = [k for ax in self.axes for k in ax]
        axes, i = [], 0
        for t in shape:
            group, need = [], t
            while need > 1:
                if i >= len(flat):
                    return False
                k = flat[i]
                if self.size[k] > need:
                    if self.size[k] % need:
                        return False
                    flat[i:i + 1] = self._split(k, need)
                    k = flat[i]
                if need % self.size[k]:
                    return False
                group.append(k)
                need //= self.size[k]
                i += 1
            axes.append(group)
        if i != len(flat):
            return False
        self.axes = axes
        return True

    def apply(self, op: str, arg) -> bool:
        """One view op on the tracked tensor; False where it is not a view of these digits."""
        if op == "Transpose":
            if sorted(arg) != list(range(len(self.axes))):
                return False
            self.axes = [self.axes[p] for p in arg]
            return True
        shape = self.shape()
        if op == "Reshape":
            target = [shape[j] if d == 0 else int(d) for j, d in enumerate(arg)]
            if target.count(-1) == 1:
                known = int(np.prod([d for d in target if d != -1], dtype=np.int64))
                if known == 0 or int(np.prod(shape, dtype=np.int64)) % known:
                    return False
                target[target.index(-1)] = int(np.prod(shape, dtype=np.int64)) // known
            return self.reshape(target)
        rank = len(shape) + (len(arg) if op == "Unsqueeze" else 0)
        axes = sorted(a % rank for a in arg)
        if op == "Squeeze":
            if any(shape[a] != 1 for a in axes):
                return False
            self.axes = [ax for j, ax in enumerate(self.axes) if j not in axes]
        else:
            for a in axes:
                self.axes.insert(a, [])
        return True


def _composite(digits: _Digits, extra: tuple[int, int] | None = None):
    """(source shape, perm) of the tracked tensor, neighbouring digits merged. ``extra`` (size, out position):
    one more digit, first in the source's order, placed before the ``out position``-th digit of the output,
    never merged (so the source shape starts with its size)."""
    order = list(digits.order)
    out = [k for ax in digits.axes for k in ax]
    size = dict(digits.size)
    if extra is not None:
        size[-1] = extra[0]
        order.insert(0, -1)
        out.insert(extra[1], -1)
    pos = {k: j for j, k in enumerate(order)}
    runs: list[list[int]] = []
    for k in out:
        if runs and pos[k] == pos[runs[-1][-1]] + 1 and -1 not in (k, runs[-1][-1]):
            runs[-1].append(k)
        else:
            runs.append([k])
    runs_in_order = sorted(runs, key=lambda r: pos[r[0]])
    src = [int(np.prod([size[k] for k in r], dtype=np.int64)) for r in runs_in_order]
    perm = [runs_in_order.index(r) for r in runs]
    return src, perm


def _view_arg(n: onnx.NodeProto, made: dict):
    """The perm / target shape / axes of a view node, else None (not constant, not a view)."""
    if n.op_type not in _VIEW_OPS or n.domain not in ("", "ai.onnx"):
        return None
    if n.op_type == "Transpose":
        perm = attr_value(n, "perm")
        return None if perm is None else tuple(int(p) for p in perm)
    if n.op_type == "Reshape" and attr_value(n, "allowzero", 0):
        return None
    if len(n.input) > 1 and n.input[1]:
        c = made.get(n.input[1])
        if c is None or c.op_type != "Constant" or len(c.attribute) != 1 or c.attribute[0].name != "value":
            return None
        return tuple(int(v) for v in numpy_helper.to_array(c.attribute[0].t).reshape(-1))
    axes = attr_value(n, "axes")
    return None if axes is None or n.op_type == "Reshape" else tuple(int(a) for a in axes)


def _chain_back(name: str, made: dict, uses: Counter, keep: set[str], limit: int = 8) -> list:
    """The view nodes (nearest first) that write ``name`` from a tensor read by nothing else."""
    chain = []
    while len(chain) < limit:
        n = made.get(name)
        if n is None or (chain and (uses.get(name) != 1 or name in keep)) or _view_arg(n, made) is None:
            break
        chain.append(n)
        name = n.input[0]
    return chain


class _Out:
    """New nodes and their constants, named after ``base``."""

    def __init__(self, base: str, taken: set[str], shapes: dict):
        self.base, self.taken, self.nodes, self.shapes = base, taken, [], shapes

    def name(self, what: str) -> str:
        k, name = 0, f"{self.base}/views/{what}"
        while name in self.taken:
            k += 1
            name = f"{self.base}/views/{what}_{k}"
        self.taken.add(name)
        return name

    def reshape(self, x: str, shape: list[int], out: str | None = None) -> str:
        c = self.name("shape")
        self.nodes.append(helper.make_node("Constant", [], [c], name=c,
                                           value=numpy_helper.from_array(np.array(shape, dtype=np.int64))))
        out = out or self.name("reshape")
        self.nodes.append(helper.make_node("Reshape", [x, c], [out], name=out))
        self.shapes[out] = tuple(shape)
        return out

    def transpose(self, x: str, perm: list[int], out: str | None = None) -> str:
        out = out or self.name("transpose")
        self.nodes.append(helper.make_node("Transpose", [x], [out], name=out, perm=perm))
        return out


def _emit_composite(o: _Out, x: str, x_shape, src: list[int], perm: list[int], shape: list[int], out: str) -> None:
    """``out`` = x (of ``x_shape``) viewed as ``src``, moved by ``perm`` (skipped where the identity), viewed
    as ``shape``; a Reshape to the shape a tensor has is left out."""
    if perm == list(range(len(perm))):
        o.reshape(x, shape, out)
        return
    moved = [src[p] for p in perm]
    t = o.transpose(x if list(x_shape) == src else o.reshape(x, src), perm, out if moved == list(shape) else None)
    if moved != list(shape):
        o.reshape(t, shape, out)


def concat_views(nodes: list[onnx.NodeProto], keep: set[str], shape, made_shapes: dict | None = None
                 ) -> list[onnx.NodeProto]:
    """``Concat(V(a), V(b), ...)``, V the same chain of view ops with a Transpose in it on same-shaped
    sources, as ``V'(Concat(a, b, ...))``: the sources concatenated along a new first axis, one Transpose,
    one Reshape. ``shape(name)`` gives the sources' shapes (static); ``made_shapes`` gets those of the new
    tensors."""
    if not any(n.op_type == "Concat" for n in nodes) or not any(n.op_type == "Transpose" for n in nodes):
        return nodes
    made = {o: n for n in nodes for o in n.output if o}
    uses = Counter(i for n in nodes for i in node_inputs(n))
    taken = set(made) | {n.name for n in nodes}
    drop: set[int] = set()
    insert: dict[int, list] = {}
    for n in nodes:
        if n.op_type != "Concat" or n.domain not in ("", "ai.onnx") or len(n.input) < 2:
            continue
        chains = [_chain_back(i, made, uses, keep) if uses.get(i) == 1 and i not in keep else []
                  for i in n.input]
        length = _common_length(chains, made)
        if not length or len({id(c[0]) for c in chains}) != len(chains):
            continue
        chains = [c[:length] for c in chains]
        sources = [c[-1].input[0] for c in chains]
        src_shape = shape(sources[0])
        if (src_shape is None or any(not isinstance(d, int) or d < 1 for d in src_shape)
                or any(shape(s) != src_shape for s in sources[1:])):
            continue
        digits = _Digits(tuple(src_shape))
        if not all(digits.apply(v.op_type, _view_arg(v, made)) for v in reversed(chains[0])):
            continue
        view_shape = digits.shape()
        axis = int(attr_value(n, "axis")) % len(view_shape)
        at = sum(len(ax) for ax in digits.axes[:axis])
        src, perm = _composite(digits, (len(sources), at))
        result = list(view_shape)
        result[axis] *= len(sources)
        o = _Out(n.output[0], taken, made_shapes if made_shapes is not None else {})
        parts = [o.reshape(s, [1] + src[1:]) for s in sources]
        cat = o.name("concat")
        o.nodes.append(helper.make_node("Concat", parts, [cat], name=cat, axis=0))
        o.shapes[cat] = (len(sources),) + tuple(src[1:])
        _emit_composite(o, cat, o.shapes[cat], src, perm, result, n.output[0])
        drop.add(id(n))
        drop.update(id(v) for c in chains for v in c)
        insert[id(n)] = o.nodes
    return _splice(nodes, drop, insert)


def _common_length(chains: list[list], made: dict) -> int:
    """How many nodes, from the Concat back, every chain has alike (op, argument); 0 without a Transpose."""
    length, has_transpose = 0, False
    for step in zip(*chains):
        if len({(v.op_type, _view_arg(v, made)) for v in step}) != 1:
            break
        length += 1
        has_transpose |= step[0].op_type == "Transpose"
    return length if has_transpose else 0


def _splice(nodes: list, drop: set[int], insert: dict[int, list]) -> list:
    if not drop:
        return nodes
    out = []
    for n in nodes:
        out.extend(insert.get(id(n), []))
        if id(n) not in drop:
            out.append(n)
    return out


def compose_views(nodes: list[onnx.NodeProto], keep: set[str], shape) -> list[onnx.NodeProto]:
    """Each chain of view ops with two Transposes or more (intermediates read once, by the chain) as
    one Transpose between two Reshapes. ``shape(name)`` gives a chain's source shape (static)."""
    if sum(n.op_type == "Transpose" for n in nodes) < 2:
        return nodes
    made = {o: n for n in nodes for o in n.output if o}
    uses = Counter(i for n in nodes for i in node_inputs(n))
    readers: dict[str, list] = {}
    for n in nodes:
        for i in node_inputs(n):
            readers.setdefault(i, []).append(n)
    taken = set(made) | {n.name for n in nodes}
    drop: set[int] = set()
    insert: dict[int, list] = {}
    for n in nodes:
        if id(n) in drop or n.op_type != "Transpose" or _view_arg(n, made) is None:
            continue
        chain = list(reversed(_chain_back(n.output[0], made, uses, keep, limit=16)))
        tail = n.output[0]
        while uses.get(tail) == 1 and tail not in keep and len(chain) < 16:
            nxt = readers[tail][0]
            if _view_arg(nxt, made) is None or nxt.input[0] != tail:
                break
            chain.append(nxt)
            tail = nxt.output[0]
        if sum(v.op_type == "Transpose" for v in chain) < 2 or any(id(v) in drop for v in chain):
            continue
        src_shape = shape(chain[0].input[0])
        if src_shape is None or any(not isinstance(d, int) or d < 1 for d in src_shape):
            continue
        digits = _Digits(tuple(src_shape))
        if not all(digits.apply(v.op_type, _view_arg(v, made)) for v in chain):
            continue
        src, perm = _composite(digits)
        o = _Out(tail, taken, {})
        _emit_composite(o, chain[0].input[0], src_shape, src, perm, digits.shape(), tail)
        drop.update(id(v) for v in chain)
        insert[id(chain[-1])] = o.nodes
    return _splice(nodes, drop, insert)


def view_rewrites(nodes: list[onnx.NodeProto], keep: set[str], shape) -> list[onnx.NodeProto]:
    """``concat_views`` then ``compose_views`` (the Concat's new Transpose may meet the next chain's)."""
    made: dict[str, tuple] = {}
    nodes = concat_views(nodes, keep, shape, made)
    return compose_views(nodes, keep, lambda name: made.get(name) or shape(name))
