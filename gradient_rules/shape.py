"""Shape and data-movement ops: the gradient moves dy back to where each element came from; the tangent
moves dx the way the values move (every op here is linear in its float inputs)."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper

from onnx_autodiff.rule_api import GradBuilder, GradientRuleError, Grads, NodeView, gradient_rule, jvp_rule

_HALF = (TensorProto.FLOAT16, TensorProto.BFLOAT16)

INT64_MAX = np.iinfo(np.int64).max


# ---- helpers -------------------------------------------------------------------------------------
def inverse_perm(perm):
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def move_axis_last(g, x, axis, rank):
    """(x with ``axis`` moved last, perm to undo it) — no node when it is already last."""
    if axis == rank - 1:
        return x, None
    perm = [k for k in range(rank) if k != axis] + [axis]
    return g.Transpose(x, perm=perm), inverse_perm(perm)


def normalized_indices(g, idx, dim):
    """Indices with negative values wrapped (for ops older than their negative-index support)."""
    v = g.value(idx)
    if v is not None and (np.asarray(v) >= 0).all():
        return idx
    dim_t = g.Cast(dim, to=g.dtype(idx)) if g.dtype(idx) is not None else dim
    return g.where(g.Less(idx, g.const(0, like=idx)), g.Add(idx, dim_t), idx)


# ---- pure reshapes and permutations --------------------------------------------------------------
@gradient_rule("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def reshape_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """The element order is unchanged: reshape dy back to the input's shape."""
    return [g.reshape_like(dy[0], node.inputs[0])]


@gradient_rule("Transpose")
def transpose_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    perm = node.attr("perm")
    if perm is None:  # reversing the axes is its own inverse
        return [g.Transpose(dy[0])]
    return [g.Transpose(dy[0], perm=inverse_perm(list(perm)))]


@gradient_rule("DepthToSpace")
def depth_to_space_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    x = node.inputs[0]
    b = int(node.attr("blocksize"))
    mode = node.attr("mode", "DCR")
    if mode == "DCR":
        return [g.SpaceToDepth(dy[0], blocksize=b)]
    # CRD: y = reshape(transpose(reshape(x, [N, C', b, b, H, W]), [0, 1, 4, 2, 5, 3]), [N, C', H*b, W*b])
    target = g.Concat(g.ints([0, 0]), g.dim(x, 2), g.ints([b]), g.dim(x, 3), g.ints([b]), axis=0)
    t = g.Transpose(g.Reshape(dy[0], target), perm=[0, 1, 3, 5, 2, 4])
    return [g.reshape_like(t, x)]


@gradient_rule("SpaceToDepth")
def space_to_depth_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """SpaceToDepth is the inverse of DepthToSpace in DCR mode."""
    b = int(node.attr("blocksize"))
    return [g.DepthToSpace(dy[0], blocksize=b)]


# ---- joins and splits ----------------------------------------------------------------------------
@gradient_rule("Concat")
def concat_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Split dy along the axis into the inputs' sizes."""
    axis = int(node.attr("axis"))
    xs = node.inputs
    if len(xs) == 1:
        return [dy[0]]
    shapes = [g.shape(x) for x in xs]
    sizes = [None if s is None else s[axis] for s in shapes]
    if all(isinstance(s, int) for s in sizes):
        parts = g.split(dy[0], axis, sizes)
    else:
        g.require(13, "the Concat gradient for sizes along the axis known only at run time")
        sizes_t = g.Concat(*[g.dim(x, axis) for x in xs], axis=0)
        parts = list(g.op("Split", dy[0], sizes_t, outputs=len(xs), axis=axis))
    return [p if node.needs_grad(i) else None for i, p in enumerate(parts)]


