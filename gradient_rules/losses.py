"""Classification losses: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.

Both pick one log-probability per target, ``loss[n, d...] = -w[t] * lp[n, t, d...]`` with
``t = target[n, d...]`` (targets equal to ``ignore_index`` weigh 0), then reduce: 'none', 'sum', or
'mean' = sum / (sum of the weights of the kept targets). The gradient w.r.t. the log-probabilities is
the weighted one-hot of the targets times the scaled loss gradient, written by a ScatterElements at the
targets (for SoftmaxCrossEntropyLoss onto the scaled softmax: one [N, C, d...] tensor besides log_prob);
the targets get none.

Both losses are linear in the log-probabilities (the mean divides by weights, not by them), so the tangent
of a loss is the same NegativeLogLikelihoodLoss of the log-probabilities' tangent; SoftmaxCrossEntropyLoss's
is dlp = dx - sum(softmax dx) over the classes. A tangent of the class weights goes to the fallback.
"""
from __future__ import annotations

import numpy as np
import onnx

from onnx_autodiff.rule_api import GradBuilder, GradientRuleError, Grads, NodeView, gradient_rule, jvp_rule


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


def _targets(g, node, like: str) -> tuple[str, str | None]:
    """(the targets as int64 [N, d...] with the ignored ones moved to class 0 so that they index safely,
    0/1 in the type of ``like`` marking the kept ones, or None without ignore_index)."""
    target = node.inputs[1]
    t = g.Cast(target, to=onnx.TensorProto.INT64) if g.dtype(target) != onnx.TensorProto.INT64 else target
    if not node.has_attr("ignore_index"):
        return t, None
    ignored = g.Equal(t, g.const(node.attr("ignore_index"), dtype=np.int64))
    return g.Where(ignored, g.const(0, dtype=np.int64), t), g.mask(g.Not(ignored), like)


def _coefficients(g, node, dloss: str, t: str, kept: str | None) -> str:
    """c [N, d...]: how much each target's loss term weighs in the loss, scale * w[t] * kept (0 for an
    ignored target); the gradient of -c * lp[t] w.r.t. lp is the one-hot of t times -c."""
    weights = node.input(2)
    picked = g.Gather(weights, t, axis=0) if weights is not None else None
    if kept is not None:
        picked = kept if picked is None else g.Mul(picked, kept)
    reduction = _reduction(node)
    if reduction == "mean":
        total = g.reduce_sum(picked, None, keepdims=False) if picked is not None else \
            g.Cast(g.Size(t), to=g.dtype(dloss))
        dloss = g.Div(dloss, total)
    elif reduction not in ("none", "sum"):
        raise GradientRuleError(f"unknown reduction {reduction!r}; expected 'none', 'sum' or 'mean'")
    c = dloss if picked is None else g.Mul(dloss, picked)
    return c if reduction == "none" or picked is not None else g.Expand(c, g.Shape(t))


def _weights_grad(g, node, dloss: str, log_prob) -> str:
    """d loss / d w[c] sums -lp[t] * scale over the targets of class c; for 'mean' the weights are in the
    denominator too, which subtracts the loss itself: (1/W) * sum over class c of (-lp - loss). Built with a
    one-hot of the targets [N, C, d...]: only when the weights ask for a gradient (rare)."""
    x, weights = node.inputs[0], node.input(2)
    rank = g.rank(x)
    class_axes = [0] + list(range(2, rank))
    hit = _hits(g, node, rank)
    one, zero = g.const(1.0, like=x), g.const(0.0, like=x)
    scale = g.unsqueeze(dloss, [1]) if _reduction(node) == "none" else dloss
    nll = g.Neg(log_prob())
    if _reduction(node) == "mean":
        counted = g.Where(hit, g.unsqueeze(weights, class_axes), zero)
        scale = g.Div(scale, g.reduce_sum(counted, None, keepdims=False))
        nll = g.Sub(nll, node.outputs[0])
    picked = g.Mul(g.Mul(scale, nll), g.Where(hit, one, zero))
    return g.reduce_sum(picked, class_axes, keepdims=False)


