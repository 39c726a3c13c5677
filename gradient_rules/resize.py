"""Resize and Upsample: linear in X and separable per axis, so the gradient contracts dy with the
transpose of each resized axis's interpolation matrix.

The matrix of an axis is the op itself (same mode, coordinate transform, rounding, cubic coefficient,
antialiasing) applied to an identity matrix with that axis's scale or size and scale 1 on the other
axis: ``Resize(eye(in))`` along axis 0 is ``A`` (out x in), along axis 1 it is ``A^T``. Whatever the
runtime does in the forward pass it also does here; the probe has only constant inputs, so runtimes
fold it at load time.
"""
from __future__ import annotations

import numpy as np

from onnx_autodiff.rule_api import GradBuilder, GradientRuleError, Grads, NodeView, gradient_rule, jvp_rule

# attributes copied onto the probe. Not axes (the probe is 2-D), keep_aspect_ratio_policy (refused with
# sizes, ignored with scales) or extrapolation_value: tf_crop_and_resize is affine in X, and the probe's
# default of 0 keeps only its linear part.
_PROBE_ATTRS = ("mode", "coordinate_transformation_mode", "nearest_mode", "cubic_coeff_a", "exclude_outside",
                "antialias")


class _Axis:
    """One axis the node may resize: its sizes and where its scale, size and roi come from."""

    def __init__(self, axis, size_in, size_out, scale=None, scale_at=None, roi=None, roi_at=None):
        self.axis = axis
        self.size_in = size_in
        self.size_out = size_out
        self.scale = scale  # the constant scale, None for the sizes form or a run-time scale
        self.scale_at = scale_at  # index into the scales input when it is known only at run time
        self.roi = roi  # constant (start, end) for tf_crop_and_resize
        self.roi_at = roi_at  # (start index, end index) into the roi input when it is run-time


def _resize_inputs(node):
    """(roi, scales, sizes) input names of the node, whatever its version (None when absent)."""
    if node.op_type == "Upsample" or node.opset < 11:
        return None, node.input(1), None
    return node.input(1), node.input(2), node.input(3)


def _axes(g, node, x, y) -> tuple[list[_Axis], bool]:
    """The axes the node may resize, and whether it resizes by sizes (else by scales)."""
    r = g.need_rank(x)
    xs, ys = g.shape(x), g.shape(y) or (None,) * r
    roi, scales, sizes = _resize_inputs(node)
    axes = [a % r for a in node.attr("axes", [])] or list(range(r))
    if node.op_type == "Upsample" and node.opset < 9:
        scale_values = list(node.attr("scales"))
    else:
        scale_values = None if scales is None else g.value(scales)
        if scale_values is not None:
            scale_values = [float(s) for s in np.asarray(scale_values, dtype=np.float32).reshape(-1)]
        if scales is not None and scale_values is None and g.shape(scales) == (0,):
            scale_values = []
    use_sizes = sizes is not None or scale_values == []
    if use_sizes and node.opset >= 18 and node.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        raise GradientRuleError("the gradient of Resize with sizes supports keep_aspect_ratio_policy 'stretch' only "
                    "(the other policies resize by a scale the graph does not state)")
    size_values = None if sizes is None else _size_entries(g, sizes, x)
    crop = node.attr("coordinate_transformation_mode", "half_pixel") == "tf_crop_and_resize" \
        and node.opset >= 11
    roi_values = g.value(roi) if crop else None
    out = []
    for k, a in enumerate(axes):
        ax = _Axis(a, xs[a], ys[a])
        if not use_sizes:
            if scale_values is not None:
                ax.scale = scale_values[k]
            else:
                ax.scale_at = k
        if crop:
            if roi_values is not None:
                flat = np.asarray(roi_values).reshape(-1)
                ax.roi = (float(flat[k]), float(flat[len(axes) + k]))
            else:
                ax.roi_at = (k, len(axes) + k)
        if size_values is not None and size_values[k] == ("dim", a):
            ax.size_out = ax.size_in  # sizes[k] is Shape(x)[a]: the axis keeps its length
        elif not isinstance(ax.size_out, int):
            if size_values is not None and isinstance(size_values[k], int):
                ax.size_out = size_values[k]
            elif isinstance(ax.size_in, int) and ax.scale is not None:
                ax.size_out = int(np.floor(np.float32(ax.scale) * np.float32(ax.size_in)))
        out.append(ax)
    return out, use_sizes


