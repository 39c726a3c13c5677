"""The standard-op forms we emit where a target (``passes/targets.py``) lacks an op: ``rewrite_for_target``, the
last pass of the lowering pipeline, replaces each node of an op the target lacks that has a form here
(``FORMS``, rules of ``passes/rewrite.py``), outputs keeping their names."""
from __future__ import annotations

import numpy as np
import onnx

from ..engine.builder import GradBuilder
from ..errors import TargetError
from .rewrite import Rule, apply_rules


def _nll(g: GradBuilder, node: onnx.NodeProto, lp: str) -> str:
    """NegativeLogLikelihoodLoss of log-probabilities ``lp`` [N, C, d...]: -w[t] * lp[t] picked by a mask
    of the targets, reduced as the node says ('mean' divides by the weights of the kept targets)."""
    target = node.input[1]
    weights = node.input[2] if len(node.input) > 2 and node.input[2] else None
    rank = g.rank(lp) or (g.rank(target) + 1 if g.rank(target) is not None else None)
    if rank is None:
        raise TargetError(f"node {node.name!r} ({node.op_type}): its standard form needs the rank of {lp!r}")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    t = g.Cast(target, to=onnx.TensorProto.INT64)
    count = g.Gather(g.Shape(lp), g.ints([1]), axis=0)
    classes = g.Range(g.const(0, dtype=np.int64), g.Squeeze(count), g.const(1, dtype=np.int64))
    classes = g.unsqueeze(classes, list(range(1, rank - 1)))  # (C, 1, ...)
    hit = g.Equal(g.unsqueeze(t, [1]), classes)
    if "ignore_index" in attrs:
        kept = g.Not(g.Equal(t, g.const(int(attrs["ignore_index"]), dtype=np.int64)))
        hit = g.And(hit, g.unsqueeze(kept, [1]))
    one = g.const(1.0, like=lp)
    zero = g.const(0.0, like=lp)
    on = one if weights is None else g.unsqueeze(weights, [0] + list(range(2, rank)))
    w = g.Where(hit, on, zero)
    picked = g.reduce_sum(g.Where(hit, g.Mul(lp, on), zero), [1], keepdims=False)
    loss = g.Neg(picked)
    reduction = attrs.get("reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if reduction == "none":
        return loss
    total = g.reduce_sum(loss, None, keepdims=False)
    return total if reduction == "sum" else g.Div(total, g.reduce_sum(w, None, keepdims=False))


def _log_softmax(g: GradBuilder, node: onnx.NodeProto, x: str) -> str:
    rank = g.rank(x)
    if g.opset >= 13 or rank == 2:
        return g.LogSoftmax(x, axis=1)
    if rank is None:
        raise TargetError(f"node {node.name!r} (SoftmaxCrossEntropyLoss): its standard form below opset 13 "
                          f"needs the rank of {x!r}")
    last = [0] + list(range(2, rank)) + [1]
    back = [0, rank - 1] + list(range(1, rank - 1))
    return g.Transpose(g.LogSoftmax(g.Transpose(x, perm=last), axis=rank - 1), perm=back)


def _softmax_cross_entropy(g: GradBuilder, node: onnx.NodeProto, facts=None, ctx=None) -> list[str]:
    lp = _log_softmax(g, node, node.input[0])
    return [_nll(g, node, lp), lp]


def _negative_log_likelihood(g: GradBuilder, node: onnx.NodeProto, facts=None, ctx=None) -> list[str]:
    return [_nll(g, node, node.input[0])]


def _max_unpool(g: GradBuilder, node: onnx.NodeProto, facts=None, ctx=None) -> list[str]:
    """X scattered at the flat indices I into zeros of the output shape (ScatterElements on the flat
    tensors); needs the output_shape input, which is what our MaxPool gradient gives."""
    if len(node.input) < 3 or not node.input[2]:
        raise TargetError(f"node {node.name!r} (MaxUnpool) has no output_shape input: the target lacks "
                          "MaxUnpool and its standard form needs the output shape")
    x, indices, shape = node.input[0], node.input[1], node.input[2]
    flat = g.ints([-1])
    zero = onnx.numpy_helper.from_array(np.zeros([1], g.np_dtype(x)))
    zeros = g.Reshape(g.op("ConstantOfShape", shape, value=zero), flat)
    scattered = g.op("ScatterElements", zeros, g.Reshape(indices, flat), g.Reshape(x, flat), axis=0)
    return [g.Reshape(scattered, shape)]


def _dropout(g: GradBuilder, node: onnx.NodeProto, facts=None, ctx=None) -> list[str]:
    """A Dropout that drops nothing (ratio a constant 0, or not in training mode) as Identity, with an
    all-true mask; a training-mode Dropout that drops has no standard form (its random mask is the
    runtime's)."""
    ratio = g.value(node.input[1]) if len(node.input) > 1 and node.input[1] else np.array(0.5)
    training = g.value(node.input[2]) if len(node.input) > 2 and node.input[2] else np.array(False)
    if ratio is None or training is None or (bool(training) and float(ratio) != 0.0):
        raise TargetError(f"node {node.name!r}: a training-mode Dropout (ratio {ratio}) has no standard form; the "
                          f"target lacks it. Export with dropout 0 or in eval mode, or choose another target")
    x = node.input[0]
    outs = [g.Identity(x)]
    if len(node.output) > 1 and node.output[1]:
        true = onnx.numpy_helper.from_array(np.ones([1], np.bool_))
        outs.append(g.op("ConstantOfShape", g.Shape(x), value=true))
    return outs


def _lacked(node: onnx.NodeProto, facts, ctx) -> bool:
    return ctx.target is not None and not ctx.target.has_op(node.op_type)


FORMS = [Rule(op, build, _lacked, since) for op, since, build in (
    ("Dropout", 12, _dropout),
    ("SoftmaxCrossEntropyLoss", 12, _softmax_cross_entropy),
    ("NegativeLogLikelihoodLoss", 12, _negative_log_likelihood),
    ("MaxUnpool", 11, _max_unpool),
)]
FORM_SINCE = {r.op: r.since for r in FORMS}  # op -> the opset its standard form needs


def rewrite_for_target(model: onnx.ModelProto, ctx) -> bool:
    """The pipeline's last pass: each node of an op ``ctx.target`` lacks that has a standard form becomes
    that form, in place (outputs keep their names)."""
    if ctx.target is None or not ctx.target.lacks:
        return False
    return apply_rules(model, FORMS, ctx, ctx.target.name)


__all__ = ["rewrite_for_target", "FORMS", "FORM_SINCE"]
