"""Convolution and pooling: Conv, ConvTranspose, MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool.

A convolution is linear in each argument, so its gradients are convolutions again: the input
gradient of Conv is a ConvTranspose with the same weights, its weight gradient a Conv of the input
by the output gradient with batch and channel axes swapped (strides and dilations trade places), and
ConvTranspose is the same pair the other way round. Pooling gradients send dy back through the
window that produced it. With static spatial dims, pads, output padding and crops are worked out when
the rule runs; batch and channel dims may be symbolic (except under ``group > 1``). Conv and
AveragePool with spatial dims known only at run time go to conv_dynamic.py; MaxPool scatters at its
Indices output.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
from onnx import numpy_helper

from onnx_autodiff.engine.builder import GradBuilder, Grads, NodeView
from onnx_autodiff.engine.registry import gradient_rule
from onnx_autodiff.errors import GradientRuleError

from .conv_dynamic import average_pool_grad_dynamic, conv_grad_dynamic

# The weight gradient of a one-group Conv as Gemms over strided slices (``_weight_grad_gemms``); False
# emits the plain Conv-by-dz form everywhere (tests compare the two).
GEMM_WEIGHT_GRAD = True
# Below this many im2col columns (input channels x kernel offsets) the Gemm form builds the columns and
# runs one Gemm instead of one per kernel offset.
IM2COL_COLUMNS = 256

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


def _spatial(g, x: str, node) -> list[int]:
    shape = g.shape(x)
    if shape is None or any(not isinstance(d, int) for d in shape[2:]):
        raise GradientRuleError(f"{node}: the gradient needs the spatial dims of {x!r} to be static, got {shape}; "
                         "run shape inference or give the model fixed spatial sizes")
    return list(shape[2:])


def window(g, node, x: str, kernel, y: str | None = None, *, ceil_mode: int = 0) -> Window:
    """The window geometry of a Conv or pooling node over input ``x``, auto_pad made explicit."""
    size = _spatial(g, x, node)
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


def _perm(first: list[int], r: int) -> list[int]:
    return first + list(range(len(first), len(first) + r))


def correlate(g, x: str, dz: str, win: Window, group: int, x_per_group: int, dz_per_group: int) -> str:
    """The weight gradient ``w[j, c, k] = sum_{n,o} dz[n, j, o] * x[n, grp(j)*Cg + c, o*s + k*d - b]``.

    Shaped ``[channels of dz, x_per_group, *kernel]``: a Conv of x (batch as channels) by dz (batch as
    input channels), strides and dilations swapped, grouped when the forward conv was.
    """
    r = win.rank
    if GEMM_WEIGHT_GRAD and group == 1 and g.opset >= 11 and min(win.begins + win.ends) >= 0:
        return _weight_grad_gemms(g, x, dz, win)
    if group == 1:
        xt = g.Transpose(x, perm=_perm([1, 0], r))
        dzt = g.Transpose(dz, perm=_perm([1, 0], r))
    else:
        xt = g.Reshape(x, g.ints([0, group, x_per_group] + win.size))
        xt = g.Transpose(xt, perm=_perm([2, 1, 0], r))
        xt = g.Reshape(xt, g.ints([x_per_group, -1] + win.size))
        dzt = g.Reshape(dz, g.ints([0, group, dz_per_group] + win.out))
        dzt = g.Transpose(dzt, perm=_perm([1, 2, 0], r))
        dzt = g.Reshape(dzt, g.ints([group * dz_per_group, -1] + win.out))
    ends, lengths = [], []
    for n, b, o, s, k, d in zip(win.size, win.begins, win.out, win.strides, win.kernel, win.dilations):
        end = max((k - 1) * d + (o - 1) * s + 1 - n - b, 0)
        ends.append(end)
        lengths.append((n + b + end - (o - 1) * s - 1) // d + 1)
    w = g.Conv(xt, dzt, group=group, strides=win.dilations, dilations=win.strides, pads=win.begins + ends)
    if lengths != win.kernel:
        axes = list(range(2, 2 + r))
        w = g.slice(w, [0] * r, win.kernel, axes)
    return g.Transpose(w, perm=_perm([1, 0], r))


def _weight_grad_gemms(g, x: str, dz: str, win: Window) -> str:
    """The weight gradient (one group) as one Gemm per kernel offset: ``w[:, :, k] = dz2 @ x_k`` with
    dz2 = dz as [M, out*N] and x_k the (padded) input sliced at offset k*d with the stride, as [out*N, C].

    x and dz are first laid out spatial-first, batch and channels last ([*spatial, N, C]), so each x_k is
    a Slice over the outer axes only: it copies long contiguous runs (N*C elements or more), where the
    channels-first layout would copy runs of one output row. The same FLOPs as the Conv-by-dz form of
    ``correlate`` in well-shaped matrix products; that form has a kernel as large as the output and runs
    through a runtime's generic (im2col) path.
    """
    r = win.rank
    kernel = list(win.kernel)
    offsets = list(itertools.product(*[range(k) for k in kernel]))
    channels = (g.shape(x) or [None, None])[1]
    dz2 = g.Reshape(g.Transpose(dz, perm=[1] + list(range(2, 2 + r)) + [0]), g.ints([0, -1]))  # [M, out*N],
    # once: a transposed Gemm operand would be transposed again for every offset
    if len(offsets) > 1 and isinstance(channels, int) and channels * len(offsets) <= IM2COL_COLUMNS:
        # few input channels (a stem conv): one Gemm over explicit im2col rows [K*C, out*N] reads dz once,
        # where a Gemm per offset would be a thin product reading all of dz K times
        xt = _padded(g, g.Transpose(x, perm=[1] + list(range(2, 2 + r)) + [0]), win, first=1)  # [C, *size, N]
        rows = g.Concat(*[_offset_slice(g, xt, win, k, first=1) for k in offsets], axis=0)  # [K*C, *out, N]
        w = g.Gemm(dz2, g.Reshape(rows, g.ints([channels * len(offsets), -1])), transB=1)  # [M, K*C]
        w = g.Transpose(g.Reshape(w, g.ints([0, len(offsets), channels])), perm=[0, 2, 1])
        return g.Reshape(w, g.ints([0, 0] + kernel))
    xt = _padded(g, g.Transpose(x, perm=list(range(2, 2 + r)) + [0, 1]), win, first=0)  # [*size, N, C]
    x_rows = _rows(g, x)
    cols = [g.unsqueeze(g.Gemm(dz2, g.Reshape(_offset_slice(g, xt, win, k, first=0), x_rows)), [2])
            for k in offsets]  # [M, C, 1] each
    w = cols[0] if len(cols) == 1 else g.Concat(*cols, axis=2)
    return g.Reshape(w, g.ints([0, 0] + kernel))


def _padded(g, xt: str, win: Window, first: int) -> str:
    """xt (spatial axes from ``first`` on, two other axes) padded by the window's pads."""
    if not any(win.begins) and not any(win.ends):
        return xt
    rest = [0] * (2 + win.rank - first - win.rank)
    return g.Pad(xt, g.ints([0] * first + win.begins + rest + [0] * first + win.ends + rest))


