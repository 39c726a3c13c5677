"""Conv and AveragePool gradients when the spatial dims are known only at run time (``dynamic_axes`` on
H and W).

Kernel, strides and dilations are attributes, so the gradients are written without the sizes: the input
gradient is a ConvTranspose with no pads (it covers the padded input from its first element), zero-
extended by stride - 1 and cut at the begin pad to x's run-time size (its length exceeds the padded
input's by e - r, r the rows the last window step left unused, 0 <= r < stride); the weight gradient is
the Conv of the padded x by dz, whose spatial length k + r // d is cropped to the kernel. Explicit pads
are attributes; auto_pad SAME_UPPER / SAME_LOWER pads are computed from the run-time size (total
max((ceil(n / s) - 1) * s + extent - n, 0), the odd one at the end for UPPER, at the begin for LOWER).
"""
from __future__ import annotations

import numpy as np

from onnx_autodiff.rule_api import GradientRuleError


def _auto_pad(node) -> str:
    return node.attr("auto_pad", "NOTSET")


class _Geometry:
    """Strides, dilations and the begin pads (ints, or a run-time tensor for SAME) of a window node."""

    def __init__(self, g, node, x: str, kernel: list[int]):
        r = len(kernel)
        self.r, self.kernel = r, kernel
        self.strides = list(node.attr("strides", [1] * r))
        self.dilations = list(node.attr("dilations", [1] * r))
        self.spatial = list(range(2, 2 + r))
        self.size = g.Slice(g.Shape(x), g.ints([2]), g.ints([2 + r]))
        auto_pad = _auto_pad(node)
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            extent = g.ints([(k - 1) * d + 1 for k, d in zip(kernel, self.dilations)])
            s = g.ints(self.strides)
            out = g.Div(g.Sub(g.Add(self.size, s), g.ints([1] * r)), s)  # ceil(n / s)
            total = g.Max(g.Sub(g.Add(g.Mul(g.Sub(out, g.ints([1] * r)), s), extent), self.size), g.ints([0] * r))
            small = g.Div(total, g.ints([2] * r))
            big = g.Sub(total, small)
            self.begins = small if auto_pad == "SAME_UPPER" else big
            self.pads = g.Concat(self.begins, big if auto_pad == "SAME_UPPER" else small, axis=0)
        else:
            pads = [0] * (2 * r) if auto_pad == "VALID" else list(node.attr("pads", [0] * (2 * r)))
            self.begins, self.pads = pads[:r], pads

    def padded(self, g, x: str) -> str:
        """x with its pads made explicit."""
        if isinstance(self.pads, str):
            return g.Pad(x, g.Concat(g.ints([0, 0]), g.Slice(self.pads, g.ints([0]), g.ints([self.r])), g.ints([0, 0]),
                                     g.Slice(self.pads, g.ints([self.r]), g.ints([2 * self.r])), axis=0))
        return g.pad(x, [0, 0] + self.pads[:self.r] + [0, 0] + self.pads[self.r:])

    def input_grad(self, g, dz: str, w: str, group: int) -> str:
        """The transpose of the window map: ConvTranspose from the padded input's first element, cut to x."""
        dx = g.ConvTranspose(dz, w, group=group, strides=self.strides, dilations=self.dilations)
        extra = [s - 1 for s in self.strides]
        if any(extra):
            dx = g.pad(dx, [0] * (2 + self.r) + [0, 0] + extra)
        begins = self.begins if isinstance(self.begins, str) else g.ints(self.begins)
        return g.Slice(dx, begins, g.Add(begins, self.size), g.ints(self.spatial))


def conv_grad_dynamic(g, node, dy, kernel: list[int]):
    dz, = dy
    x, w = node.inputs[:2]
    group = node.attr("group", 1)
    g.require(13, "the Conv gradient for spatial dims known only at run time")
    geo = _Geometry(g, node, x, kernel)
    spatial = geo.spatial
    grads = [None] * len(node.inputs)
    if node.needs_grad(0):
        grads[0] = geo.input_grad(g, dz, w, group)
    if node.needs_grad(1):
        grads[1] = _weight_grad(g, node, geo, x, w, dz, group)
    if node.input(2) and node.needs_grad(2):
        grads[2] = g.reduce_sum(dz, [0] + spatial, keepdims=False)
    return grads


