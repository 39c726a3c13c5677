"""Softmax family: Softmax and LogSoftmax (both reuse their output y); Hardmax has no gradient.

Before opset 13 both ops coerce x to 2-D at ``axis`` (default 1) and normalize over every dim from
``axis`` on; from 13 they normalize along the one ``axis`` (default -1).
"""
from __future__ import annotations

from onnx_autodiff.rule_api import GradBuilder, GradientRuleError, Grads, NodeView, gradient_rule, jvp_rule, no_gradient

no_gradient("Hardmax", reason="output is a one-hot of the argmax: piecewise constant")


def _coerced_axes(g, node) -> list[int]:
    """Before opset 13 the Softmax family normalizes over every dim from ``axis`` (default 1) on."""
    x = node.inputs[0]
    rank = g.rank(x)
    if rank is None:
        raise GradientRuleError(
            f"before opset 13 {node.op_type} normalizes over every dim from 'axis' on, which needs "
            f"the rank of {x!r}; annotate its shape or convert the model to opset 13 or newer"
        )
    axis = node.attr("axis", 1) % rank if rank else 0
    return list(range(axis, rank))


def _axis(g, node) -> list[int]:
    """From opset 13 one axis (default -1), non-negative where the rank is known."""
    axis, rank = node.attr("axis", -1), g.rank(node.inputs[0])
    return [axis % rank if rank is not None else axis]


def _nan_guard(g, y: str) -> str | None:
    """The forward's ``IsNaN(y)`` when one reads y: exporters guard attention whose rows may be fully masked
    (a Softmax of all -inf is NaN) with ``Where(IsNaN(y), 0, y)``."""
    for c in g.consumers(y):
        if c.op_type == "IsNaN" and c.domain in ("", "ai.onnx"):
            return c.output[0]
    return None


def _softmax(g, y: str, dz: str, axes: list[int]) -> str:
    """dx = y * (dy - sum(dy * y, axis)). Under a NaN guard the NaN entries of y count as 0: the guard's Where
    gives them a zero dy and the output there does not depend on x, so their rows get a zero gradient instead
    of NaN (0 * NaN) spreading through the backward (left-padded batches)."""
    nan = _nan_guard(g, y)
    if nan is not None:
        y = g.Where(nan, g.const(0.0, like=y), y)
    return g.Mul(y, g.Sub(dz, g.reduce_sum(g.Mul(dz, y), axes, keepdims=True)))


def _log_softmax(g, y: str, dz: str, axes: list[int]) -> str:
    """dx = dy - exp(y) * sum(dy, axis)."""
    return g.Sub(dz, g.Mul(g.Exp(y), g.reduce_sum(dz, axes, keepdims=True)))


@gradient_rule("Softmax")
def softmax_coerced_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    return [_softmax(g, node.outputs[0], dy[0], _coerced_axes(g, node))]


@gradient_rule("Softmax", since=13)
def softmax_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    return [_softmax(g, node.outputs[0], dy[0], _axis(g, node))]


@gradient_rule("LogSoftmax")
def log_softmax_coerced_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    return [_log_softmax(g, node.outputs[0], dy[0], _coerced_axes(g, node))]


@gradient_rule("LogSoftmax", since=13)
def log_softmax_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    return [_log_softmax(g, node.outputs[0], dy[0], _axis(g, node))]


# ---- tangents: dy = y (dx - sum(y dx)) and dy = dx - sum(exp(y) dx) over the same axes ---------------
def _softmax_tangent(g, y: str, dx: str, axes: list[int]) -> str:
    return g.Mul(y, g.Sub(dx, g.reduce_sum(g.Mul(dx, y), axes, keepdims=True)))


def _log_softmax_tangent(g, y: str, dx: str, axes: list[int]) -> str:
    return g.Sub(dx, g.reduce_sum(g.Mul(g.Exp(y), dx), axes, keepdims=True))


@jvp_rule("Softmax")
def softmax_coerced_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    return [_softmax_tangent(g, node.outputs[0], dx[0], _coerced_axes(g, node))]


@jvp_rule("Softmax", since=13)
def softmax_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    return [_softmax_tangent(g, node.outputs[0], dx[0], _axis(g, node))]


@jvp_rule("LogSoftmax")
def log_softmax_coerced_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    return [_log_softmax_tangent(g, node.outputs[0], dx[0], _coerced_axes(g, node))]


@jvp_rule("LogSoftmax", since=13)
def log_softmax_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    return [_log_softmax_tangent(g, node.outputs[0], dx[0], _axis(g, node))]