@gradient_rule("Split")
def split_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Concat the output gradients; an output nobody differentiated contributes zeros."""
    axis = int(node.attr("axis", 0))
    parts = [d if d is not None else g.zeros_like(y) for d, y in zip(dy, node.outputs)]
    return [parts[0] if len(parts) == 1 else g.Concat(*parts, axis=axis)]


# ---- broadcasting and repetition -----------------------------------------------------------------
@gradient_rule("Expand")
def expand_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    return [g.unbroadcast(dy[0], node.inputs[0], node.outputs[0])]


@gradient_rule("Tile")
def tile_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Reshape dy to (r0, d0, r1, d1, ...) and sum over the repeat axes."""
    x, repeats = node.inputs[:2]
    r = g.need_rank(x)
    if r == 0:
        return [dy[0]]
    reps = g.int_values(repeats)
    xs = g.static_shape(x)
    if reps is not None and xs is not None:
        target = g.ints([v for pair in zip(reps, xs) for v in pair])
    else:
        pairs = g.Concat(g.unsqueeze(repeats, [1]), g.unsqueeze(g.Shape(x), [1]), axis=1)
        target = g.Reshape(pairs, g.ints([-1]))
    return [g.reduce_sum(g.Reshape(dy[0], target), list(range(0, 2 * r, 2)), keepdims=False)]


def slice_axis(g, x, axis, start, end):
    """x[start:end] along one axis (static bounds; attribute form below opset 10)."""
    return g.slice(x, [start], [end], [axis])


def _fold_border(g, node, dy, axis, n, p0, p1, mode, rank):
    """The gradient along one axis padded in edge, reflect or wrap mode: the middle of dy plus each
    border block added back onto the elements it copies."""
    if p0 < 0 or p1 < 0:
        raise GradientRuleError(f"the Pad gradient in mode {mode!r} needs non-negative pads")
    if mode == "reflect" and max(p0, p1) > n - 1 or mode == "wrap" and max(p0, p1) > n:
        raise GradientRuleError(f"the Pad gradient in mode {mode!r} needs pads no larger than the padded axis allows")
    parts = [slice_axis(g, dy, axis, p0, p0 + n)]
    blocks = []  # (block of dy, offset in x, length, reversed?)
    for size, start, edge_at, reflect_at, wrap_at in ((p0, 0, 0, 1, n - p0),
                                                      (p1, p0 + n, n - 1, n - 1 - p1, 0)):
        if not size:
            continue
        block = slice_axis(g, dy, axis, start, start + size)
        if mode == "edge":
            blocks.append((g.reduce_sum(block, [axis], keepdims=True), edge_at, 1, False))
        else:
            blocks.append((block, reflect_at if mode == "reflect" else wrap_at, size, mode == "reflect"))
    for block, offset, length, flip in blocks:
        if flip:
            block = g.Gather(block, g.ints(list(range(length - 1, -1, -1))), axis=axis)
        pads = [0] * (2 * rank)
        pads[axis], pads[rank + axis] = offset, n - offset - length
        parts.append(g.pad(block, pads))
    return parts[0] if len(parts) == 1 else g.Sum(*parts)


def _pad_fold(g, node, dz: str, mode: str, pads: list[int] | None, axes: list[int] | None) -> str:
    """Edge, reflect and wrap modes: each border block folded back onto the elements it copied, one
    axis at a time (``pads`` and ``axes`` None when not constant)."""
    x = node.inputs[0]
    rank = g.need_rank(x)
    xs = g.shape(x)
    if pads is None or axes is None or xs is None:
        raise GradientRuleError(f"the Pad gradient in mode {mode!r} needs constant pads and axes and x's rank")
    dx = dz
    for k, a in enumerate(a % rank for a in axes):
        p0, p1 = pads[k], pads[len(axes) + k]
        if not (p0 or p1):
            continue
        if not isinstance(xs[a], int):
            raise GradientRuleError(f"the Pad gradient in mode {mode!r} needs the size of padded axis {a} to be "
                                    "static")
        dx = _fold_border(g, node, dx, a, xs[a], p0, p1, mode, rank)
    return dx