def _weight_grad(g, node, geo: _Geometry, x: str, w: str, dz: str, group: int) -> str:
    """``w[j, c, k] = sum_{n,o} dz[n, j, o] xp[n, grp(j) * Cg + c, o * s + k * d]``: a Conv of the padded x
    (input channels of a group as batch, group-major batch as channels) by dz (batch as input channels),
    with ``group`` groups, strides and dilations trading places."""
    r, spatial = geo.r, geo.spatial
    xp = geo.padded(g, x)
    perm = [1, 0] + spatial
    if group == 1:
        a = g.Transpose(xp, perm=perm)
    else:
        ws = g.shape(w)
        if ws is None or not isinstance(ws[1], int):
            raise GradientRuleError(f"the weight gradient of a grouped Conv needs the input channels per group of "
                                    f"{w!r} (its dim 1) to be static; run shape inference or annotate"
                                    " the weight's shape")
        cg = ws[1]
        dims = g.Shape(xp)
        split = g.Reshape(xp, g.Concat(g.Slice(dims, g.ints([0]), g.ints([1])), g.ints([group, cg]),
                                       g.Slice(dims, g.ints([2]), g.ints([2 + r])), axis=0))
        a = g.Transpose(split, perm=[2, 1, 0] + [3 + i for i in range(r)])  # [Cg, G, N, *spatial]
        a = g.Reshape(a, g.Concat(g.ints([cg, -1]), g.Slice(dims, g.ints([2]), g.ints([2 + r])), axis=0))
    wg = g.Conv(a, g.Transpose(dz, perm=perm), strides=geo.dilations, dilations=geo.strides,
                group=group if group > 1 else None)
    wg = g.slice(wg, [0] * r, geo.kernel, spatial)
    return g.Transpose(wg, perm=perm)


def average_pool_grad_dynamic(g, node, dz: str) -> str:
    """dz / count spread back over each window, per channel. ``1 / count`` is AveragePool of ones over
    x's run-time size (whatever count_include_pad and ceil_mode make the divisor) over the number of
    real elements in each window, a Conv of those ones by a ones kernel with the forward's pads (the
    end pad grown by stride - 1 under ceil_mode, then cut to the output's size)."""
    x = node.inputs[0]
    kernel = list(node.attr("kernel_shape"))
    g.require(13, "the AveragePool gradient for spatial dims known only at run time")
    geo = _Geometry(g, node, x, kernel)
    r, spatial = geo.r, geo.spatial
    dt = g.np_dtype(x)
    ones = g.full(g.Concat(g.ints([1, 1]), geo.size, axis=0), 1.0, x)
    attrs = {k: node.attr(k) for k in ("kernel_shape", "strides", "pads", "dilations", "ceil_mode", "auto_pad",
                                       "count_include_pad") if node.has_attr(k)}
    pooled_ones = g.op("AveragePool", ones, **attrs)
    ceil = node.attr("ceil_mode", 0)
    taps = g.const(np.ones([1, 1] + kernel), dtype=dt)
    if isinstance(geo.pads, str):
        real = g.Conv(ones, taps, strides=geo.strides, dilations=geo.dilations, auto_pad=_auto_pad(node))
    else:
        ends = [e + (s - 1 if ceil else 0) for e, s in zip(geo.pads[r:], geo.strides)]
        real = g.Conv(ones, taps, strides=geo.strides, dilations=geo.dilations, pads=geo.pads[:r] + ends)
        if ceil:
            out = g.Slice(g.Shape(pooled_ones), g.ints([2]), g.ints([2 + r]))
            real = g.Slice(real, g.ints([0] * r), out, g.ints(spatial))
    inv_count = g.Div(pooled_ones, g.Max(real, g.const(1.0, like=x)))
    flat = g.Reshape(dz, g.Concat(g.ints([-1, 1]), g.Slice(g.Shape(dz), g.ints([2]), g.ints([2 + r])), axis=0))
    dx = geo.input_grad(g, g.Mul(flat, inv_count), taps, 1)
    return g.Reshape(dx, g.Shape(x))

