"""Convolution: Conv and ConvTranspose.

A convolution is linear in each argument, so its gradients are convolutions again: the input
gradient of Conv is a ConvTranspose with the same weights, its weight gradient a Conv of the input
by the output gradient with batch and channel axes swapped (strides and dilations trade places), and
ConvTranspose is the same pair the other way round. With static spatial dims, pads, output padding and
crops are worked out when the rule runs; batch and channel dims may be symbolic (except under
``group > 1``). Spatial dims known only at run time go to conv_dynamic.py.

The tangent needs no geometry at all: the same convolution of dx by W plus that of x by dW (and dB),
whatever the shapes, which is what makes second order through convolutions work (forward over reverse).
"""
from __future__ import annotations

import itertools

import numpy as np
import onnx

from onnx_autodiff.rule_api import GradBuilder, GradientRuleError, Grads, NodeView, gradient_rule, jvp_rule

from .conv_dynamic import conv_grad_dynamic
from .window import Window, spatial_dims, window

# Emitter options: ``gemm_weight_grad`` (default True), the weight gradient of a one-group Conv as Gemms over
# strided slices (``_weight_grad_gemms``; False emits the plain Conv-by-dz form everywhere, tests compare the
# two); ``im2col_columns`` (default 256): below this many im2col columns (input channels x kernel offsets)
# the Gemm form builds the columns and runs one Gemm instead of one per kernel offset; ``im2col_batched``
# (default True): for stride 1, those columns per sample, in x's and dz's own layout, by one batched product
# (False: dz transposed to [M, out*N] and one Gemm); ``flipped_conv_input_grad`` (default True): the input
# gradient at stride 1 and one group as a Conv of dz with the flipped kernel where the conv does not widen the
# channels (False: a ConvTranspose everywhere; ``python -m benchmarks.conv_grad_micro --input`` times the forms);
# ``batched_input_grad_max_out`` (default 16): up to this many output positions per sample, the input gradient
# (one group) as one Gemm over the whole batch and a per-offset scatter (``_input_grad_batched``; 0: the
# ConvTranspose / flipped-Conv forms everywhere); ``col2im_input_grad`` (default True): at opset >= 18 that
# batched form of a 2-D conv scatters by one Col2Im instead of the per-offset Pads where the target has it
# (``_input_grad_col2im``; False: the Pads);
# ``im2col_weight_grad_max_out`` (default 4): up to this many output positions per sample the weight gradient
# takes the im2col rows and one Gemm whatever the channels (0: by ``im2col_columns`` alone).
IM2COL_COLUMNS = 256
IM2COL_WEIGHT_GRAD_MAX_OUT = 4
BATCHED_INPUT_GRAD_MAX_OUT = 16


def _perm(first: list[int], r: int) -> list[int]:
    return first + list(range(len(first), len(first) + r))


def correlate(g, x: str, dz: str, win: Window, group: int, x_per_group: int, dz_per_group: int) -> str:
    """The weight gradient ``w[j, c, k] = sum_{n,o} dz[n, j, o] * x[n, grp(j)*Cg + c, o*s + k*d - b]``.

    Shaped ``[channels of dz, x_per_group, *kernel]``: a Conv of x (batch as channels) by dz (batch as
    input channels), strides and dilations swapped, grouped when the forward conv was.
    """
    r = win.rank
    if g.option("gemm_weight_grad", True) and group == 1 and g.opset >= 11 and min(win.begins + win.ends) >= 0:
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
    narrow = isinstance(channels, int) and channels * len(offsets) <= g.option("im2col_columns", IM2COL_COLUMNS)
    few = int(np.prod(win.out)) <= g.option("im2col_weight_grad_max_out", IM2COL_WEIGHT_GRAD_MAX_OUT)
    im2col = len(offsets) > 1 and isinstance(channels, int) and (narrow or few)
    if im2col and narrow and all(s == 1 for s in win.strides) and g.option("im2col_batched", True):
        return _weight_grad_im2col_batched(g, x, dz, win, offsets, channels)
    dz2 = g.Reshape(g.Transpose(dz, perm=[1] + list(range(2, 2 + r)) + [0]), g.ints([0, -1]))  # [M, out*N],
    # once: a transposed Gemm operand would be transposed again for every offset
    if im2col:
        # few input channels (a stem conv): one Gemm over explicit im2col rows [K*C, out*N] reads dz once,
        # where a Gemm per offset would be a thin product reading all of dz K times; few output positions
        # (ResNet's last stage, 2x2): the per-offset Gemms would each sum over only out*N rows
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