@gradient_rule("Pad")
def pad_attrs_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Opsets 1 to 10: pads and value are attributes. Constant mode: Pad with the negated pads
    (positive pads crop, negative ones put zeros back)."""
    mode = node.attr("mode", "constant")
    pads = list(node.attr("pads"))
    if mode != "constant":
        return [_pad_fold(g, node, dy[0], mode, pads, list(range(g.need_rank(node.inputs[0]))))]
    return [g.Pad(dy[0], pads=[-p for p in pads])]


@gradient_rule("Pad", since=11)
def pad_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Opset 11 on: pads, the constant value and (from 18) axes are inputs. Constant mode: Pad with the
    negated pads, and the padding value gets the sum of dy over the border."""
    mode = node.attr("mode", "constant")
    pads, axes = node.inputs[1], node.input(3)
    static = g.int_values(pads)
    if mode != "constant":
        every = list(range(g.need_rank(node.inputs[0])))
        return [_pad_fold(g, node, dy[0], mode, static, every if axes is None else g.int_values(axes))]
    neg = g.ints([-p for p in static]) if static is not None else g.Neg(pads)
    dx = g.Pad(dy[0], neg, None, axes) if axes else g.Pad(dy[0], neg)
    grads = [dx if node.needs_grad(0) else None, None]
    value = node.input(2)
    if value is not None and node.needs_grad(2):
        border = g.Sub(g.reduce_sum(dy[0], None, keepdims=False), g.reduce_sum(dx, None, keepdims=False))
        grads.append(g.reshape_like(border, value))
    return grads


# ---- slicing -------------------------------------------------------------------------------------
def _slice_params(g, node):
    """(starts, ends, axes, steps) as lists of ints (None where not constant), from the inputs (opset 10 on)."""
    starts, ends = g.int_values(node.inputs[1]), g.int_values(node.inputs[2])
    axes = g.int_values(node.input(3)) if node.input(3) else (list(range(len(starts))) if starts else None)
    steps = g.int_values(node.input(4)) if node.input(4) else ([1] * len(starts) if starts else None)
    return starts, ends, axes, steps


def coordinate_grid(g, x, rank):
    """int64 tensor of shape x.shape + [rank] holding each element's coordinates."""
    shape = g.shape_of(x)
    full = g.Concat(shape, g.ints([1]), axis=0)
    zero, one = g.const(np.int64(0)), g.const(np.int64(1))
    cols = []
    for i in range(rank):
        n = g.squeeze(g.dim(x, i), [0])
        coord = g.Reshape(g.Range(zero, n, one), g.ints([-1 if k == i else 1 for k in range(rank)] + [1]))
        cols.append(g.Expand(coord, full))
    return g.Concat(*cols, axis=-1)


def _slice_as_pad(g, x: str, dz: str, rank: int, starts, ends, axes, steps) -> str | None:
    """dz padded back to x's shape when every slice is a contiguous ascending range of known extent
    (zeros when a slice is empty); None when the bounds or x's shape are not static, or a slice is strided."""
    xs = g.static_shape(x)
    if xs is None or None in (starts, ends, axes, steps):
        return None
    before, after = [0] * rank, [0] * rank
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = a % rank
        picked = range(xs[a])[slice(s, e, st)]
        if len(picked) == 0:
            return g.zeros_like(x)
        lo, hi = min(picked), max(picked)
        if hi - lo + 1 != len(picked) or (st < 0 and len(picked) > 1):
            return None
        before[a], after[a] = lo, xs[a] - 1 - hi
    return g.pad(dz, before + after)


@gradient_rule("Slice")
def slice_attrs_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Opsets 1 to 9: starts, ends and axes are attributes (unit steps): dy padded back to x's shape."""
    x = node.inputs[0]
    rank = g.need_rank(x)
    starts, ends = list(node.attr("starts")), list(node.attr("ends"))
    axes = node.attr("axes")
    axes = list(axes) if axes is not None else list(range(len(starts)))
    dx = _slice_as_pad(g, x, dy[0], rank, starts, ends, axes, [1] * len(starts))
    if dx is None:
        g.needs_opset(11, "the Slice gradient for shapes known only at run time")
    return [dx]


