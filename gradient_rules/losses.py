"""Classification losses: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.

Both pick one log-probability per target, ``loss[n, d...] = -w[t] * lp[n, t, d...]`` with
``t = target[n, d...]`` (targets equal to ``ignore_index`` weigh 0), then reduce: 'none', 'sum', or
'mean' = sum / (sum of the weights of the kept targets). The gradient w.r.t. the log-probabilities is
the weighted one-hot of the targets times the scaled loss gradient; targets and weights get none.
"""
from __future__ import annotations

import numpy as np
import onnx

from onnx_autodiff.registry import gradient_rule


def _reduction(node) -> str:
    r = node.attr("reduction", "mean")
    return r.decode() if isinstance(r, bytes) else r


def _classes(g, x: str, rank: int) -> str:
    """0..C-1 (C = size of axis 1 of x) shaped (C, 1, ...) to meet targets unsqueezed at axis 1."""
    shape = g.shape(x)
    trail = [1] * (rank - 2)
    if isinstance(shape[1], int):
        return g.const(np.arange(shape[1], dtype=np.int64).reshape([shape[1]] + trail))
    count = g.Gather(g.Shape(x), g.const(1, dtype=np.int64), axis=0)
    classes = g.Range(g.const(0, dtype=np.int64), count, g.const(1, dtype=np.int64))
    return g.unsqueeze(classes, list(range(1, rank - 1)))


def target_weights(g, node) -> str:
    """Each target's weight spread over the class axis: (N, C, d...), zero off the target's class
    and for ignored targets."""
    x, target = node.inputs[0], node.inputs[1]
    weights = node.input(2)
    rank = g.rank(x)
    if rank is None:
        raise ValueError(f"{node}: the one-hot of the targets needs the rank of {x!r}; annotate its shape")
    target = g.Cast(target, to=onnx.TensorProto.INT64) if g.dtype(target) != onnx.TensorProto.INT64 else target
    hit = g.Equal(g.unsqueeze(target, [1]), _classes(g, x, rank))
    if node.has_attr("ignore_index"):
        ignored = g.Equal(target, g.const(node.attr("ignore_index"), dtype=np.int64))
        hit = g.And(hit, g.Not(g.unsqueeze(ignored, [1])))
    on = g.const(1.0, like=x) if weights is None else g.unsqueeze(weights, [0] + list(range(2, rank)))
    return g.Where(hit, on, g.const(0.0, like=x))


def log_prob_grad(g, node, dloss: str) -> str:
    """The gradient of the loss output w.r.t. the log-probabilities (N, C, d...)."""
    weighted = target_weights(g, node)
    reduction = _reduction(node)
    if reduction == "none":
        scale = g.unsqueeze(dloss, [1])
    elif reduction == "sum":
        scale = dloss
    elif reduction == "mean":
        scale = g.Div(dloss, g.reduce_sum(weighted, None, keepdims=False))
    else:
        raise ValueError(f"{node}: unknown reduction {reduction!r}; expected 'none', 'sum' or 'mean'")
    return g.Neg(g.Mul(scale, weighted))


def _log_softmax_axis1(g, node, x: str) -> str:
    """log_softmax(x) along the class axis 1, for a node whose log_prob output is absent."""
    rank = g.rank(x)
    if g.opset >= 13 or rank == 2:
        return g.LogSoftmax(x, axis=1)
    if rank is None:
        raise ValueError(f"{node}: recomputing log_prob below opset 13 needs the rank of {x!r}; annotate its shape")
    # LogSoftmax before 13 normalizes over every dim from axis on: move the classes last first
    last = [0] + list(range(2, rank)) + [1]
    back = [0, rank - 1] + list(range(1, rank - 1))
    return g.Transpose(g.LogSoftmax(g.Transpose(x, perm=last), axis=rank - 1), perm=back)


@gradient_rule("NegativeLogLikelihoodLoss", since=12)
def negative_log_likelihood_loss_grad(g, node, dy):
    if not node.needs_grad(0) or dy[0] is None:
        return [None]
    return [log_prob_grad(g, node, dy[0])]


@gradient_rule("SoftmaxCrossEntropyLoss", since=12)
def softmax_cross_entropy_loss_grad(g, node, dy):
    """Through the loss to log_prob (plus log_prob's own gradient), then log-softmax's backward:
    dx = dlp - exp(lp) * sum(dlp, axis=1)."""
    if not node.needs_grad(0):
        return [None]
    dloss, dlp_out = (list(dy) + [None, None])[:2]
    parts = ([log_prob_grad(g, node, dloss)] if dloss is not None else []) + ([dlp_out] if dlp_out else [])
    if not parts:
        return [None]
    dlp = parts[0] if len(parts) == 1 else g.Add(*parts)
    lp = node.output(1) or _log_softmax_axis1(g, node, node.inputs[0])
    return [g.Sub(dlp, g.Mul(g.Exp(lp), g.reduce_sum(dlp, [1], keepdims=True)))]
