"""Conv gradients when the spatial dims are known only at run time (``dynamic_axes`` on H and W).

Kernel, strides, dilations and explicit pads are attributes, so both gradients are written without
the sizes: the input gradient is a ConvTranspose from the begin pad with no end pad, zero-extended by
stride - 1 and cropped to x's run-time size (its length exceeds the input's by e - r, r the rows the
last window step left unused, 0 <= r < stride); the weight gradient is the Conv of x by dz with the
forward pads, whose spatial length k + r // d is cropped to the kernel.
"""
from __future__ import annotations

from onnx_autodiff.errors import GradientRuleError


def _fail(node, what):
    raise GradientRuleError(f"{node} (opset {node.opset}): {what}")


def conv_grad_dynamic(g, node, dy, kernel: list[int]):
    dz, = dy
    x, w = node.inputs[:2]
    r = len(kernel)
    group = node.attr("group", 1)
    auto_pad = node.attr("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        _fail(node, "with spatial dims known only at run time the gradient needs explicit pads, not auto_pad "
                    f"{auto_pad}; re-export with explicit padding or fixed spatial sizes")
    pads = [0] * (2 * r) if auto_pad == "VALID" else list(node.attr("pads", [0] * (2 * r)))
    begins, ends = pads[:r], pads[r:]
    strides = list(node.attr("strides", [1] * r))
    dilations = list(node.attr("dilations", [1] * r))
    if g.opset < 13:
        g.needs_opset(13, "the Conv gradient for spatial dims known only at run time")
    spatial = list(range(2, 2 + r))
    grads = [None] * len(node.inputs)
    if node.needs_grad(0):
        dx = g.ConvTranspose(dz, w, group=group, strides=strides, dilations=dilations, pads=begins + [0] * r)
        extra = [s - 1 for s in strides]
        if any(extra):
            dx = g.pad(dx, [0] * (2 + r) + [0, 0] + extra)
        size = g.Slice(g.Shape(x), g.ints([2]), g.ints([2 + r]))
        grads[0] = g.Slice(dx, g.ints([0] * r), size, g.ints(spatial))
    if node.needs_grad(1):
        if group != 1:
            _fail(node, "the weight gradient of a grouped Conv needs static spatial dims; give the model "
                        "fixed spatial sizes")
        perm = [1, 0] + spatial
        wg = g.Conv(g.Transpose(x, perm=perm), g.Transpose(dz, perm=perm), strides=dilations, dilations=strides,
                    pads=begins + ends)
        wg = g.slice(wg, [0] * r, kernel, spatial)
        grads[1] = g.Transpose(wg, perm=perm)
    if node.input(2) and node.needs_grad(2):
        grads[2] = g.reduce_sum(dz, [0] + spatial, keepdims=False)
    return grads