@gradient_rule("Slice", since=10)
def slice_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Put dy back where Slice took it from: Pad when every slice is a contiguous ascending range of
    known extent, otherwise ScatterND at the coordinates Slice picks out of a coordinate grid of x."""
    x = node.inputs[0]
    rank = g.need_rank(x)
    starts, ends, axes, steps = _slice_params(g, node)
    dx = _slice_as_pad(g, x, dy[0], rank, starts, ends, axes, steps)
    if dx is not None:
        return [dx]
    g.require(11, "the Slice gradient for run-time bounds, steps or shapes")
    grid = coordinate_grid(g, x, rank)
    ax = node.input(3)
    if ax is not None:  # the grid has one more axis than x: negative axes must count from x's end
        ax = g.ints([a % rank for a in axes]) if axes is not None else \
            g.Where(g.Less(ax, g.const(0, like=ax)), g.Add(ax, g.const(rank, like=ax)), ax)
    picked = g.Slice(grid, node.inputs[1], node.inputs[2], ax, node.input(4))
    return [g.ScatterND(g.zeros_like(x), picked, dy[0])]


# ---- gathers -------------------------------------------------------------------------------------
def _gather_block_grad(g, x, idx, dz, axis, xs):
    """dy padded with zeros back to x's shape when the indices are a constant block ``a, a+1, ..., b-1``
    (a scalar index included: the q/k/v picks of an attention layer, a CLS token): a copy, where the
    scatter-add costs a zero fill, an index tensor as large as dy and a slow element-wise scatter.
    None when it does not apply (indices not constant, not such a block, or the axis not static)."""
    value = g.value(idx)
    if value is None or xs is None or not isinstance(xs[axis], int) or np.asarray(value).ndim > 1:
        return None
    n = xs[axis]
    flat = np.asarray(value).reshape(-1)
    if flat.size == 0 or np.any(flat < -n) or np.any(flat >= n):
        return None
    flat = flat % n
    if np.any(np.diff(flat) != 1):
        return None
    block = g.unsqueeze(dz, [axis]) if np.asarray(value).ndim == 0 else dz
    r = len(xs)
    begins, ends = [0] * r, [0] * r
    begins[axis], ends[axis] = int(flat[0]), int(n - 1 - flat[-1])
    padded = g.pad(block, begins + ends)
    g.declare(padded, g.dtype(x), tuple(xs))  # the length along axis lets a Sum of blocks be a Concat
    return padded


def _gather_spots(g, node, dy):
    """(the gradient as a Pad of dy when the indices are a constant block, else None; dy reshaped to x's
    shape with the gathered positions along the axis; the axis; x's rank)."""
    x, idx = node.inputs[:2]
    r = g.need_rank(x)
    axis = int(node.attr("axis", 0)) % r
    xs = g.shape(x)
    padded = _gather_block_grad(g, x, idx, dy[0], axis, xs)
    if padded is not None:
        return padded, None, axis, r
    tail = list(xs[axis + 1:]) if xs is not None else None
    if tail is not None and all(isinstance(d, int) for d in tail):
        target = g.ints([0] * axis + [-1] + tail)
    else:
        g.require(10, "the Gather gradient for dims after the axis known only at run time")
        target = g.Concat(g.ints([0] * axis + [-1]), g.Slice(g.Shape(x), g.ints([axis + 1]), g.ints([r])), axis=0)
    return None, g.Reshape(dy[0], target), axis, r


@gradient_rule("Gather")
def gather_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """dy added back along the axis by a one-hot MatMul (before opset 16: no ScatterElements with
    reduction='add'); a Pad when the indices are a constant block."""
    padded, dy_r, axis, r = _gather_spots(g, node, dy)
    if padded is not None:
        return [padded]
    x, idx = node.inputs[:2]
    depth = g.dim(x, axis)
    flat = g.Reshape(normalized_indices(g, idx, depth), g.ints([-1]))
    hot = g.one_hot(flat, depth, x)  # (n, dim)
    moved, back = move_axis_last(g, dy_r, axis, r)
    out = g.MatMul(moved, hot)
    return [out if back is None else g.Transpose(out, perm=back)]


@gradient_rule("Gather", since=16)
def gather_scatter_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Scatter-add dy back along the axis (ScatterElements with reduction='add'); a Pad when the indices
    are a constant block."""
    padded, dy_r, axis, r = _gather_spots(g, node, dy)
    if padded is not None:
        return [padded]
    x, idx = node.inputs[:2]
    spots = g.Expand(g.Reshape(idx, g.ints([1] * axis + [-1] + [1] * (r - axis - 1))), g.Shape(dy_r))
    if g.dtype(x) in _HALF:  # repeated indices summed in float32 (and onnxruntime's CPU scatter-add has no half)
        dy32 = g.Cast(dy_r, to=TensorProto.FLOAT)
        zeros = g.ConstantOfShape(g.Shape(x), value=numpy_helper.from_array(np.zeros(1, np.float32)))
        summed = g.ScatterElements(zeros, spots, dy32, axis=axis, reduction="add")
        return [g.Cast(summed, to=g.dtype(x))]
    return [g.ScatterElements(g.zeros_like(x), spots, dy_r, axis=axis, reduction="add")]


@gradient_rule("GatherElements")
def gather_elements_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Before opset 16: a one-hot along a new axis, summed (indices shaped like x off the axis)."""
    x, idx = node.inputs[:2]
    r = g.need_rank(x)
    axis = int(node.attr("axis", 0)) % r
    xs, isz = g.shape(x), g.shape(idx)
    if xs is None or isz is None or any(a != b for k, (a, b) in enumerate(zip(xs, isz)) if k != axis):
        g.needs_opset(16, "the GatherElements gradient for indices not shaped like x off the axis (or shapes "
                          "known only at run time)")
    hot = g.one_hot(idx, g.dim(x, axis), x, axis=axis + 1)
    spread = g.Mul(hot, g.unsqueeze(dy[0], [axis + 1]))
    return [g.reduce_sum(spread, [axis], keepdims=False)]


@gradient_rule("GatherElements", since=16)
def gather_elements_scatter_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """ScatterElements(reduction='add')."""
    x, idx = node.inputs[:2]
    axis = int(node.attr("axis", 0)) % g.need_rank(x)
    return [g.ScatterElements(g.zeros_like(x), idx, dy[0], axis=axis, reduction="add")]


def _batch_dims_zero(node):
    if int(node.attr("batch_dims", 0)) != 0:
        raise GradientRuleError("the GatherND gradient handles batch_dims=0 only")


@gradient_rule("GatherND")
def gather_nd_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Before opset 16 (no ScatterND with reduction='add'): a plain ScatterND when the indices are
    constant and never repeat."""
    x, idx = node.inputs[:2]
    _batch_dims_zero(node)
    v = g.value(idx)
    xs = g.static_shape(x)
    if v is not None and xs is not None:
        v = np.asarray(v)
        k = v.shape[-1]
        flat = np.ravel_multi_index(tuple(np.moveaxis(v % np.array(xs[:k]), -1, 0)), xs[:k]).reshape(-1)
        if len(set(flat.tolist())) == flat.size:  # no index repeats: a plain scatter is exact
            return [g.ScatterND(g.zeros_like(x), idx, dy[0])]
    g.needs_opset(16, "the GatherND gradient for run-time or repeated indices (ScatterND with reduction='add')")


@gradient_rule("GatherND", since=16)
def gather_nd_scatter_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """ScatterND(reduction='add')."""
    x, idx = node.inputs[:2]
    _batch_dims_zero(node)
    return [g.ScatterND(g.zeros_like(x), idx, dy[0], reduction="add")]


# ---- scatters ------------------------------------------------------------------------------------
def _reduction(node):
    r = node.attr("reduction", "none")
    if r not in ("none", "add"):
        raise GradientRuleError(f"the {node.op_type} gradient handles reduction 'none' and 'add', not {r!r}")
    return r


@gradient_rule("ScatterElements")
def scatter_elements_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """data's gradient is dy where nothing was written over it; updates get dy at their targets."""
    data, idx, upd = node.inputs[:3]
    axis = int(node.attr("axis", 0))
    reduction = _reduction(node)
    dd = du = None
    if node.needs_grad(0):
        dd = dy[0] if reduction == "add" else g.ScatterElements(dy[0], idx, g.zeros_like(upd), axis=axis)
    if node.needs_grad(2):
        du = g.GatherElements(dy[0], idx, axis=axis)
    return [dd, None, du]


@gradient_rule("ScatterND")
def scatter_nd_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    data, idx, upd = node.inputs[:3]
    reduction = _reduction(node)
    dd = du = None
    if node.needs_grad(0):
        dd = dy[0] if reduction == "add" else g.ScatterND(dy[0], idx, g.zeros_like(upd))
    if node.needs_grad(2):
        du = g.GatherND(dy[0], idx)
    return [dd, None, du]


# ---- masks and scans -----------------------------------------------------------------------------
@gradient_rule("Trilu")
def trilu_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Trilu keeps a triangle and zeroes the rest: the same mask applies to dy."""
    k = [node.input(1)] if node.input(1) else []
    return [g.Trilu(dy[0], *k, upper=node.attr("upper", 1))]


@gradient_rule("CumSum")
def cumsum_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Each x_i feeds every later (earlier, when reversed) y_j: a cumulative sum the other way."""
    return [g.CumSum(dy[0], node.inputs[1], exclusive=node.attr("exclusive", 0) or None,
                     reverse=1 - int(node.attr("reverse", 0)) or None)]


# ---- tangents (forward mode) -----------------------------------------------------------------------
@jvp_rule("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "DepthToSpace", "SpaceToDepth", "Expand",
          "Tile", "Slice", "Gather", "GatherElements", "GatherND", "Trilu", "CumSum")
def move_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """The same op on dx (its other inputs are shapes, indices or axes)."""
    return [g.same_op(node, dx[0], *node.inputs[1:])]


@jvp_rule("Split")
def split_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    parts = g.same_op(node, dx[0], *node.inputs[1:], outputs=len(node.outputs))
    return list(parts) if isinstance(parts, tuple) else [parts]


@jvp_rule("Concat")
def concat_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """Concat of the tangents, zeros for an input without one."""
    if len(node.inputs) == 1:
        return [dx[0]]
    return [g.same_op(node, *[d if d else g.zeros_like(x) for d, x in zip(dx, node.inputs)])]


@jvp_rule("Pad")
def pad_attrs_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """Opsets 1 to 10: the constant value is an attribute (its tangent zero)."""
    return [g.same_op(node, dx[0], value=None)]


@jvp_rule("Pad", since=11)
def pad_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """The same padding of dx; in constant mode the border takes the constant's tangent."""
    x = node.inputs[0]
    d = dx[0] or g.zeros_like(x)
    dvalue = dx[2] if len(dx) > 2 and node.attr("mode", "constant") == "constant" else None
    if dx[0] is None and dvalue is None:
        return [None]
    return [g.same_op(node, d, node.inputs[1], dvalue or "", *node.inputs[3:4])]


@jvp_rule("ScatterElements", "ScatterND")
def scatter_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """The same scatter of the tangents (reduction 'none' or 'add', as the gradient)."""
    _reduction(node)
    data, idx, upd = node.inputs[:3]
    dd, du = dx[0], dx[2] if len(dx) > 2 else None
    return [g.same_op(node, dd or g.zeros_like(data), idx, du or g.zeros_like(upd))]
