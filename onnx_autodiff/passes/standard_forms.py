"""The standard-op forms we emit where a target (``runtimes/targets.py``) lacks an op: ``rewrite_for_target``, the
last pass of the lowering pipeline, replaces each node of an op the target lacks that has a form here
(``FORMS``, rules of ``passes/rewrite.py``), outputs keeping their names."""
from __future__ import annotations

import numpy as np
import onnx

from ..engine.builder import GradBuilder
from ..errors import TargetError
from ..graph import opset_map
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
    t = target if g.dtype(target) == onnx.TensorProto.INT64 else g.Cast(target, to=onnx.TensorProto.INT64)
    rows = g.one_hot_rows(t, (g.shape(lp) or [None, None])[1], lp, rank) if not g.has_int64() and \
        "ignore_index" not in attrs else None
    if rows is not None:  # no int64 arithmetic (WebGPU in the browser)
        hit = g.Greater(rows, g.const(0.5, like=lp))
    else:
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
    zeros = g.Reshape(g.full(shape, 0.0, x), flat)
    scattered = g.op("ScatterElements", zeros, g.Reshape(indices, flat), g.Reshape(x, flat), axis=0)
    return [g.Reshape(scattered, shape)]


def float32_text(x) -> str:
    """A float32 value as written: the shortest decimal that reads back as the same float32 (0.05, not
    0.05000000074505806)."""
    return np.format_float_positional(np.float32(x), unique=True, trim="-")


def _drops(g_or_view, node: onnx.NodeProto) -> bool | None:
    """Whether a Dropout drops (training mode, ratio not 0); None when its inputs are not constants."""
    ratio = g_or_view.value(node.input[1]) if len(node.input) > 1 and node.input[1] else np.array(0.5)
    training = g_or_view.value(node.input[2]) if len(node.input) > 2 and node.input[2] else np.array(False)
    if ratio is None or training is None:
        return None
    return bool(training) and float(ratio) != 0.0


def _dropout(g: GradBuilder, node: onnx.NodeProto, facts=None, ctx=None) -> list[str]:
    """A Dropout that drops nothing (ratio a constant 0, or not in training mode) as Identity, with an
    all-true mask; a training-mode Dropout that drops has no standard form (its random mask is the
    runtime's)."""
    if _drops(g, node) is not False:
        ratio = g.value(node.input[1]) if len(node.input) > 1 and node.input[1] else np.array(0.5)
        lora = " (a LoRA adapter's: make-training --lora-dropout 0)" if node.name.startswith("lora/") else ""
        ratio = "not a constant" if ratio is None else float32_text(ratio)
        raise TargetError(f"node {node.name!r}: a training-mode Dropout (ratio {ratio}) has no standard form; the "
                          f"target lacks it. Export with dropout 0{lora} or in eval mode, or choose another target")
    x = node.input[0]
    outs = [g.Identity(x)]
    if len(node.output) > 1 and node.output[1]:
        true = onnx.numpy_helper.from_array(np.ones([1], np.bool_))
        if g.has_op("ConstantOfShape"):
            outs.append(g.op("ConstantOfShape", g.shape_of(x), value=true))
        else:
            outs.append(g.Expand(g.const(np.array(True)), g.shape_of(x)))
    return outs


def _reduce_max(g: GradBuilder, x: str, axes: list[int]) -> str:
    if g.opset >= 18:
        return g.ReduceMax(x, g.ints(axes), keepdims=1)
    return g.ReduceMax(x, axes=axes, keepdims=1)


def _log_softmax_form(g: GradBuilder, node: onnx.NodeProto, facts=None, ctx=None) -> list[str]:
    """``s - Log(ReduceSum(Exp(s)))`` with ``s = x - ReduceMax(x)`` over the node's axis (below opset 13, the
    axes from ``axis`` on, which is what the 2-D coercion of those opsets softmaxes over)."""
    x = node.input[0]
    rank = g.rank(x)
    axis = next((a.i for a in node.attribute if a.name == "axis"), -1 if g.opset >= 13 else 1)
    if rank is None and (axis < 0 or g.opset < 13):
        raise TargetError(f"node {node.name!r} (LogSoftmax): its standard form needs the rank of {x!r}")
    axis = axis + rank if axis < 0 else axis
    axes = [axis] if g.opset >= 13 else list(range(axis, rank))
    shifted = g.Sub(x, _reduce_max(g, x, axes))
    return [g.Sub(shifted, g.Log(g.reduce_sum(g.Exp(shifted), axes, keepdims=True)))]


def _sum_form(g: GradBuilder, node: onnx.NodeProto, facts=None, ctx=None) -> list[str]:
    """Sum as a chain of Adds, in the order of its inputs (Add broadcasts as Sum does)."""
    terms = [i for i in node.input if i]
    total = terms[0] if len(terms) > 1 else g.Identity(terms[0])
    for t in terms[1:]:
        total = g.Add(total, t)
    return [total]


