"""Unary elementwise ops. Most register only their derivative: dx = dy * f'(x)."""
from __future__ import annotations

from onnx_autodiff.registry import gradient_rule


def derivative(*op_types: str, since: int = 1):
    """Register ``fn(g, node, x, y) -> f'(x)`` (a tensor name); the rule multiplies it into dy."""

    def register(fn):
        def rule(g, node, dy):
            return [g.Mul(dy[0], fn(g, node, node.inputs[0], node.outputs[0]))]

        rule.__name__ = f"{fn.__name__}_grad"
        rule.__doc__ = fn.__doc__
        gradient_rule(*op_types, since=since)(rule)
        return fn

    return register


@gradient_rule("Identity")
def identity_grad(g, node, dy):
    return [dy[0]]


@gradient_rule("Neg")
def neg_grad(g, node, dy):
    return [g.Neg(dy[0])]


@derivative("Exp")
def exp_derivative(g, node, x, y):
    return y


@derivative("Relu")
def relu_derivative(g, node, x, y):
    return g.Cast(g.Greater(x, g.const(0.0, like=x)), to=g.dtype(x))
