"""Dropout: the backward reuses the forward's mask, so the gradient sees the same dropped elements.

In training mode y = x * mask / (1 - ratio), so dx = dy * mask / (1 - ratio); in inference mode
y = x and dx = dy. Which mode applies depends on the operator version:

- opset 1 and 6: the ``is_test`` attribute (default 0: training);
- opset 7 to 11: the runtime decides; onnxruntime and onnx's backend tests run these as the identity,
  so the gradient is the identity too;
- opset 12 on: the ``training_mode`` input (absent: inference), a constant or a run-time tensor.

The mask is the node's second output; the gradient pass names it when the model did not ask for it.
ratio and training_mode get no gradient.
"""
from __future__ import annotations

from onnx import TensorProto

from onnx_autodiff.rule_api import GradBuilder, GradientRuleError, Grads, NodeView, gradient_rule


def _mode(g, node):
    """True (training), False (inference) or the name of the run-time boolean training_mode."""
    if node.opset < 7:
        return not node.attr("is_test", 0)
    if node.opset < 12:
        return False
    t = node.input(2)
    if t is None:
        return False
    v = g.value(t)
    return t if v is None else bool(v)


def _scale(g, node, like: str):
    """1 / (1 - ratio) in the element type of ``like``: a constant when the ratio is known."""
    if node.opset < 12:
        r = node.attr("ratio", 0.5)
    else:
        ratio = node.input(1)
        r = 0.5 if ratio is None else g.value(ratio)
        if r is None:
            one = g.const(1.0, like=like)
            return g.Div(one, g.Sub(one, g.cast_like(ratio, like)))
    r = float(r)
    return None if r == 0.0 else g.const(1.0 / (1.0 - r) if r < 1.0 else 0.0, like=like)


@gradient_rule("Dropout")
def dropout_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    dout = dy[0]
    if dout is None:
        return [None]
    mode = _mode(g, node)
    if mode is False:
        return [dout]
    mask = node.output(1)
    if mask is None:
        raise GradientRuleError(
            "the Dropout gradient needs the forward mask, but the node has no mask output; "
            "lower the model with onnx_autodiff.lower (it adds one) or give the node a second output")
    scale = _scale(g, node, dout)
    kept = dout if scale is None else g.Mul(dout, scale)
    if g.opset < 9:  # no Where yet; is_test=0 models (opset 1, 6) have a float mask of zeros and ones
        return [g.Mul(kept, g.Cast(mask, to=g.dtype(dout)))]
    if g.dtype(mask) != TensorProto.BOOL:
        mask = g.Cast(mask, to=TensorProto.BOOL)
    zero = g.const(0.0, like=dout)
    if mode is True:
        return [g.Where(mask, kept, zero)]
    # a run-time training_mode: the mask is all true in inference, but the scale must not apply
    return [g.Where(mask, g.Where(mode, kept, dout), zero)]