def _constant_of_shape(g: GradBuilder, node: onnx.NodeProto, facts=None, ctx=None) -> list[str]:
    """``Expand(value, shape)``: the scalar value (0.0 float by default) broadcast to the shape."""
    value = next((onnx.numpy_helper.to_array(a.t) for a in node.attribute if a.name == "value"),
                 np.zeros([1], np.float32))
    return [g.Expand(g.const(np.asarray(value).reshape(())), node.input[0])]


def _dequantize_linear(g: GradBuilder, node: onnx.NodeProto, facts=None, ctx=None) -> list[str]:
    """``(x - zero point) * scale`` in the scale's type, the scale (and zero point) per tensor, per axis (reshaped
    to broadcast along ``axis``) or per block (each repeated over its block along ``axis``, the last cut short)."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("output_dtype"):
        raise TargetError(f"node {node.name!r} (DequantizeLinear): its standard form does not take output_dtype")
    x, scale = node.input[0], node.input[1]
    zp = node.input[2] if len(node.input) > 2 and node.input[2] else None
    rank, s_shape = g.rank(x), g.static_shape(scale)
    if rank is None or s_shape is None:
        raise TargetError(f"node {node.name!r} (DequantizeLinear): its standard form needs the rank of {x!r} and "
                          f"the shape of {scale!r}")
    axis, block = attrs.get("axis", 1) % max(rank, 1), attrs.get("block_size", 0)

    def spread(t: str) -> str:  # a scale-shaped tensor made to broadcast against x
        if len(s_shape) == 0 or (not block and s_shape == (1,)):
            return t
        if not block:
            return g.Reshape(t, g.ints([-1 if k == axis else 1 for k in range(rank)]))
        x_shape = g.static_shape(x)
        if x_shape is None:
            raise TargetError(f"node {node.name!r} (DequantizeLinear): its blocked form needs the shape of {x!r}")
        blocks = list(s_shape[:axis + 1]) + [block] + list(s_shape[axis + 1:])
        repeated = g.Expand(g.unsqueeze(t, [axis + 1]), g.ints(blocks))
        full = g.Reshape(repeated, g.ints(list(s_shape[:axis]) + [s_shape[axis] * block] + list(s_shape[axis + 1:])))
        return full if s_shape[axis] * block == x_shape[axis] else g.slice(full, [0], [x_shape[axis]], [axis])

    centred = g.cast_like(x, scale)
    if zp is not None:
        centred = g.Sub(centred, spread(g.cast_like(zp, scale)))
    return [g.Mul(centred, spread(scale))]


def _lacked(node: onnx.NodeProto, facts, ctx) -> bool:
    """The target lacks the op, or the op with an attribute the node sets (NegativeLogLikelihoodLoss with
    ``ignore_index`` on OpenVINO)."""
    return ctx.target is not None and ctx.target.lacked(node, opset=opset_map(facts.model).get("", 0)) is not None


def _dropout_lacked(node: onnx.NodeProto, facts, ctx) -> bool:
    """A Dropout the target lacks; where the target is an execution provider that hands what it lacks to
    the CPU (WebGPU), only one that drops nothing (a Dropout that drops runs there, listed by check)."""
    if not _lacked(node, facts, ctx):
        return False
    return ctx.target.ep is None or _drops(facts.view, node) is False


FORMS = [Rule(op, build, when, since) for op, since, build, when in (
    ("Dropout", 12, _dropout, _dropout_lacked),
    ("SoftmaxCrossEntropyLoss", 12, _softmax_cross_entropy, _lacked),
    ("NegativeLogLikelihoodLoss", 12, _negative_log_likelihood, _lacked),
    ("MaxUnpool", 11, _max_unpool, _lacked),
    ("LogSoftmax", 1, _log_softmax_form, _lacked),
    ("Sum", 8, _sum_form, _lacked),
    ("ConstantOfShape", 9, _constant_of_shape, _lacked),
    ("DequantizeLinear", 10, _dequantize_linear, _lacked),
)]
FORM_SINCE = {r.op: r.since for r in FORMS}  # op -> the opset its standard form needs


def rewrite_for_target(model: onnx.ModelProto, ctx) -> bool:
    """The pipeline's last pass: each node of an op ``ctx.target`` lacks that has a standard form becomes
    that form, in place (outputs keep their names)."""
    if ctx.target is None or not ctx.target.lacks:
        return False
    return apply_rules(model, FORMS, ctx, ctx.target.name)


__all__ = ["rewrite_for_target", "FORMS", "FORM_SINCE"]