def _weight_grad_im2col_batched(g, x: str, dz: str, win: Window, offsets: list, channels: int) -> str:
    """The im2col weight gradient with x and dz in their own layout: per sample n, ``dz[n] @ rows[n]^T`` with
    rows[n] the [K*C, out] im2col block of x[n], summed over n. dz is only reshaped, where the [M, out*N] form
    transposes all of it (the largest tensor of the rule); the product is batched over n, and onnxruntime
    folds the rows' Transpose into it (FusedMatMul, transB). Stride 1 only: strided slices of the channels-first
    layout copy short runs (ResNet-18's 7x7/2 stem: 12% slower this way, the small CNN's first conv 36% faster)."""
    k = len(offsets)
    xp = _padded(g, x, win, first=2)  # [N, C, *padded]
    rows = g.Concat(*[_offset_slice(g, xp, win, o, first=2) for o in offsets], axis=1)  # [N, K*C, *out]
    rows = g.Reshape(rows, g.ints([0, channels * k, -1]))
    per_sample = g.MatMul(g.Reshape(dz, g.ints([0, 0, -1])), g.Transpose(rows, perm=[0, 2, 1]))  # [N, M, K*C]
    w = g.reduce_sum(per_sample, [0], keepdims=False)
    w = g.Transpose(g.Reshape(w, g.ints([0, k, channels])), perm=[0, 2, 1])
    return g.Reshape(w, g.ints([0, 0] + list(win.kernel)))


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


def _normalized_away(g, y: str) -> bool:
    """Whether the Conv output ``y`` is read only as the input of training-mode BatchNormalizations (and is no graph
    output): each subtracts its batch mean per channel, so a per-channel shift of y (the bias) changes nothing after
    them, and the bias gradient is zero exactly (the sum over batch and space of each one's input gradient is zero;
    computed, it is float rounding around zero that Adam's normalized step turns into a random walk of the bias).
    Emitter option ``conv_bias_before_batch_norm_zero`` False: the sum is computed (tests compare the two)."""
    if not g.option("conv_bias_before_batch_norm_zero", True) or y in g.em.view.graph_outputs:
        return False
    readers = g.consumers(y)
    return bool(readers) and all(_training_batch_norm_of(g, n, y) for n in readers)


def _zeros(g, b: str) -> str:
    shape = g.static_shape(b)
    return g.const(np.zeros(shape), like=b) if shape is not None else g.zeros_like(b)


def _training_batch_norm_of(g, node, y: str) -> bool:
    if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx") or list(node.input).count(y) != 1:
        return False
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if node.input[0] != y or attrs.get("spatial", 1) != 1:
        return False
    return bool(attrs.get("training_mode", 0)) if g.opset >= 14 else sum(1 for o in node.output if o) > 1


def _kernel(g, node, w: str) -> list[int]:
    kernel = node.attr("kernel_shape")
    if kernel is None:
        ws = g.shape(w)
        if ws is None or any(not isinstance(d, int) for d in ws[2:]):
            raise GradientRuleError(f"the kernel shape of {w!r} must be static (or set kernel_shape)")
        kernel = ws[2:]
    return list(kernel)


def _weight_dims(g, node, w: str) -> tuple[int, int]:
    ws = g.shape(w)
    if ws is None or not isinstance(ws[0], int) or not isinstance(ws[1], int):
        raise GradientRuleError(f"the gradient of a grouped convolution needs static channel dims of {w!r}")
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
        grads[2] = _zeros(g, node.inputs[2]) if _normalized_away(g, node.outputs[0]) else _bias_grad(g, dz, win.rank)
    return grads


