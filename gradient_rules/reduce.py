"""Reductions: the gradient spreads dy back over the reduced axes."""
from __future__ import annotations

import numpy as np

from onnx_autodiff.registry import gradient_rule

# opset where each reduction takes its axes as an input instead of an attribute
AXES_INPUT_SINCE = {"ReduceSum": 13}
_DEFAULT_AXES_INPUT_SINCE = 18


def reduce_axes(g, node):
    """(static axes normalized to x's rank | None for all, dynamic axes tensor | None)."""
    since = AXES_INPUT_SINCE.get(node.op_type, _DEFAULT_AXES_INPUT_SINCE)
    x = node.inputs[0]
    rank = g.rank(x)
    if node.opset >= since:
        name = node.input(1)
        if name is None:
            return None, None
        value = g.value(name)
        if value is None:
            return None, name
        axes = [int(a) for a in np.asarray(value).reshape(-1)]
        if not axes:
            return (None if not node.attr("noop_with_empty_axes", 0) else []), None
    else:
        axes = node.attr("axes")
        if axes is None:
            return None, None
    if any(a < 0 for a in axes) and rank is None:
        raise ValueError(f"{node}: negative axes need the input's rank; annotate the shape of {x!r}")
    return sorted(a % rank if a < 0 else a for a in axes), None


def spread(g, node, dy):
    """dy of a reduction broadcast back to the input's shape (the gradient of ReduceSum)."""
    x = node.inputs[0]
    axes, dynamic = reduce_axes(g, node)
    if axes == []:
        return dy
    if not node.attr("keepdims", 1):
        if dynamic is not None:
            dy = g.Unsqueeze(dy, dynamic)
        elif axes is not None:
            dy = g.unsqueeze(dy, axes)
    return g.Expand(dy, g.shape_of(x))


def reduced_count(g, node):
    """How many elements each output element of the reduction summed, as a scalar of x's type."""
    x, y = node.inputs[0], node.outputs[0]
    axes, dynamic = reduce_axes(g, node)
    xs = g.static_shape(x)
    if dynamic is None and xs is not None:
        n = int(np.prod([xs[a] for a in (range(len(xs)) if axes is None else axes)], dtype=np.int64))
        return g.const(float(n), like=x)
    return g.CastLike(g.Div(g.Size(x), g.Size(y)), x) if g.opset >= 15 else \
        g.Cast(g.Div(g.Size(x), g.Size(y)), to=g.dtype(x))


@gradient_rule("ReduceSum")
def reduce_sum_grad(g, node, dy):
    return [spread(g, node, dy[0])]


@gradient_rule("ReduceMean")
def reduce_mean_grad(g, node, dy):
    return [g.Div(spread(g, node, dy[0]), reduced_count(g, node))]
