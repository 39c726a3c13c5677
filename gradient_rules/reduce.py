"""Reductions: the gradient spreads dy back over the reduced axes; the tangent reduces a product of dx
with the local derivative over the same axes."""
from __future__ import annotations

import numpy as np

from onnx_autodiff.rule_api import GradBuilder, GradientRuleError, Grads, NodeView, gradient_rule, jvp_rule

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
        if name is None:  # no axes input is empty axes: all of them, or none under noop_with_empty_axes
            return (None if not node.attr("noop_with_empty_axes", 0) else []), None
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
        raise GradientRuleError(f"negative axes need the input's rank; annotate the shape of {x!r}")
    return sorted(a % rank if a < 0 else a for a in axes), None


def spread(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
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
    return g.expand_like(dy, x)


def reduced_count(g, node):
    """How many elements each output element of the reduction summed, as a scalar of x's type."""
    x, y = node.inputs[0], node.outputs[0]
    axes, dynamic = reduce_axes(g, node)
    xs = g.static_shape(x)
    if dynamic is None and xs is not None:
        n = int(np.prod([xs[a] for a in (range(len(xs)) if axes is None else axes)], dtype=np.int64))
        return g.const(float(n), like=x)
    return g.count(x, y)


@gradient_rule("ReduceSum")
def reduce_sum_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    return [spread(g, node, dy[0])]


@gradient_rule("ReduceMean")
def reduce_mean_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """dy / count, divided while dy has the reduced size and then spread: the Expand is the one full-size pass
    (dividing after it was a second one). A mean over no axis (``noop_with_empty_axes``) passes dy through."""
    if reduce_axes(g, node)[0] == []:
        return [dy[0]]
    return [spread(g, node, g.Div(dy[0], reduced_count(g, node)))]


def reduce_keepdims(g, node, x):
    """ReduceSum of x over the node's axes, keeping them (x shaped like the node's input)."""
    axes, dynamic = reduce_axes(g, node)
    if dynamic is not None:
        return g.ReduceSum(x, dynamic, keepdims=1)
    return g.reduce_sum(x, axes, keepdims=True)


@gradient_rule("ReduceMax", "ReduceMin")
def reduce_extremum_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """dy goes to the positions that attain the extremum; ties share it equally."""
    x, y = node.inputs[0], node.outputs[0]
    if reduce_axes(g, node)[0] == []:
        return [dy[0]]
    yb = spread(g, node, y)
    # x <= max everywhere, so "not less than the max" marks the maxima (Equal takes floats only from 11)
    hit = g.Not(g.Less(x, yb) if node.op_type == "ReduceMax" else g.Greater(x, yb))
    mask = g.Cast(hit, to=g.dtype(x))
    share = g.Div(mask, reduce_keepdims(g, node, mask))
    return [g.Mul(spread(g, node, dy[0]), share)]


@gradient_rule("ReduceProd")
def reduce_prod_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """dx = dy * y / x (undefined where x is zero)."""
    x, y = node.inputs[0], node.outputs[0]
    return [g.Div(spread(g, node, g.Mul(dy[0], y)), x)]


@gradient_rule("ReduceL1")
def reduce_l1_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    x = node.inputs[0]
    return [g.Mul(spread(g, node, dy[0]), g.sign(x))]


@gradient_rule("ReduceL2")
def reduce_l2_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """dx = dy * x / y (undefined where y is zero)."""
    x, y = node.inputs[0], node.outputs[0]
    return [g.Mul(spread(g, node, g.Div(dy[0], y)), x)]


@gradient_rule("ReduceLogSum")
def reduce_log_sum_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """y = log(sum x): dx = dy / exp(y)."""
    y = node.outputs[0]
    return [spread(g, node, g.Div(dy[0], g.Exp(y)))]


@gradient_rule("ReduceLogSumExp")
def reduce_log_sum_exp_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """dx = dy * exp(x - y): the softmax of x over the reduced axes."""
    x, y = node.inputs[0], node.outputs[0]
    return [g.Mul(spread(g, node, dy[0]), g.Exp(g.Sub(x, spread(g, node, y))))]


@gradient_rule("ReduceSumSquare")
def reduce_sum_square_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    x = node.inputs[0]
    return [g.Mul(spread(g, node, dy[0]), g.Add(x, x))]


# ---- tangents (forward mode) -----------------------------------------------------------------------
def reduced(g, node, t: str) -> str:
    """ReduceSum of t (shaped like the node's input) over the node's axes, keepdims as the node."""
    axes, dynamic = reduce_axes(g, node)
    if axes == []:
        return t
    keep = int(node.attr("keepdims", 1))
    if dynamic is not None:
        return g.ReduceSum(t, dynamic, keepdims=keep)
    return g.reduce_sum(t, axes, keepdims=bool(keep))


@jvp_rule("ReduceSum", "ReduceMean")
def reduce_linear_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """Linear: the same reduction of dx."""
    return [g.same_op(node, dx[0], *node.inputs[1:])]


@jvp_rule("ReduceMax", "ReduceMin")
def reduce_extremum_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """The tangent at the positions attaining the extremum, averaged over ties (the gradient's split)."""
    x, y = node.inputs[0], node.outputs[0]
    if reduce_axes(g, node)[0] == []:
        return [dx[0]]
    yb = spread(g, node, y)
    hit = g.Not(g.Less(x, yb) if node.op_type == "ReduceMax" else g.Greater(x, yb))
    mask = g.Cast(hit, to=g.dtype(x))
    return [g.Div(reduced(g, node, g.Mul(dx[0], mask)), reduced(g, node, mask))]


@jvp_rule("ReduceProd")
def reduce_prod_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """dy = y * sum(dx / x) (undefined where x is zero)."""
    x, y = node.inputs[0], node.outputs[0]
    return [g.Mul(y, reduced(g, node, g.Div(dx[0], x)))]


@jvp_rule("ReduceL1")
def reduce_l1_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    return [reduced(g, node, g.Mul(dx[0], g.sign(node.inputs[0])))]


@jvp_rule("ReduceL2")
def reduce_l2_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """dy = sum(x dx) / y."""
    x, y = node.inputs[0], node.outputs[0]
    return [g.Div(reduced(g, node, g.Mul(dx[0], x)), y)]


@jvp_rule("ReduceLogSum")
def reduce_log_sum_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """dy = sum(dx) / exp(y)."""
    return [g.Div(reduced(g, node, dx[0]), g.Exp(node.outputs[0]))]


@jvp_rule("ReduceLogSumExp")
def reduce_log_sum_exp_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """dy = sum(dx exp(x - y))."""
    x, y = node.inputs[0], node.outputs[0]
    return [reduced(g, node, g.Mul(dx[0], g.Exp(g.Sub(x, spread(g, node, y)))))]


@jvp_rule("ReduceSumSquare")
def reduce_sum_square_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    x = node.inputs[0]
    return [reduced(g, node, g.Mul(dx[0], g.Add(x, x)))]