def _conv_input_grad(g, dz: str, w: str, win: Window, group: int) -> str:
    """The input gradient of a Conv: a ConvTranspose with the same weights; for stride 1 and one group a
    plain Conv of dz with the kernel flipped and its two channel axes swapped, unless the conv widens the
    channels (the small CNN's 32 -> 64: ConvTranspose 0.6-0.8x the CPU time, weights as inputs as in a step);
    with few output positions per sample, ``_input_grad_batched``. Chosen by ``benchmarks/conv_grad_micro.py``.

    With stride 1, ``dx[i] = sum_k dz[i - k*d + b] w[k] = sum_k dzpad[i + k*d] w[K-1-k]`` for begin pad
    ``extent - 1 - b`` and end pad ``extent - 1 - e``.
    """
    small = int(np.prod(win.out)) <= g.option("batched_input_grad_max_out", BATCHED_INPUT_GRAD_MAX_OUT)
    if group == 1 and small and g.opset >= 11 and min(win.begins + win.ends) >= 0 and g.static_shape(w) is not None:
        # 2-D only: onnxruntime 1.32's Col2Im is wrong with dilations in 1-D and 3-D, OpenVINO's converts 2-D
        # only; tract lacks it
        if g.opset >= 18 and win.rank == 2 and g.option("col2im_input_grad", True) and g.has_op("Col2Im"):
            return _input_grad_col2im(g, dz, w, win)
        return _input_grad_batched(g, dz, w, win)
    begins = [e - 1 - b for e, b in zip(win.extent, win.begins)]
    ends = [e - 1 - b for e, b in zip(win.extent, win.ends)]
    ws = g.static_shape(w)
    widening = ws is not None and ws[1] < ws[0]  # fewer input than output channels: ConvTranspose measured faster
    if (group != 1 or any(s != 1 for s in win.strides) or min(begins + ends) < 0 or g.opset < 10
            or not g.option("flipped_conv_input_grad", True) or widening):
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


def _input_grad_batched(g, dz: str, w: str, win: Window) -> str:
    """The input gradient of a one-group Conv with few output positions (ResNet's last stages: 2x2, 4x4) as
    ``cols = dz @ W`` by one Gemm over the whole batch ([out*N, M] by [M, K*C]), each kernel offset's block of
    cols then put at its place in x (zeros between strided positions, a Pad per offset) and the offsets summed.
    onnxruntime's ConvTranspose and Conv make one product per sample, [C*K, M] by [M, out]: with out = 4 a
    matrix-vector product (docs/benchmarks.md, "Issue 38: the CNN's step (third session)"). The blocks are laid
    out spatial-first, batch and channels last ([K, *out, N*C]), so each Pad copies runs of N*C elements."""
    r = win.rank
    m, c = g.static_shape(w)[:2]
    k = int(np.prod(win.kernel))
    spatial = list(range(2, 2 + r))
    wk = g.Reshape(g.Transpose(w, perm=[0] + spatial + [1]), g.ints([m, k * c]))  # [M, K*C], offset-major
    dzs = g.Reshape(g.Transpose(dz, perm=spatial + [0, 1]), g.ints([-1, m]))  # [out*N, M]
    cols = g.Reshape(g.Gemm(dzs, wk), g.ints(win.out + [-1, k, c]))  # [*out, N, K, C]
    cols = g.Reshape(g.Transpose(cols, perm=[r + 1] + list(range(r)) + [r, r + 2]), g.ints([k] + win.out + [-1]))
    canvas = [o * s + (kk - 1) * d for o, s, kk, d in zip(win.out, win.strides, win.kernel, win.dilations)]
    parts = []
    offsets = itertools.product(*[range(kk) for kk in win.kernel])
    for offset, block in zip(offsets, g.split(cols, 0, [1] * k)):  # block: [1, *out, N*C]
        at = [o * d for o, d in zip(offset, win.dilations)]  # the block's first position on the canvas
        after = [cv - a - o * s for cv, a, o, s in zip(canvas, at, win.out, win.strides)]
        parts.append(g.pad(_spread(g, block, win), [0] + at + [0] + [0] + after + [0]))
    total = parts[0] if len(parts) == 1 else g.Sum(*parts)  # [1, *canvas, N*C]; canvas index i + begin is x's i
    more = [max(n + b - cv, 0) for n, b, cv in zip(win.size, win.begins, canvas)]
    total = g.pad(total, [0] * (2 + r) + [0] + more + [0])
    total = g.slice(total, win.begins, [b + n for b, n in zip(win.begins, win.size)], list(range(1, 1 + r)))
    return g.Transpose(g.Reshape(total, g.ints(win.size + [-1, c])), perm=[r, r + 1] + list(range(r)))


