"""Pooling: MaxPool, MaxUnpool, AveragePool, GlobalAveragePool, GlobalMaxPool, LpPool, GlobalLpPool.

Pooling gradients send dy back through the window that produced it: MaxPool to the maximum (scattered
at its Indices output, or found by per-offset masks), AveragePool spread evenly by a ConvTranspose with
a ones kernel. LpPool, y = (sum over the window of |x|^p)^(1/p), has
dx = sign(x) |x|^(p-1) * W^T(dy * y^(1-p)), W^T spreading each window's value back over its taps as for
AveragePool (the global form is a broadcast); where y = 0 (a window of zeros) it is not defined.
AveragePool with spatial dims known only at run time goes to conv_dynamic.py.
"""
from __future__ import annotations

import itertools

import numpy as np
from onnx import helper

from onnx_autodiff.rule_api import GradBuilder, GradientRuleError, Grads, NodeView, gradient_rule, jvp_rule

from .conv_dynamic import average_pool_grad_dynamic
from .window import Window, window


def _scatter_add(g, x: str, dz: str, indices: str, overlapping: bool) -> str:
    """dz added into a zero tensor shaped like x at the flat positions ``indices``."""
    flat = g.ints([-1])
    size = g.static_shape(x)
    numel = g.ints([int(np.prod(size))]) if size is not None else g.Reshape(g.Size(x), g.ints([1]))
    zeros = g.full(numel, 0.0, x)
    out = g.scatter_elements(zeros, g.Reshape(indices, flat), g.Reshape(dz, flat), axis=0, add=overlapping)
    return g.Reshape(out, g.shape_of(x))


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


def _tiled(win: Window) -> bool:
    """The windows tile the input: stride = kernel, no padding, no dilation, every element in one window."""
    return (all(s == k for s, k in zip(win.strides, win.kernel)) and not any(win.begins + win.ends)
            and all(d == 1 for d in win.dilations)
            and all(n == o * k for n, o, k in zip(win.size, win.out, win.kernel)))