def _offset_slice(g, xt: str, win: Window, offset, first: int) -> str:
    """The padded input at kernel offset ``offset``, every stride-th position: the im2col block of one
    offset, spatial axes from ``first`` on."""
    padded = [n + b + e for n, b, e in zip(win.size, win.begins, win.ends)]
    starts = [o * d for o, d in zip(offset, win.dilations)]
    ends = [st + (n - 1) * s + 1 for st, n, s in zip(starts, win.out, win.strides)]
    if all(st == 0 and e == n and s == 1 for st, e, n, s in zip(starts, ends, padded, win.strides)):
        return xt
    axes = list(range(first, first + win.rank))
    return g.Slice(xt, g.ints(starts), g.ints(ends), g.ints(axes),
                   g.ints(win.strides) if any(s != 1 for s in win.strides) else None)


def _rows(g, t: str) -> str:
    """The Reshape target ``[-1, channels of t]`` (t is [N, C, ...]; C static or read at run time)."""
    shape = g.shape(t)
    if shape is not None and isinstance(shape[1], int):
        return g.ints([-1, shape[1]])
    return g.Concat(g.ints([-1]), g.Slice(g.Shape(t), g.ints([1]), g.ints([2])), axis=0)


def _bias_grad(g, dz: str, r: int) -> str:
    return g.reduce_sum(dz, [0] + list(range(2, 2 + r)), keepdims=False)


