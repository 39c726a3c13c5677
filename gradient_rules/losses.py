"""Classification losses: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.

Both pick one log-probability per target, ``loss[n, d...] = -w[t] * lp[n, t, d...]`` with
``t = target[n, d...]`` (targets equal to ``ignore_index`` weigh 0), then reduce: 'none', 'sum', or
'mean' = sum / (sum of the weights of the kept targets). The gradient w.r.t. the log-probabilities is
the weighted one-hot of the targets times the scaled loss gradient; the targets get none.
"""
from __future__ import annotations

import numpy as np
import onnx

from onnx_autodiff.rule_api import GradBuilder, GradientRuleError, Grads, NodeView, gradient_rule


def _reduction(node) -> str:
    return node.attr("reduction", "mean")


def _classes(g, x: str, rank: int) -> str:
    """0..C-1 (C = size of axis 1 of x) shaped (C, 1, ...) to meet targets unsqueezed at axis 1."""
    shape = g.shape(x)
    trail = [1] * (rank - 2)
    if isinstance(shape[1], int):
        return g.const(np.arange(shape[1], dtype=np.int64).reshape([shape[1]] + trail))
    count = g.Gather(g.Shape(x), g.const(1, dtype=np.int64), axis=0)
    classes = g.Range(g.const(0, dtype=np.int64), count, g.const(1, dtype=np.int64))
    return g.unsqueeze(classes, list(range(1, rank - 1)))


def _hits(g, node, rank: int) -> str:
    """Boolean (N, C, d...): true at each kept target's class."""
    x, target = node.inputs[0], node.inputs[1]
    target = g.Cast(target, to=onnx.TensorProto.INT64) if g.dtype(target) != onnx.TensorProto.INT64 else target
    hit = g.Equal(g.unsqueeze(target, [1]), _classes(g, x, rank))
    if node.has_attr("ignore_index"):
        ignored = g.Equal(target, g.const(node.attr("ignore_index"), dtype=np.int64))
        hit = g.And(hit, g.Not(g.unsqueeze(ignored, [1])))
    return hit


def loss_grads(g, node, dloss: str, log_prob):
    """(gradient w.r.t. the log-probabilities, gradient w.r.t. the weights or None) of the loss output.

    ``log_prob()`` gives the log-probabilities; it is called only for the weights' gradient.
    """
    x, weights = node.inputs[0], node.input(2)
    rank = g.rank(x)
    if rank is None:
        raise GradientRuleError(f"the one-hot of the targets needs the rank of {x!r}; annotate its shape")
    hit = _hits(g, node, rank)
    zero = g.const(0.0, like=x)
    class_axes = [0] + list(range(2, rank))
    on = g.const(1.0, like=x) if weights is None else g.unsqueeze(weights, class_axes)
    weighted = g.Where(hit, on, zero)
    reduction = _reduction(node)
    if reduction == "none":
        scale = g.unsqueeze(dloss, [1])
    elif reduction == "sum":
        scale = dloss
    elif reduction == "mean":
        scale = g.Div(dloss, g.reduce_sum(weighted, None, keepdims=False))
    else:
        raise GradientRuleError(f"unknown reduction {reduction!r}; expected 'none', 'sum' or 'mean'")
    dlp = g.Neg(g.Mul(scale, weighted))
    if weights is None or not node.needs_grad(2):
        return dlp, None
    # d loss / d w[c] sums -lp over the targets of class c; for 'mean' the weights are in the
    # denominator too, which subtracts the loss itself: (1/W) * sum over class c of (-lp - loss)
    nll = g.Neg(log_prob())
    if reduction == "mean":
        nll = g.Sub(nll, node.outputs[0])
    picked = g.Mul(g.Mul(scale, nll), g.Where(hit, g.const(1.0, like=x), zero))
    return dlp, g.reduce_sum(picked, class_axes, keepdims=False)


def _log_softmax_axis1(g, node, x: str) -> str:
    """log_softmax(x) along the class axis 1, for a node whose log_prob output is absent."""
    rank = g.rank(x)
    if g.opset >= 13 or rank == 2:
        return g.LogSoftmax(x, axis=1)
    if rank is None:
        raise GradientRuleError(f"recomputing log_prob below opset 13 needs the rank of {x!r}; "
                                "annotate its shape")
    # LogSoftmax before 13 normalizes over every dim from axis on: move the classes last first
    last = [0] + list(range(2, rank)) + [1]
    back = [0, rank - 1] + list(range(1, rank - 1))
    return g.Transpose(g.LogSoftmax(g.Transpose(x, perm=last), axis=rank - 1), perm=back)


@gradient_rule("NegativeLogLikelihoodLoss", since=12)
def negative_log_likelihood_loss_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    if dy[0] is None:
        return [None]
    dlp, dw = loss_grads(g, node, dy[0], lambda: node.inputs[0])
    return [dlp if node.needs_grad(0) else None, None, dw]


@gradient_rule("SoftmaxCrossEntropyLoss", since=12)
def softmax_cross_entropy_loss_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Through the loss to log_prob (plus log_prob's own gradient), then log-softmax's backward:
    dx = dlp - exp(lp) * sum(dlp, axis=1)."""
    dloss, dlp_out = dy
    lp_cache = []

    def log_prob():
        if not lp_cache:
            lp_cache.append(node.output(1) or _log_softmax_axis1(g, node, node.inputs[0]))
        return lp_cache[0]

    dlp, dw = loss_grads(g, node, dloss, log_prob) if dloss is not None else (None, None)
    dx = None
    if node.needs_grad(0):
        parts = [p for p in (dlp, dlp_out) if p is not None]
        if parts:
            d = parts[0] if len(parts) == 1 else g.Add(*parts)
            dx = g.Sub(d, g.Mul(g.Exp(log_prob()), g.reduce_sum(d, [1], keepdims=True)))
    return [dx, None, dw]