def _size_entries(g, sizes, x):
    """What each entry of the sizes input is, as far as the graph tells: an int, ``("dim", j)`` for
    ``Shape(x)[j]`` (how exporters keep the batch and channel dims), or None; None when even the
    length is unknown. Follows Constant, Concat, Cast, Unsqueeze and Slice / Gather of ``Shape(x)``."""
    value = g.value(sizes)
    if value is not None:
        return [int(v) for v in np.asarray(value).reshape(-1)]
    node = g.producer(sizes)
    if node is None:
        return None
    op = node.op_type
    if op == "Concat":
        parts = [_size_entries(g, p, x) for p in node.input]
        return None if any(p is None for p in parts) else [e for p in parts for e in p]
    if op in ("Cast", "Unsqueeze", "Identity"):
        return _size_entries(g, node.input[0], x)
    if op in ("Slice", "Gather") and _producer_op(g, node.input[0]) == "Shape":
        shape_node = g.producer(node.input[0])
        rank = g.rank(x)
        if shape_node.input[0] != x or rank is None or any(a.name in ("start", "end") for a in shape_node.attribute):
            return _unknown_entries(g, sizes)
        if op == "Gather":
            idx = g.value(node.input[1])
            return _unknown_entries(g, sizes) if idx is None else [("dim", int(i) % rank) for i in np.reshape(idx, -1)]
        attrs = {a.name: list(a.ints) for a in node.attribute}
        starts, ends, axes, steps = (attrs.get(k) for k in ("starts", "ends", "axes", "steps"))
        if node.input[1:]:
            starts, ends, axes, steps = (g.value(node.input[i]) if len(node.input) > i and node.input[i] else None
                                         for i in (1, 2, 3, 4))
            if starts is None or ends is None:
                return _unknown_entries(g, sizes)
        if (axes is not None and list(np.reshape(axes, -1)) not in ([0], [-1])) or \
                (steps is not None and list(np.reshape(steps, -1)) != [1]):
            return _unknown_entries(g, sizes)
        begin, end = int(np.reshape(starts, -1)[0]), int(np.reshape(ends, -1)[0])
        return [("dim", j) for j in range(rank)[begin:end]]
    return _unknown_entries(g, sizes)


def _producer_op(g, name):
    node = g.producer(name)
    return None if node is None else node.op_type


def _unknown_entries(g, name):
    s = g.shape(name)
    return [None] * s[0] if s is not None and len(s) == 1 and isinstance(s[0], int) else None


def _is_identity(ax: _Axis, use_sizes: bool) -> bool:
    """Whether the axis is provably left alone (scale 1, or the same size in and out with sizes)."""
    if ax.roi_at is not None or (ax.roi is not None and ax.roi != (0.0, 1.0)):
        return False
    if ax.scale is not None:
        return ax.scale == 1.0
    return use_sizes and ax.scale_at is None and ax.size_in == ax.size_out and ax.size_in is not None


