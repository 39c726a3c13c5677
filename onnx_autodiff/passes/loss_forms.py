"""SoftmaxCrossEntropyLoss on [N, C] scores as LogSoftmax + NegativeLogLikelihoodLoss.

The two are the operator's own definition (log-softmax along the classes, then the negative log-likelihood
of the targets with the same weights, ``ignore_index`` and reduction), so the loss and ``log_prob`` are the
same values. The reason is memory: onnxruntime has no kernel for SoftmaxCrossEntropyLoss and runs its
function body, which reshapes [N, C] scores to [N, C, 1] and takes LogSoftmax along axis 1, not the last
axis; that LogSoftmax transposes its input and output, so three [N, C] tensors are live beside the scores
where LogSoftmax on the last axis writes only log_prob (measured on [1024, 151936] float scores, a causal
LM's: 1.8 GB against 0.6 GB). The gradient is not affected: its rule reads ``log_prob`` by name, which
LogSoftmax now writes. Scores of any other rank, or of unknown rank, keep the node.
"""
from __future__ import annotations

import onnx

from ..graph import attr_value
from .rewrite import Rule, apply_rules

# SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss are opset 12; for [N, C] LogSoftmax(axis=1) is the same at
# every opset (before 13 it coerces to 2-D from the axis on, which for rank 2 is that axis alone)
_SINCE = 12


def _split(g, node: onnx.NodeProto, facts, ctx) -> list[str]:
    log_prob = g.LogSoftmax(node.input[0], axis=1)
    attrs = {a: attr_value(node, a) for a in ("reduction", "ignore_index") if attr_value(node, a) is not None}
    return [g.op("NegativeLogLikelihoodLoss", log_prob, *node.input[1:], **attrs), log_prob]


SPLIT = Rule("SoftmaxCrossEntropyLoss", _split, lambda node, facts, ctx: facts.rank(node.input[0]) == 2, _SINCE,
             typed=False)


def split_cross_entropy(model: onnx.ModelProto, ctx) -> bool:
    """Replace, in place, each default-domain SoftmaxCrossEntropyLoss of a top graph whose scores have rank 2
    by LogSoftmax + NegativeLogLikelihoodLoss (outputs keep their names); a lowering pass."""
    return apply_rules(model, [SPLIT], ctx, "split")


__all__ = ["split_cross_entropy"]
