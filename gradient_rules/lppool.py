"""LpPool and GlobalLpPool: y = (sum over the window of |x|^p)^(1/p).

dx = sign(x) |x|^(p-1) * W^T(dy * y^(1-p)), where W^T spreads each window's value back over its
taps (a per-channel ConvTranspose with a ones kernel, as for AveragePool; the global form is a
broadcast). Where y = 0 (a window of zeros) the gradient is not defined.
"""
from __future__ import annotations

import numpy as np

from gradient_rules.pool_conv import window
from onnx_autodiff.engine.builder import GradBuilder, Grads, NodeView
from onnx_autodiff.engine.registry import gradient_rule


def _p(node) -> float:
    return float(node.attr("p", 2 if node.opset >= 2 else 2.0))


def _local_factor(g, x: str, p: float) -> str:
    """d|x|^p / dx divided by p: sign(x) |x|^(p-1)."""
    if p == 2.0:
        return x
    if p == 1.0:
        return g.sign(x)
    return g.Mul(g.sign(x), g.Pow(g.Abs(x), g.const(p - 1.0, like=x)))


def _outer(g, dz: str, y: str, p: float) -> str:
    """dy * y^(1-p)."""
    if p == 1.0:
        return dz
    if p == 2.0:
        return g.Div(dz, y)
    return g.Mul(dz, g.Pow(y, g.const(1.0 - p, like=y)))


@gradient_rule("LpPool")
def lp_pool_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    dz, = dy
    x, y = node.inputs[0], node.outputs[0]
    p = _p(node)
    win = window(g, node, x, node.attr("kernel_shape"), y, ceil_mode=node.attr("ceil_mode", 0))
    dt = g.np_dtype(x)
    spread_in = g.Reshape(_outer(g, dz, y, p), g.ints([-1, 1] + win.out))
    pads, extra = win.transpose_pads()
    spread = g.ConvTranspose(spread_in, g.const(np.ones([1, 1] + win.kernel), dtype=dt), strides=win.strides,
                             dilations=win.dilations if any(d != 1 for d in win.dilations) else None, pads=pads,
                             output_padding=extra if any(extra) else None)
    return [g.Mul(g.Reshape(spread, g.shape_of(x)), _local_factor(g, x, p))]


@gradient_rule("GlobalLpPool")
def global_lp_pool_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    dz, = dy
    x, y = node.inputs[0], node.outputs[0]
    p = _p(node)
    return [g.Mul(_outer(g, dz, y, p), _local_factor(g, x, p))]