def _kernel(g, node, w: str) -> list[int]:
    kernel = node.attr("kernel_shape")
    if kernel is None:
        ws = g.shape(w)
        if ws is None or any(not isinstance(d, int) for d in ws[2:]):
            raise GradientRuleError(f"{node}: the kernel shape of {w!r} must be static (or set kernel_shape)")
        kernel = ws[2:]
    return list(kernel)


def _weight_dims(g, node, w: str) -> tuple[int, int]:
    ws = g.shape(w)
    if ws is None or not isinstance(ws[0], int) or not isinstance(ws[1], int):
        raise GradientRuleError(f"{node}: the gradient of a grouped convolution needs static channel dims of {w!r}")
    return ws[0], ws[1]


@gradient_rule("Conv")
def conv_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    dz, = dy
    x, w = node.inputs[:2]
    group = node.attr("group", 1)
    shape = g.shape(x)
    if shape is not None and any(not isinstance(d, int) for d in shape[2:]):
        return conv_grad_dynamic(g, node, dy, _kernel(g, node, w))
    win = window(g, node, x, _kernel(g, node, w), node.outputs[0])
    grads = [None] * len(node.inputs)
    if node.needs_grad(0):
        grads[0] = _conv_input_grad(g, dz, w, win, group)
    if node.needs_grad(1):
        m, cg = _weight_dims(g, node, w) if group > 1 else (0, 0)
        grads[1] = correlate(g, x, dz, win, group, cg, m // group if group > 1 else 0)
    if node.input(2) and node.needs_grad(2):
        grads[2] = _bias_grad(g, dz, win.rank)
    return grads


def _conv_input_grad(g, dz: str, w: str, win: Window, group: int) -> str:
    """The input gradient of a Conv: a ConvTranspose with the same weights; for stride 1 and one group a
    plain Conv of dz with the kernel flipped and its two channel axes swapped, which runtimes run much
    faster (onnxruntime's CPU ConvTranspose is a GEMM plus col2im, its Conv has blocked kernels).

    With stride 1, ``dx[i] = sum_k dz[i - k*d + b] w[k] = sum_k dzpad[i + k*d] w[K-1-k]`` for begin pad
    ``extent - 1 - b`` and end pad ``extent - 1 - e``.
    """
    begins = [e - 1 - b for e, b in zip(win.extent, win.begins)]
    ends = [e - 1 - b for e, b in zip(win.extent, win.ends)]
    if group != 1 or any(s != 1 for s in win.strides) or min(begins + ends) < 0 or g.opset < 10:
        pads, extra = win.transpose_pads()
        return g.ConvTranspose(dz, w, group=group, strides=win.strides, dilations=win.dilations, pads=pads,
                               output_padding=extra if any(extra) else None)
    r = win.rank
    flipped = g.Transpose(w, perm=_perm([1, 0], r))
    if any(k > 1 for k in win.kernel):
        axes = [2 + i for i in range(r) if win.kernel[i] > 1]
        big = np.iinfo(np.int64).max
        flipped = g.Slice(flipped, g.ints([-1] * len(axes)), g.ints([-big] * len(axes)), g.ints(axes),
                          g.ints([-1] * len(axes)))
    return g.Conv(dz, flipped, dilations=win.dilations if any(d != 1 for d in win.dilations) else None,
                  pads=begins + ends)


def _transpose_window(g, node, x: str, w: str, y: str) -> Window:
    """ConvTranspose geometry seen as the Conv it is the adjoint of: input y, output x."""
    kernel = _kernel(g, node, w)
    size_in = _spatial(g, x, node)
    size_out = _spatial(g, y, node)
    r = len(kernel)
    strides = list(node.attr("strides", [1] * r))
    dilations = list(node.attr("dilations", [1] * r))
    auto_pad = node.attr("auto_pad", "NOTSET")
    if auto_pad != "NOTSET" or node.has_attr("output_shape"):
        raise GradientRuleError(f"{node}: the ConvTranspose gradient supports explicit pads and output_padding only "
                         "(auto_pad and output_shape are not handled yet)")
    pads = list(node.attr("pads", [0] * (2 * r)))
    return Window(kernel, strides, dilations, pads[:r], pads[r:], size_out, size_in)


@gradient_rule("ConvTranspose")
def conv_transpose_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    dz, = dy
    x, w = node.inputs[:2]
    group = node.attr("group", 1)
    win = _transpose_window(g, node, x, w, node.outputs[0])
    grads = [None] * len(node.inputs)
    if node.needs_grad(0):
        grads[0] = g.Conv(dz, w, group=group, strides=win.strides, dilations=win.dilations,
                          pads=win.begins + win.ends)
    if node.needs_grad(1):
        c, mg = _weight_dims(g, node, w) if group > 1 else (0, 0)
        grads[1] = correlate(g, dz, x, win, group, mg, c // group if group > 1 else 0)
    if node.input(2) and node.needs_grad(2):
        grads[2] = _bias_grad(g, dz, win.rank)
    return grads


def _scatter_add(g, x: str, dz: str, indices: str, overlapping: bool) -> str:
    """dz added into a zero tensor shaped like x at the flat positions ``indices``."""
    flat = g.ints([-1])
    size = g.static_shape(x)
    numel = g.ints([int(np.prod(size))]) if size is not None else g.Reshape(g.Size(x), g.ints([1]))
    zeros = g.op("ConstantOfShape", numel, value=_scalar_tensor(g, x, 0.0))
    out = g.scatter_elements(zeros, g.Reshape(indices, flat), g.Reshape(dz, flat), axis=0, add=overlapping)
    return g.Reshape(out, g.shape_of(x))


def _scalar_tensor(g, like: str, value: float):
    return numpy_helper.from_array(np.array([value], dtype=g.np_dtype(like)))


def _offset_kernels(win: Window, dtype) -> np.ndarray:
    """One one-hot kernel per window offset, ``[K, 1, *kernel]`` (K offsets in row-major order)."""
    k = int(np.prod(win.kernel))
    return np.eye(k, dtype=dtype).reshape([k, 1] + list(win.kernel))


def _max_pool_masks(g, x: str, y: str, dz: str, win: Window) -> str:
    """The MaxPool gradient with standard ops of every opset: dy goes to the first maximum of its
    window (PyTorch's and onnxruntime's tie rule), found offset by offset.

    A Conv with one one-hot kernel per window offset k lays out ``x_k``, the element at offset k of
    every window (x zero-padded; a static mask drops the taps that fall into padding); ``x_k == y``
    marks the maxima, and ``Relu(hit_k - hits before k)`` keeps the first. The gradient is the
    ConvTranspose of ``mask_k * dy`` by the same kernels: each window sends its dy back to its first
    maximum, and overlapping windows add up. Needs the spatial dims static and x finite.
    """
    r, dt = win.rank, g.np_dtype(x)
    planes = g.Reshape(x, g.ints([-1, 1] + win.size))  # (N*C, 1, *size)
    reach = [(o - 1) * s + e for o, s, e in zip(win.out, win.strides, win.extent)]
    ends = [max(rc - b - n, 0) for rc, b, n in zip(reach, win.begins, win.size)]
    padded = g.pad(planes, [0, 0] + win.begins + [0, 0] + ends)
    kernels = g.const(_offset_kernels(win, dt))
    k = int(np.prod(win.kernel))
    dil = win.dilations if any(d != 1 for d in win.dilations) else None
    taps = g.Conv(padded, kernels, strides=win.strides, dilations=dil)  # (N*C, K, *out)
    ys = g.Reshape(y, g.ints([-1, 1] + win.out))
    inside = g.const(_taps_inside(win, dt))  # (1, K, *out)
    hits = g.Mul(g.Cast(g.Not(g.Less(taps, ys)), to=g.dtype(x)), inside)  # taps <= y: equal where not less
    earlier = g.const(np.tril(np.ones((k, k), dtype=dt), -1).reshape(k, k, *([1] * r)))
    first = g.Relu(g.Sub(hits, g.Conv(hits, earlier)))
    sent = g.Mul(first, g.Reshape(dz, g.ints([-1, 1] + win.out)))
    back = g.ConvTranspose(sent, kernels, strides=win.strides, dilations=dil)  # (N*C, 1, *reach)
    short = [max(b + n - rc, 0) for rc, b, n in zip(reach, win.begins, win.size)]
    back = g.pad(back, [0] * (2 + r) + [0, 0] + short)
    spatial = list(range(2, 2 + r))
    back = g.slice(back, win.begins, [b + n for b, n in zip(win.begins, win.size)], spatial)
    return g.Reshape(back, g.shape_of(x))


def _taps_inside(win: Window, dtype) -> np.ndarray:
    """``[1, K, *out]``: 1 where window offset k of an output position lies inside the unpadded input."""
    per_axis = []
    for n, b, o, s, k, d in zip(win.size, win.begins, win.out, win.strides, win.kernel, win.dilations):
        taps = np.arange(o)[None, :] * s - b + np.arange(k)[:, None] * d  # (k, o)
        per_axis.append((taps >= 0) & (taps < n))
    inside = per_axis[0]
    for a in per_axis[1:]:
        inside = _outer(inside, a)
    k = int(np.prod(win.kernel))
    return inside.reshape([1, k] + list(win.out)).astype(dtype)


def _outer(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Kernel-axes-first outer product of two (kernel..., out...) masks: (ka..., kb, oa..., ob)."""
    ra = a.ndim // 2
    left = a.reshape(a.shape[:ra] + (1,) + a.shape[ra:] + (1,))
    right = b.reshape((1,) * ra + (b.shape[0],) + (1,) * ra + (b.shape[1],))
    return left & right


@gradient_rule("MaxPool")
def max_pool_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """dy goes back to the maximum of its window: scatter-added at the Indices output (opset 16, or any
    opset from 9 when windows do not overlap), else through per-offset masks (static spatial dims)."""
    dz = dy[0]
    if dz is None:
        return [None]
    x = node.inputs[0]
    win = _max_pool_window(g, node, x)
    overlapping = any(s < e for s, e in zip(win.strides, win.extent)) if win else True
    if win is not None and (g.opset < 16 if overlapping else g.opset < 9):
        return [_max_pool_masks(g, x, node.outputs[0], dz, win)]
    if win is None and g.opset < 16:
        g.needs_opset(16, "the MaxPool gradient for spatial dims known only at run time")
    indices = node.output(1)
    if indices is None or node.attr("storage_order", 0) != 0:
        attrs = {k: node.attr(k) for k in ("kernel_shape", "strides", "pads", "dilations", "ceil_mode", "auto_pad")
                 if node.has_attr(k)}
        _, indices = g.op("MaxPool", x, outputs=2, **attrs)
    if not overlapping and UNPOOL_DISJOINT and win is not None and _unpool_fits(win) and g.has_op("MaxUnpool"):
        return [_unpool(g, x, dz, indices, win)]
    return [_scatter_add(g, x, dz, indices, overlapping)]


UNPOOL_DISJOINT = True  # tests switch it off to compare with the scatter form


def _unpool_fits(win: Window) -> bool:
    """MaxUnpool's own output size, ``(out - 1) * stride - pads + kernel``, is x's: the windows reach the
    end of every spatial axis (onnx's reference MaxUnpool mis-places values for any other output_shape)."""
    tiled = all(s * (o - 1) + k - b - e == n for s, o, k, b, e, n in
                zip(win.strides, win.out, win.kernel, win.begins, win.ends, win.size))
    return tiled and all(d == 1 for d in win.dilations)


def _unpool(g, x: str, dz: str, indices: str, win: Window) -> str:
    """dz put at ``indices`` in zeros shaped like x by one MaxUnpool, which writes the zeros and the values
    in one kernel: about 0.3x the time of ConstantOfShape + ScatterElements in onnxruntime. Indices of
    non-overlapping windows never repeat, so MaxUnpool's assignment is the scatter's sum."""
    return g.op("MaxUnpool", dz, indices, g.shape_of(x), kernel_shape=list(win.kernel), strides=list(win.strides),
                pads=win.begins + win.ends if any(win.begins + win.ends) else None)


@gradient_rule("MaxUnpool", since=9)
def max_unpool_grad(g, node, dy):
    """Y is X placed at the flat positions I of a zero tensor: dX gathers dY at I. Repeated indices
    (which MaxUnpool resolves by one write winning) each get the gradient of their position."""
    dz, = dy
    x, indices = node.inputs[0], node.inputs[1]
    flat = g.ints([-1])
    picked = g.Gather(g.Reshape(dz, flat), g.Reshape(indices, flat), axis=0)
    return [g.Reshape(picked, g.shape_of(x)), None, None][:len(node.inputs)]


def _max_pool_window(g, node, x: str) -> Window | None:
    shape = g.shape(x)
    if shape is None or any(not isinstance(d, int) for d in shape[2:]):
        return None
    return window(g, node, x, node.attr("kernel_shape"), node.outputs[0], ceil_mode=node.attr("ceil_mode", 0))


@gradient_rule("AveragePool")
def average_pool_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """dy / count spread over each window by a ConvTranspose with a ones kernel, per channel.

    ``1 / count`` (whatever count_include_pad and ceil_mode make it) is AveragePool of ones divided
    by the number of real elements in each window, which is known statically.
    """
    dz, = dy
    x = node.inputs[0]
    shape = g.shape(x)
    if shape is not None and any(not isinstance(d, int) for d in shape[2:]):
        return [average_pool_grad_dynamic(g, node, dz)]
    win = window(g, node, x, node.attr("kernel_shape"), node.outputs[0], ceil_mode=node.attr("ceil_mode", 0))
    dt = g.np_dtype(x)
    attrs = {k: node.attr(k) for k in ("kernel_shape", "strides", "pads", "dilations", "ceil_mode", "auto_pad",
                                       "count_include_pad") if node.has_attr(k)}
    pooled_ones = g.op("AveragePool", g.const(np.ones([1, 1] + win.size), dtype=dt), **attrs)
    inv_count = g.Div(pooled_ones, g.const(_real_counts(win)[None, None], dtype=dt))
    scaled = g.Mul(g.Reshape(dz, g.ints([-1, 1] + win.out)), inv_count)
    pads, extra = win.transpose_pads()
    dx = g.ConvTranspose(scaled, g.const(np.ones([1, 1] + win.kernel), dtype=dt), strides=win.strides,
                         dilations=win.dilations if any(d != 1 for d in win.dilations) else None, pads=pads,
                         output_padding=extra if any(extra) else None)
    return [g.Reshape(dx, g.shape_of(x))]


def _real_counts(win: Window) -> np.ndarray:
    """How many elements of each output window lie inside the (unpadded) input."""
    per_axis = []
    for n, b, o, s, k, d in zip(win.size, win.begins, win.out, win.strides, win.kernel, win.dilations):
        starts = np.arange(o) * s - b
        taps = starts[:, None] + np.arange(k)[None, :] * d
        per_axis.append(((taps >= 0) & (taps < n)).sum(axis=1))
    counts = per_axis[0]
    for c in per_axis[1:]:
        counts = np.multiply.outer(counts, c)
    return counts.astype(np.float64)


@gradient_rule("GlobalAveragePool")
def global_average_pool_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    dz, = dy
    x, y = node.inputs[0], node.outputs[0]
    size = g.shape(x)
    if size is not None and all(isinstance(d, int) for d in size[2:]):
        count = g.const(float(np.prod(size[2:])), like=x)
    else:
        count = g.count(x, y)
    return [g.Div(g.expand_like(dz, x), count)]


@gradient_rule("GlobalMaxPool")
def global_max_pool_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """dy goes to the first maximum of each channel (ArgMax over the flattened spatial axes); below
    opset 11 (no ScatterElements) the MaxPool masks with one window as large as the input."""
    dz, = dy
    x = node.inputs[0]
    if g.opset < 11:
        size = g.shape(x)
        if size is None or any(not isinstance(d, int) for d in size[2:]):
            g.needs_opset(11, "the GlobalMaxPool gradient for spatial dims known only at run time")
        r = len(size) - 2
        win = Window(list(size[2:]), [1] * r, [1] * r, [0] * r, [0] * r, list(size[2:]), [1] * r)
        return [_max_pool_masks(g, x, node.outputs[0], dz, win)]
    flat = g.Reshape(x, g.ints([0, 0, -1]))
    where = g.ArgMax(flat, axis=2, keepdims=1)
    out = g.ScatterElements(g.zeros_like(flat), where, g.Reshape(dz, g.ints([0, 0, 1])), axis=2)
    return [g.Reshape(out, g.shape_of(x))]