def _probe(g, node, x, ax: _Axis, axis_first: bool) -> str:
    """The interpolation matrix of one axis: ``A`` (out x in) when ``axis_first``, else ``A^T``."""
    n_in, n_out = ax.size_in, ax.size_out
    eye = g.const(np.eye(n_in), like=x)

    def pair(value, fill):
        return [value, fill] if axis_first else [fill, value]

    attrs = {k: node.attr(k) for k in _PROBE_ATTRS if node.has_attr(k)}
    if node.op_type == "Upsample" and node.opset < 9:
        return g.Upsample(eye, scales=pair(float(ax.scale), 1.0), **attrs)

    scales = sizes = roi = None
    if ax.scale is not None:
        scales = g.const(pair(ax.scale, 1.0), dtype=np.float32)
    elif ax.scale_at is not None:
        picked = g.Gather(_resize_inputs(node)[1], g.ints([ax.scale_at]))
        one = g.const([1.0], dtype=np.float32)
        scales = g.Concat(*pair(picked, one), axis=0)
    else:
        sizes = g.ints(pair(n_out, n_in))
    if node.op_type == "Upsample" or node.opset < 11:
        return g.op(node.op_type, eye, scales, **attrs)

    roi_in = _resize_inputs(node)[0]
    if ax.roi is not None:
        start, end = ax.roi
        roi = g.const(pair(start, 0.0) + pair(end, 1.0), like=roi_in)
    elif ax.roi_at is not None:
        zero, one = g.const([0.0], like=roi_in), g.const([1.0], like=roi_in)
        start, end = (g.Gather(roi_in, g.ints([i])) for i in ax.roi_at)
        roi = g.Concat(*pair(start, zero), *pair(end, one), axis=0)
    if node.opset < 13:  # roi and scales are required inputs at opset 11
        roi = roi or g.const(np.zeros(0), dtype=np.float32)
        scales = scales or g.const(np.zeros(0), dtype=np.float32)
    return g.Resize(eye, roi, scales, sizes, **attrs)


def _shape_through(g, x, axis, size, rank):
    """The target shape ``[0] * axis + [size] + x's dims after axis`` (constant when those are static)."""
    head = [0] * axis + [size]
    tail = g.shape(x)[axis + 1:]
    if all(isinstance(d, int) for d in tail):
        return g.ints(head + list(tail))
    if g.opset >= 10:
        rest = g.Slice(g.Shape(x), g.ints([axis + 1]), g.ints([rank]))
    else:
        rest = g.Slice(g.Shape(x), starts=[axis + 1], ends=[rank])
    return g.Concat(g.ints(head), rest, axis=0)


@gradient_rule("Resize", "Upsample")
def resize_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """dx = dy contracted with each resized axis's interpolation matrix, last axis first; scales,
    sizes and roi get no gradient (the map is piecewise constant in them)."""
    dz, = dy
    x, y = node.inputs[0], node.outputs[0]
    if not node.needs_grad(0):
        return [None]
    mode = node.attr("mode", "nearest")
    if mode not in ("nearest", "linear", "cubic"):
        raise GradientRuleError(f"mode {mode!r} is not a Resize mode this rule knows")
    axes, use_sizes = _axes(g, node, x, y)
    resized = [ax for ax in axes if not _is_identity(ax, use_sizes)]
    for ax in resized:
        if not isinstance(ax.size_in, int) or not isinstance(ax.size_out, int):
            raise GradientRuleError(f"the gradient needs static input and output sizes along resized axis {ax.axis} of "
                        f"{x!r} (got {ax.size_in} -> {ax.size_out}); give the model fixed sizes there or "
                        "constant scales of 1 along the axes it does not resize")
    r = g.rank(x)
    dx = dz
    for ax in sorted(resized, key=lambda ax: -ax.axis):
        a = ax.axis
        if a == r - 1:
            dx = g.MatMul(dx, _probe(g, node, x, ax, axis_first=True))
        elif a == r - 2:
            dx = g.MatMul(_probe(g, node, x, ax, axis_first=False), dx)
        else:
            flat = g.Reshape(dx, g.ints([0] * a + [ax.size_out, -1]))
            dx = g.MatMul(_probe(g, node, x, ax, axis_first=False), flat)
            dx = g.Reshape(dx, _shape_through(g, x, a, ax.size_in, r))
    return [dx]


@jvp_rule("Resize", "Upsample")
def resize_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """Linear in x in every mode: the same resize of dx (outside the crop the value is the constant
    extrapolation_value, whose tangent is zero); scales, sizes and roi get none, as for the gradient."""
    if dx[0] is None:
        return [None]
    return [g.same_op(node, dx[0], *node.inputs[1:], extrapolation_value=None)]
