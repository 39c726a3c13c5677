"""Softmax family: Softmax and LogSoftmax (both reuse their output y); Hardmax has no gradient.

Before opset 13 both ops coerce x to 2-D at ``axis`` (default 1) and normalize over every dim from
``axis`` on; from 13 they normalize along the one ``axis`` (default -1).
"""
from __future__ import annotations

from onnx_autodiff.rule_api import GradBuilder, GradientRuleError, Grads, NodeView, gradient_rule, no_gradient

no_gradient("Hardmax", reason="output is a one-hot of the argmax: piecewise constant")


def _softmax_axes(g, node):
    """The axes a Softmax-family node normalizes over, non-negative where the rank is known."""
    x = node.inputs[0]
    rank = g.rank(x)
    if node.opset >= 13:
        axis = node.attr("axis", -1)
        return [axis % rank if rank is not None else axis]
    axis = node.attr("axis", 1)
    if rank is None:
        raise GradientRuleError(
            f"before opset 13 {node.op_type} normalizes over every dim from 'axis' on, which needs "
            f"the rank of {x!r}; annotate its shape or convert the model to opset 13 or newer"
        )
    axis = axis % rank if rank else 0
    return list(range(axis, rank))


@gradient_rule("Softmax")
def softmax_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """dx = y * (dy - sum(dy * y, axis))."""
    y = node.outputs[0]
    dz, = dy
    axes = _softmax_axes(g, node)
    return [g.Mul(y, g.Sub(dz, g.reduce_sum(g.Mul(dz, y), axes, keepdims=True)))]


@gradient_rule("LogSoftmax")
def log_softmax_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """dx = dy - exp(y) * sum(dy, axis)."""
    y = node.outputs[0]
    dz, = dy
    axes = _softmax_axes(g, node)
    return [g.Sub(dz, g.Mul(g.Exp(y), g.reduce_sum(dz, axes, keepdims=True)))]