def _input_grad_col2im(g, dz: str, w: str, win: Window) -> str:
    """The batched input gradient at opset >= 18: ``cols = dz @ W`` by one Gemm over the whole batch ([N*out, M]
    by [M, C*K]), laid out as Col2Im's [N, C*K, out] and summed into x by one Col2Im (the window's own strides,
    dilations and pads), where ``_input_grad_batched`` scatters by a Pad per kernel offset and a Sum."""
    m, c = g.static_shape(w)[:2]
    k = int(np.prod(win.kernel))
    out = int(np.prod(win.out))
    dzs = g.Reshape(g.Transpose(g.Reshape(dz, g.ints([0, m, out])), perm=[0, 2, 1]), g.ints([-1, m]))  # [N*out, M]
    cols = g.Gemm(dzs, g.Reshape(w, g.ints([m, c * k])))  # [N*out, C*K], channel-major as Col2Im reads it
    cols = g.Transpose(g.Reshape(cols, g.ints([-1, out, c * k])), perm=[0, 2, 1])  # [N, C*K, out]
    return g.Col2Im(cols, g.ints(win.size), g.ints(win.kernel), dilations=win.dilations, strides=win.strides,
                    pads=win.begins + win.ends)


def _spread(g, block: str, win: Window) -> str:
    """A [1, *out, N*C] block with stride - 1 zeros after each position along each spatial axis."""
    if all(s == 1 for s in win.strides):
        return block
    r = win.rank
    split = g.Reshape(block, g.ints([1] + [v for o in win.out for v in (o, 1)] + [-1]))
    ends = [0] + [v for s in win.strides for v in (0, s - 1)] + [0]
    spread = g.pad(split, [0] * (2 + 2 * r) + ends)
    return g.Reshape(spread, g.ints([1] + [o * s for o, s in zip(win.out, win.strides)] + [-1]))


@gradient_rule("Col2Im", since=18)
def col2im_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Col2Im sums each column's blocks into the image, so its adjoint is im2col: dy padded by the pads, read at
    each block offset every stride-th position, stacked offset-minor under each channel ([N, C*K, L]). The Conv
    input gradient emits Col2Im at opset >= 18, so second order through a Conv needs this."""
    image, block = (g.value(n) for n in node.inputs[1:3])
    if image is None or block is None:
        raise GradientRuleError(f"the gradient of Col2Im {node.name!r} needs constant image_shape and block_shape "
                                "inputs")
    kernel, size = [int(v) for v in block], [int(v) for v in image]
    r = len(kernel)
    strides, dilations = list(node.attr("strides", [1] * r)), list(node.attr("dilations", [1] * r))
    pads = list(node.attr("pads", [0] * (2 * r)))
    extent = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    out = [(n + b + e - x) // s + 1 for n, b, e, x, s in zip(size, pads[:r], pads[r:], extent, strides)]
    win = Window(kernel, strides, dilations, pads[:r], pads[r:], size, out)
    padded = _padded(g, dy[0], win, first=2)  # [N, C, *padded]
    offsets = itertools.product(*[range(k) for k in kernel])
    blocks = [g.unsqueeze(_offset_slice(g, padded, win, o, first=2), [2]) for o in offsets]  # [N, C, 1, *out]
    cols = blocks[0] if len(blocks) == 1 else g.Concat(*blocks, axis=2)
    return [g.Reshape(cols, g.ints([0, -1, int(np.prod(out))]))]


@jvp_rule("Col2Im", since=18)
def col2im_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """Linear in its columns: the same op on their tangent."""
    return [g.same_op(node, dx[0], *node.inputs[1:])]


def _transpose_window(g, node, x: str, w: str, y: str) -> Window:
    """ConvTranspose geometry seen as the Conv it is the adjoint of: input y, output x."""
    kernel = _kernel(g, node, w)
    size_in = spatial_dims(g, x, node)
    size_out = spatial_dims(g, y, node)
    r = len(kernel)
    strides = list(node.attr("strides", [1] * r))
    dilations = list(node.attr("dilations", [1] * r))
    auto_pad = node.attr("auto_pad", "NOTSET")
    if auto_pad != "NOTSET" or node.has_attr("output_shape"):
        raise GradientRuleError("the ConvTranspose gradient supports explicit pads and output_padding only "
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



@jvp_rule("Conv", "ConvTranspose")
def conv_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """conv(dx, W) + conv(x, dW, dB), with the node's own attributes; dB alone is broadcast."""
    d_in, d_w, d_b = list(dx) + [None] * (3 - len(dx))
    x, w = node.inputs[:2]
    y = node.outputs[0]
    terms = [g.same_op(node, d_in, w)] if d_in else []
    if d_w:
        terms.append(g.same_op(node, x, d_w, *([d_b] if d_b else [])))
    elif d_b:
        rank = g.need_rank(y)
        terms.append(g.expand_like(g.unsqueeze(d_b, list(range(1, rank - 1))), y))
    return [terms[0] if len(terms) == 1 else g.Add(*terms)]