def _max_pool_tiled(g, x: str, y: str, dz: str, win: Window) -> str:
    """The MaxPool gradient of windows that tile the input, by comparing with the pooled maximum: the element
    at offset k of every window (a strided Slice of x) equal to y and to no earlier offset's gets dy (the first
    maximum, PyTorch's and onnxruntime's tie rule); the K offsets' parts are interleaved back into x's layout (square
    2-D windows: by one DepthToSpace). No MaxPool Indices, no Conv: on WebGPU (software adapter) about 30x faster
    than the per-offset masks, on the CPU as fast (benchmarks/maxpool_forms.py, docs/gpu.md)."""
    r = win.rank
    axes = list(range(2, 2 + r))
    zero = g.const(0.0, like=dz)
    parts, before = [], None  # before: no maximum at an earlier offset of the window
    for offset in itertools.product(*(range(k) for k in win.kernel)):
        hit = g.Equal(g.slice(x, list(offset), list(win.size), axes, list(win.strides)), y)
        first = hit if before is None else g.And(hit, before)
        before = g.Not(hit) if before is None else g.And(before, g.Not(hit))
        parts.append(g.Where(first, dz, zero))
    if r == 2 and win.kernel[0] == win.kernel[1]:  # offset k = row * b + col at channels k*C..: DepthToSpace's order
        return g.DepthToSpace(g.Concat(*parts, axis=1), blocksize=win.kernel[0], mode="DCR")
    stacked = g.Reshape(g.Concat(*[g.unsqueeze(p, [2 + r]) for p in parts], axis=2 + r),
                        g.ints([0, 0] + win.out + win.kernel))
    interleaved = g.Transpose(stacked, perm=[0, 1] + [a for i in range(r) for a in (2 + i, 2 + r + i)])
    return g.Reshape(interleaved, g.shape_of(x))


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
    opset from 9 when windows do not overlap), else through per-offset masks (static spatial dims). For a
    target without MaxPool's Indices (WebGPU): windows that tile the input compare with the pooled maximum,
    others take the per-offset masks."""
    dz = dy[0]
    if dz is None:
        return [None]
    x = node.inputs[0]
    win = _max_pool_window(g, node, x)
    overlapping = any(s < e for s, e in zip(win.strides, win.extent)) if win else True
    no_indices = not g.has_output("MaxPool", 1)
    if win is not None and no_indices and g.opset >= 11 and _tiled(win):
        return [_max_pool_tiled(g, x, node.outputs[0], dz, win)]
    if win is not None and (no_indices or (g.opset < 16 if overlapping else g.opset < 9)):
        return [_max_pool_masks(g, x, node.outputs[0], dz, win)]
    if win is None and no_indices:
        raise GradientRuleError("the target has no MaxPool Indices output, and its form of the MaxPool gradient "
                                f"needs the spatial dims of {x!r}, which are known only at run time; give the "
                                "model static spatial sizes")
    if win is None:
        g.require(16, "the MaxPool gradient for spatial dims known only at run time")
    indices = node.output(1)
    if indices is None or node.attr("storage_order", 0) != 0:
        attrs = {k: node.attr(k) for k in ("kernel_shape", "strides", "pads", "dilations", "ceil_mode", "auto_pad")
                 if node.has_attr(k)}
        _, indices = g.op("MaxPool", x, outputs=2, **attrs)
    unpool = g.option("unpool_disjoint", True) and g.has_op("MaxUnpool")
    if not overlapping and unpool and win is not None and _unpool_fits(win):
        return [_unpool(g, x, dz, indices, win)]
    return [_scatter_add(g, x, dz, indices, overlapping)]


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



def _p(node) -> float:
    return float(node.attr("p", 2))


def _local_factor(g, x: str, p: float) -> str:
    """d|x|^p / dx divided by p: sign(x) |x|^(p-1)."""
    if p == 2.0:
        return x
    if p == 1.0:
        return g.sign(x)
    return g.Mul(g.sign(x), g.Pow(g.Abs(x), g.const(p - 1.0, like=x)))


def _lp_spread_in(g, dz: str, y: str, p: float) -> str:
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
    spread_in = g.Reshape(_lp_spread_in(g, dz, y, p), g.ints([-1, 1] + win.out))
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
    return [g.Mul(_lp_spread_in(g, dz, y, p), _local_factor(g, x, p))]


# ---- tangents (forward mode) -----------------------------------------------------------------------
@jvp_rule("AveragePool", "GlobalAveragePool", "MaxUnpool")
def pool_linear_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """Linear in x: the same op on dx."""
    return [g.same_op(node, dx[0], *node.inputs[1:])]


@jvp_rule("MaxPool", since=8)
def max_pool_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """dx read at each window's maximum. Indices get no tangent.

    * Where the graph has the flat Indices already (the node's own, or another MaxPool of x with the same window:
      the gradient's, in ``hvp``), one GatherElements over the flattened dx reads them (``_gather_flat``).
    * Else square 2-D windows that tile the input take ``_max_pool_tiled_jvp`` (SpaceToDepth + ArgMax: 0.6x the
      CPU time of MaxPool with Indices, a slow kernel in onnxruntime; other forms without Indices were not
      faster: benchmarks/forward_forms.py, docs/benchmarks.md).
    * Else a MaxPool with Indices, and the gather.

    After a Relu whose output only MaxPools of this window read, the Relu's mask (x > 0) at each window's maximum is
    y > 0: it is applied to the pooled tangent (a quarter of the elements), and the Relu's tangent over the whole
    activation is left unused."""
    x, y = node.inputs[0], node.outputs[0]
    win = _max_pool_window(g, node, x)
    shared = g.option("max_pool_shared_indices", True)  # off: the form before (A/B in benchmarks.forward_mode)
    dz = _relu_input_tangent(g, node, x, shared)
    src = dx[0] if dz is None else dz
    indices = _indices_at_hand(g, node, x) if shared else None
    tiled = win is not None and win.rank == 2 and len(set(win.kernel)) == 1 and _tiled(win) and g.opset >= 11
    if indices is None and tiled:
        picked = _max_pool_tiled_jvp(g, x, src, y, win.kernel[0])
    else:
        if indices is None:
            _, indices = g.same_op(node, x, outputs=2, storage_order=None)
        picked = _gather_flat(g, src, indices, y)
    if dz is not None:
        picked = g.Mul(picked, g.mask(g.Greater(y, g.const(0.0, like=y)), y))
    return [picked, None]


_WINDOW_DEFAULTS = {"auto_pad": b"NOTSET", "ceil_mode": 0}


def _window_attrs(node) -> dict:
    """A MaxPool's window attributes (all but storage_order, which changes the Indices alone), defaults filled."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name != "storage_order"}
    r = len(attrs.get("kernel_shape", ()))
    for name, value in {**_WINDOW_DEFAULTS, "strides": [1] * r, "dilations": [1] * r, "pads": [0] * 2 * r}.items():
        attrs.setdefault(name, value)
    return attrs


def _same_window(a, b) -> bool:
    return a.op_type == b.op_type == "MaxPool" and a.domain in ("", "ai.onnx") and b.domain in ("", "ai.onnx") \
        and _window_attrs(a) == _window_attrs(b)


def _indices_at_hand(g, node: NodeView, x: str) -> str | None:
    """Flat (storage_order 0) Indices of x's windows that the graph computes anyway: the node's own, or those of
    another MaxPool of x with the same window (in ``hvp``, the gradient's MaxPool beside the forward's)."""
    for other in [node.proto] + [c for c in g.consumers(x) if c is not node.proto]:
        out = list(other.output)
        order = next((helper.get_attribute_value(a) for a in other.attribute if a.name == "storage_order"), 0)
        if len(out) > 1 and out[1] and order == 0 and other.input[0] == x and _same_window(other, node.proto):
            return out[1]
    return None


def _relu_input_tangent(g, node: NodeView, x: str, shared: bool = True) -> str | None:
    """x = Relu(z) read by MaxPools of this window alone (``shared`` off: by this node alone): the tangent of z
    (its mask is applied once pooled)."""
    relu = g.producer(x)
    if relu is None or relu.op_type != "Relu" or relu.domain not in ("", "ai.onnx"):
        return None
    readers = g.consumers(x)
    if not all(_same_window(c, node.proto) for c in readers) or (not shared and len(readers) != 1):
        return None
    return g.tangent_of(relu.input[0])


def _gather_flat(g, src: str, indices: str, y: str) -> str:
    """src at the flat positions ``indices``, shaped like y: GatherElements over the flattened tensors (opset 11;
    Gather below). onnxruntime runs it in 0.15x the time of a Gather by the same indices, which copies element
    by element; onnx's reference evaluator takes at most 64 (numpy 1: 32) positions along GatherElements' axis,
    so gradcheck's float64 evaluator has a GatherElements of its own (runtimes/reference_ops.py)."""
    flat = g.ints([-1])
    op = g.GatherElements if g.opset >= 11 else g.Gather
    return g.reshape_like(op(g.Reshape(src, flat), g.Reshape(indices, flat), axis=0), y)


def _max_pool_tiled_jvp(g, x: str, dx: str, y: str, k: int) -> str:
    """dx at the first maximum of each k x k window that tiles the input: SpaceToDepth lays the k*k offsets of
    every window out as k*k channel blocks in row-major order, so ArgMax over them (the first maximum, the
    gradient's and onnxruntime's tie rule) and one GatherElements pick the tangent. About 0.6x the CPU time of
    MaxPool with Indices and a Gather (benchmarks/forward_forms.py, docs/benchmarks.md)."""
    shape = g.shape(x)
    rest = shape[1] * shape[2] * shape[3] // (k * k) if isinstance(shape[1], int) else -1
    blocks = g.ints([0, k * k, rest])  # no -1 where it can be helped: an empty batch leaves it undetermined
    xs = g.Reshape(g.SpaceToDepth(x, blocksize=k), blocks)
    ds = g.Reshape(g.SpaceToDepth(dx, blocksize=k), blocks)
    picked = g.GatherElements(ds, g.ArgMax(xs, axis=1, keepdims=1), axis=1)
    return g.reshape_like(picked, y)


@jvp_rule("GlobalMaxPool", since=11)
def global_max_pool_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """dx at the first maximum of each channel (the gradient's choice)."""
    x = node.inputs[0]
    where = g.ArgMax(g.Reshape(x, g.ints([0, 0, -1])), axis=2, keepdims=1)
    return [g.reshape_like(g.GatherElements(g.Reshape(dx[0], g.ints([0, 0, -1])), where, axis=2), node.outputs[0])]


