"""The static geometry of a sliding window (Conv, ConvTranspose and the pools): kernel, strides,
dilations, the pads auto_pad makes explicit, and the input and output spatial sizes."""
from __future__ import annotations

import math
from dataclasses import dataclass

from onnx_autodiff.rule_api import GradientRuleError


@dataclass
class Window:
    """The static geometry of a sliding window over the spatial axes (explicit pads, no auto_pad)."""

    kernel: list[int]
    strides: list[int]
    dilations: list[int]
    begins: list[int]
    ends: list[int]
    size: list[int]  # spatial input size
    out: list[int]  # spatial output size

    @property
    def rank(self) -> int:
        return len(self.kernel)

    @property
    def extent(self) -> list[int]:
        return [(k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations)]

    def transpose_pads(self) -> tuple[list[int], list[int]]:
        """(pads, output_padding) for a ConvTranspose from the output grid back to exactly ``size``.

        It starts at the forward begin pad; the end is cropped, or zero-extended by output padding
        when the last input elements were never in a window (stride not dividing the size).
        """
        ends, extra = [], []
        for s, o, e, b, n in zip(self.strides, self.out, self.extent, self.begins, self.size):
            end = s * (o - 1) + e - b - n
            ends.append(max(end, 0))
            extra.append(max(-end, 0))
        return self.begins + ends, extra


def spatial_dims(g, x: str, node) -> list[int]:
    shape = g.shape(x)
    if shape is None or any(not isinstance(d, int) for d in shape[2:]):
        raise GradientRuleError(f"the gradient needs the spatial dims of {x!r} to be static, got {shape}; "
                         "run shape inference or give the model fixed spatial sizes")
    return list(shape[2:])


def window(g, node, x: str, kernel, y: str | None = None, *, ceil_mode: int = 0) -> Window:
    """The window geometry of a Conv or pooling node over input ``x``, auto_pad made explicit."""
    size = spatial_dims(g, x, node)
    r = len(size)
    kernel = list(kernel)
    strides = list(node.attr("strides", [1] * r))
    dilations = list(node.attr("dilations", [1] * r))
    extent = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    auto_pad = node.attr("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begins, ends = [], []
        for n, s, e in zip(size, strides, extent):
            total = max((math.ceil(n / s) - 1) * s + e - n, 0)
            small, big = total // 2, total - total // 2
            begins.append(small if auto_pad == "SAME_UPPER" else big)
            ends.append(big if auto_pad == "SAME_UPPER" else small)
    elif auto_pad == "VALID":
        begins, ends = [0] * r, [0] * r
    else:
        pads = list(node.attr("pads", [0] * (2 * r)))
        begins, ends = pads[:r], pads[r:]
    yshape = g.shape(y) if y else None
    if yshape is not None and all(isinstance(d, int) for d in yshape[2:]):
        out = list(yshape[2:])
    else:
        rnd = math.ceil if ceil_mode else math.floor
        out = [int(rnd((n + b + e - x_) / s)) + 1 for n, b, e, x_, s in zip(size, begins, ends, extent, strides)]
    return Window(kernel, strides, dilations, begins, ends, size, out)