def loss_grads(g, node, dloss: str, log_prob, probs=None):
    """(gradient w.r.t. the log-probabilities, gradient w.r.t. the weights or None) of the loss output.

    The first is -c * one_hot(t), c from ``_coefficients``; given ``probs`` (the softmax, [N, C, d...]) it is
    instead the gradient through log-softmax, c * (probs - one_hot(t)). Either is one [N, C, d...] tensor
    written by a ScatterElements of the target positions ([N, 1, d...] values). ``log_prob()`` gives the
    log-probabilities; it is called only for the weights' gradient.
    """
    x = node.inputs[0]
    rank = g.rank(x)
    if rank is None:
        raise GradientRuleError(f"the one-hot of the targets needs the rank of {x!r}; annotate its shape")
    t, kept = _targets(g, node, dloss)
    c = g.unsqueeze(_coefficients(g, node, dloss, t, kept), [1])
    at = g.unsqueeze(t, [1])
    # c first: its type is known (the loss gradient's) where the scores' may not be (after a contrib op)
    if probs is None:
        dlp = g.ScatterElements(g.full(g.shape_of(x), 0.0, like=c), at, g.Neg(c), axis=1)
    else:
        scaled = g.Mul(c, probs)
        dlp = g.ScatterElements(scaled, at, g.Sub(g.GatherElements(scaled, at, axis=1), c), axis=1)
    if node.input(2) is None or not node.needs_grad(2):
        return dlp, None
    return dlp, _weights_grad(g, node, dloss, log_prob)


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
    """The loss's part, c * (softmax - one_hot(t)) (``loss_grads``), plus log_prob's own gradient through
    log-softmax, dlp - softmax * sum(dlp, axis=1); softmax = exp(log_prob), log_prob read from the node's
    second output when the forward has it (``causal_lm`` and ``cross_entropy`` ask for it)."""
    dloss, dlp_out = dy
    lp_cache = []

    def log_prob():
        if not lp_cache:
            lp_cache.append(node.output(1) or _log_softmax_axis1(g, node, node.inputs[0]))
        return lp_cache[0]

    if not node.needs_grad(0):
        dw = loss_grads(g, node, dloss, log_prob)[1] if dloss is not None and node.needs_grad(2) else None
        return [None, None, dw]
    probs = g.Exp(log_prob()) if dloss is not None or dlp_out is not None else None
    dx, dw = loss_grads(g, node, dloss, log_prob, probs) if dloss is not None else (None, None)
    if dlp_out is not None:  # log_prob's own gradient, through log-softmax
        through = g.Sub(dlp_out, g.Mul(probs, g.reduce_sum(dlp_out, [1], keepdims=True)))
        dx = through if dx is None else g.Add(dx, through)
    return [dx, None, dw]


def _nll_attrs(node) -> dict:
    return {k: node.attr(k) for k in ("reduction", "ignore_index") if node.has_attr(k)}


@jvp_rule("NegativeLogLikelihoodLoss", since=12)
def negative_log_likelihood_loss_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    if len(dx) > 2 and dx[2] is not None:
        return NotImplemented
    return [g.NegativeLogLikelihoodLoss(dx[0], *node.inputs[1:], **_nll_attrs(node))]


@jvp_rule("SoftmaxCrossEntropyLoss", since=12)
def softmax_cross_entropy_loss_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    if len(dx) > 2 and dx[2] is not None:
        return NotImplemented
    x = node.inputs[0]
    lp = node.output(1) or _log_softmax_axis1(g, node, x)
    dlp = g.Sub(dx[0], g.reduce_sum(g.Mul(g.Exp(lp), dx[0]), [1], keepdims=True))
    return [g.NegativeLogLikelihoodLoss(dlp, *node.inputs[1:], **_nll_attrs(node)), dlp]
