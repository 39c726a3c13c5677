"""LpNormalization and LRN (local response normalization across channels)."""
from __future__ import annotations

import numpy as np

from onnx_autodiff.rule_api import GradBuilder, GradientRuleError, Grads, NodeView, gradient_rule


def _reduce(g, op: str, x: str, axis: int) -> str:
    if g.opset >= 18:
        return g.op(op, x, g.ints([axis]), keepdims=1)
    return g.op(op, x, axes=[axis], keepdims=1)


@gradient_rule("LpNormalization")
def lp_normalization_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """y = x / n with n = ||x||_p along the axis: dx = (dy - s * sum(dy * y)) / n, where
    s = dn/dx = y for p = 2 and sign(x) for p = 1."""
    dz, = dy
    x, y = node.inputs[0], node.outputs[0]
    p = node.attr("p", 2)
    axis = node.attr("axis", -1)
    if p not in (1, 2):
        raise GradientRuleError(f"LpNormalization is defined for p = 1 or 2, got {p}")
    n = _reduce(g, "ReduceL2" if p == 2 else "ReduceL1", x, axis)
    dot = g.reduce_sum(g.Mul(dz, y), [axis % g.rank(x)] if g.rank(x) is not None else [axis], keepdims=True)
    s = y if p == 2 else g.sign(x)
    return [g.Div(g.Sub(dz, g.Mul(s, dot)), n)]


def _band(c: int, size: int) -> np.ndarray:
    """A[c', c] = 1 when channel c' is in channel c's window [c - floor((size-1)/2), c + ceil((size-1)/2)]."""
    lo, hi = (size - 1) // 2, (size - 1) - (size - 1) // 2
    idx = np.arange(c)
    return ((idx[:, None] >= idx[None, :] - lo) & (idx[:, None] <= idx[None, :] + hi)).astype(np.float64)


@gradient_rule("LRN")
def lrn_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """y = x * s^-beta, s = bias + alpha/size * S, S = window sum of x^2 over channels (x^2 @ A).

    dx = dy * s^-beta - 2 beta alpha/size * x * ((dy * x * s^(-beta-1)) @ A^T). The channel
    count must be static (A is a constant band matrix)."""
    dz, = dy
    x = node.inputs[0]
    shape = g.shape(x)
    if shape is None or not isinstance(shape[1], int):
        raise GradientRuleError(f"the LRN gradient needs the static channel count of {x!r}")
    r, c = len(shape), shape[1]
    size = node.attr("size")
    alpha, beta, bias = node.attr("alpha", 1e-4), node.attr("beta", 0.75), node.attr("bias", 1.0)
    to_last = [0] + list(range(2, r)) + [1]
    back = [0, r - 1] + list(range(1, r - 1))
    a = _band(c, size).astype(g.np_dtype(x))

    def window_sum(t, m):
        return g.Transpose(g.MatMul(g.Transpose(t, perm=to_last), g.const(m)), perm=back)

    s = g.Add(g.const(bias, like=x), g.Mul(g.const(alpha / size, like=x), window_sum(g.Mul(x, x), a)))
    s_beta = g.Pow(s, g.const(-beta, like=x))
    inner = g.Mul(g.Mul(dz, x), g.Div(s_beta, s))
    spread = window_sum(inner, np.ascontiguousarray(a.T))
    return [g.Sub(g.Mul(dz, s_beta), g.Mul(g.const(2.0 * beta * alpha / size, like=x), g.Mul(x, spread)))]
