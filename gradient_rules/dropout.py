"""Dropout: the backward reuses the forward's mask, so the gradient sees the same dropped elements.

In training mode y = x * mask / (1 - ratio), so dx = dy * mask / (1 - ratio); in inference mode
y = x and dx = dy. Which mode applies depends on the operator version:

- opset 1 and 6: the ``is_test`` attribute (default 0: training);
- opset 7 to 11: the runtime decides; onnxruntime and onnx's backend tests run these as the identity,
  so the gradient is the identity too;
- opset 12 on: the ``training_mode`` input (absent: inference), a constant or a run-time tensor.

The mask is the node's second output; the gradient pass names it when the model did not ask for it.
A constant ratio 0 drops nothing (the mask is all true): the gradient is dy itself, no pass over it (emitter
option ``dropout_ratio_zero_identity``, default True; False: the masked form, which tests compare).
ratio and training_mode get no gradient. The map from x to y is linear with a diagonal Jacobian, so the
tangent rules are the gradient rules applied to dx (the mask output gets no tangent).
"""
from __future__ import annotations

from onnx import TensorProto

from onnx_autodiff.rule_api import GradBuilder, GradientRuleError, Grads, NodeView, gradient_rule, jvp_rule


def _mask(node) -> str:
    mask = node.output(1)
    if mask is None:
        raise GradientRuleError(
            "the Dropout gradient needs the forward mask, but the node has no mask output; "
            "lower the model with onnx_autodiff.lower (it adds one) or give the node a second output")
    return mask


def _constant_scale(g, ratio: float, like: str) -> str | None:
    """1 / (1 - ratio) in the element type of ``like``; None for ratio 0."""
    return None if ratio == 0.0 else g.const(1.0 / (1.0 - ratio) if ratio < 1.0 else 0.0, like=like)


def _drops_nothing(g, ratio: float) -> bool:
    """A constant ratio 0: the mask is all true and y = x (module docstring)."""
    return ratio == 0.0 and g.option("dropout_ratio_zero_identity", True)


@gradient_rule("Dropout")
def dropout_is_test_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Opsets 1 and 6: training unless is_test=1; the mask is a float tensor of zeros and ones."""
    dout = dy[0]
    ratio = float(node.attr("ratio", 0.5))
    if dout is None or node.attr("is_test", 0) or _drops_nothing(g, ratio):
        return [dout]
    scale = _constant_scale(g, ratio, dout)
    kept = dout if scale is None else g.Mul(dout, scale)
    return [g.Mul(kept, g.Cast(_mask(node), to=g.dtype(dout)))]


@gradient_rule("Dropout", since=7)
def dropout_identity_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Opsets 7 to 11: the identity (as onnxruntime runs these)."""
    return [dy[0]]


@gradient_rule("Dropout", since=12)
def dropout_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Opset 12 on: ratio and training_mode are inputs, constants or run-time tensors."""
    dout = dy[0]
    t = node.input(2)
    mode = False if t is None else (t if g.value(t) is None else bool(g.value(t)))
    if dout is None or mode is False:
        return [dout]
    ratio = node.input(1)
    r = 0.5 if ratio is None else g.value(ratio)
    if r is not None and _drops_nothing(g, float(r)):
        return [dout]
    mask = _mask(node)
    if r is None:
        one = g.const(1.0, like=dout)
        scale = g.Div(one, g.Sub(one, g.cast_like(ratio, dout)))
    else:
        scale = _constant_scale(g, float(r), dout)
    kept = dout if scale is None else g.Mul(dout, scale)
    if g.dtype(mask) != TensorProto.BOOL:
        mask = g.Cast(mask, to=TensorProto.BOOL)
    zero = g.const(0.0, like=dout)
    if mode is True:
        return [g.Where(mask, kept, zero)]
    # a run-time training_mode: the mask is all true in inference, but the scale must not apply
    return [g.Where(mask, g.Where(mode, kept, dout), zero)]


@jvp_rule("Dropout")
def dropout_is_test_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    return [dropout_is_test_grad(g, node, dx[:1])[0], None]


@jvp_rule("Dropout", since=7)
def dropout_identity_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    return [dx[0], None]


@jvp_rule("Dropout", since=12)
def dropout_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    return [dropout_grad(g, node, dx[:1])[0] if dx[0] else None, None]
