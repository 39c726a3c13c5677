"""Normalization: BatchNormalization, LayerNormalization, InstanceNormalization, GroupNormalization.

Each normalizes ``x`` over some axes to ``xhat = (x - mean) * invstd`` and applies a scale and a bias.
The statistics are recomputed in x's own element type (a forward Mean/InvStdDev output may be stashed
in another type); through batch statistics the input gradient is
``invstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))``.
"""
from __future__ import annotations

import numpy as np
import onnx

from onnx_autodiff.rule_api import GradBuilder, GradientRuleError, Grads, NodeView, gradient_rule, jvp_rule

# Emitter option ``shared_channel_sums`` (default True): BatchNormalization in training mode computes the
# input gradient from the scale and bias gradients' sums over the batch (False: the general
# ``Moments.input_grad``; tests compare the two); ``batch_norm_affine_grad`` (default True): with the shared sums,
# the input gradient's dz - mean(dz) by an inference-mode BatchNormalization of dz (False: Sub, Add and Mul).
# ``layer_norm_kernel_moments`` (default True): LayerNormalization's backward on a float32 x takes xhat and invstd
# from one LayerNormalization kernel of x (unit scale, zero bias) instead of recomputing them op by op.

class Moments:
    """mean, invstd and xhat of ``x`` over static ``axes`` (kept as size-1 dims)."""

    def __init__(self, g, x: str, axes: list[int], epsilon: float, count: int | None = None):
        self.g, self.x, self.axes = g, x, axes
        self.inv_count = g.const(1.0 / count, like=x) if count else self._inv_count()
        self.mean = self.average(x)
        self.centered = g.Sub(x, self.mean)
        var = self.average(g.Mul(self.centered, self.centered))
        self.invstd = g.Reciprocal(g.Sqrt(g.Add(var, g.const(epsilon, like=x))))
        self.xhat = g.Mul(self.centered, self.invstd)

    def _inv_count(self) -> str:
        g, x = self.g, self.x
        shape = g.shape(x)
        if shape is not None and all(isinstance(shape[a], int) for a in self.axes):
            return g.const(1.0 / float(np.prod([shape[a] for a in self.axes])), like=x)
        return g.Reciprocal(g.count(x, g.reduce_sum(x, self.axes, keepdims=True)))

    def average(self, t: str) -> str:
        return self.g.Mul(self.g.reduce_sum(t, self.axes, keepdims=True), self.inv_count)

    def xhat_tangent(self, dx: str) -> str:
        """The tangent of xhat for a tangent dx of x, statistics included:
        invstd (dx - mean(dx) - xhat mean(xhat dx)) (the same map as ``input_grad``: it is self-adjoint)."""
        return self.input_grad(dx)

    def input_grad(self, dxhat: str) -> str:
        """The gradient of x through xhat, statistics included."""
        g = self.g
        inner = g.Sub(g.Sub(dxhat, self.average(dxhat)), g.Mul(self.xhat, self.average(g.Mul(dxhat, self.xhat))))
        return g.Mul(self.invstd, inner)


class KernelMoments(Moments):
    """``Moments`` of a float32 ``x`` over its trailing axes from ``axis`` on, xhat and invstd from one
    LayerNormalization of x with unit scale and zero bias: one pass over x where Moments makes five (Sub, Mul,
    two ReduceSum, Mul). The statistics are the kernel's own, so those of the forward LayerNormalization."""

    def __init__(self, g, x: str, axis: int, axes: list[int], epsilon: float, normalized: tuple[int, ...]):
        self.g, self.x, self.axes = g, x, axes
        self.inv_count = g.const(1.0 / float(np.prod(normalized)), like=x)
        unit, zero = g.const(np.ones(normalized), like=x), g.const(np.zeros(normalized), like=x)
        self.xhat, _, self.invstd = g.LayerNormalization(x, unit, zero, outputs=3, axis=axis, epsilon=epsilon,
                                                         stash_type=onnx.TensorProto.FLOAT)

    @staticmethod
    def fits(g, x: str, axis: int) -> tuple[int, ...] | None:
        """The normalized shape when the kernel form applies (float32 x, its normalized dims static, the option
        on, the target has the op), else None."""
        shape = g.shape(x)
        if (not g.option("layer_norm_kernel_moments", True) or g.dtype(x) != onnx.TensorProto.FLOAT
                or shape is None or g.opset < 17 or not g.has_op("LayerNormalization")):
            return None
        normalized = tuple(shape[axis:])
        return normalized if all(isinstance(d, int) and d > 0 for d in normalized) else None


def layer_norm_moments(g, x: str, axis: int, epsilon: float) -> Moments:
    """The moments LayerNormalization's rules read: ``KernelMoments`` where it fits, else ``Moments``."""
    axes = list(range(axis, g.need_rank(x)))
    normalized = KernelMoments.fits(g, x, axis)
    if normalized is None:
        return Moments(g, x, axes, epsilon)
    return KernelMoments(g, x, axis, axes, epsilon, normalized)


def _per_channel(g, v: str, rank: int) -> str:
    """A [C] vector shaped to broadcast against [N, C, *spatial]."""
    return g.unsqueeze(v, list(range(1, rank - 1)))


def _batch_norm(g, node, dy, training: bool) -> Grads:
    """Inference mode: mean and var are inputs and get their gradients too. Training mode: batch
    statistics, gradient through them; the running mean/var outputs carry no gradient, so the input
    mean and var (which only feed those) get none."""
    dz = dy[0]
    if dz is None:
        return []
    if not node.attr("spatial", 1):
        raise GradientRuleError("BatchNormalization with spatial=0 (opset < 9) has no gradient rule")
    x = node.inputs[0]
    r = g.need_rank(x)
    axes = [0] + list(range(2, r))
    grads = [None] * len(node.inputs)
    if node.needs_grad(2):
        grads[2] = g.reduce_sum(dz, axes, keepdims=False)
    if training:
        _batch_norm_training(g, node, dz, axes, r, grads)
    else:
        _batch_norm_inference(g, node, dz, axes, r, grads)
    return grads


def _batch_norm_training(g, node, dz: str, axes: list[int], r: int, grads: list) -> None:
    x, scale = node.inputs[:2]
    s = _per_channel(g, scale, r)
    m = Moments(g, x, axes, node.attr("epsilon", 1e-5))
    if not g.option("shared_channel_sums", True):
        if node.needs_grad(0):
            grads[0] = m.input_grad(g.Mul(dz, s))
        if node.needs_grad(1):
            grads[1] = g.reduce_sum(g.Mul(dz, m.xhat), axes, keepdims=False)
        return
    # the scale is constant over the reduced axes, so the two means of the input gradient are the
    # scale and bias gradients (per-channel sums) times scale / count:
    # dx = scale * invstd * (dz - mean(dz) - xhat * mean(dz * xhat)). xhat = centered * invstd is not
    # formed: invstd is per channel, so it goes into the per-channel factors (one full pass fewer)
    dz_centered = g.reduce_sum(g.Mul(dz, m.centered), axes, keepdims=False)
    if node.needs_grad(1):
        grads[1] = g.Mul(dz_centered, g.Reshape(m.invstd, g.ints([-1])))
    if node.needs_grad(0):
        dz_sum = grads[2] if grads[2] is not None else g.reduce_sum(dz, axes, keepdims=False)
        if g.option("batch_norm_affine_grad", True) and g.has_op("BatchNormalization"):
            grads[0] = _batch_norm_input_grad_affine(g, m, scale, dz, dz_sum, dz_centered, r)
            return
        mean_dz = g.Mul(_per_channel(g, dz_sum, r), m.inv_count)
        per_centered = g.Mul(g.Mul(_per_channel(g, dz_centered, r), m.inv_count), g.Mul(m.invstd, m.invstd))
        inner = g.Sub(dz, g.Add(g.Mul(m.centered, per_centered), mean_dz))
        grads[0] = g.Mul(inner, g.Mul(s, m.invstd))


def _batch_norm_input_grad_affine(g, m: Moments, scale: str, dz: str, dz_sum: str, dz_centered: str, r: int) -> str:
    """dx = a (dz - mean(dz)) - centered * a invstd^2 mean(dz * centered), a = scale * invstd per channel: the
    first term is one inference-mode BatchNormalization of dz (its mean input mean(dz), variance 1, epsilon 0),
    so dx takes three full-size kernels (that, a Mul and a Sub) where the general form takes four."""
    invstd = g.Reshape(m.invstd, g.ints([-1]))
    a = g.Mul(scale, invstd)
    mean_dz = g.Mul(dz_sum, m.inv_count)
    channels = g.static_shape(scale)
    zeros, ones = ((g.const(np.zeros(channels), like=scale), g.const(np.ones(channels), like=scale)) if channels
                   else (g.zeros_like(scale), g.ones_like(scale)))
    shifted = g.op("BatchNormalization", dz, a, zeros, mean_dz, ones, epsilon=0.0)
    per_centered = g.Mul(g.Mul(a, g.Mul(invstd, invstd)), g.Mul(dz_centered, m.inv_count))
    return g.Sub(shifted, g.Mul(m.centered, _per_channel(g, per_centered, r)))


def _batch_norm_inference(g, node, dz: str, axes: list[int], r: int, grads: list) -> None:
    x, scale, _, mean, var = node.inputs[:5]
    invstd = g.Reciprocal(g.Sqrt(g.Add(var, g.const(node.attr("epsilon", 1e-5), like=var))))
    istd = _per_channel(g, invstd, r)
    centered = g.Sub(x, _per_channel(g, mean, r))
    if node.needs_grad(0):
        grads[0] = g.Mul(dz, g.Mul(_per_channel(g, scale, r), istd))
    if node.needs_grad(1):
        grads[1] = g.reduce_sum(g.Mul(dz, g.Mul(centered, istd)), axes, keepdims=False)
    if node.needs_grad(3):
        grads[3] = g.Neg(g.Mul(g.reduce_sum(dz, axes, keepdims=False), g.Mul(scale, invstd)))
    if node.needs_grad(4):
        cube = g.Mul(invstd, g.Mul(invstd, invstd))
        grads[4] = g.Mul(g.reduce_sum(g.Mul(dz, centered), axes, keepdims=False),
                         g.Mul(scale, g.Mul(cube, g.const(-0.5, like=var))))


@gradient_rule("BatchNormalization", since=7)
def batch_normalization_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Opsets 7 to 13: training mode when the node declares the running mean and var outputs."""
    return _batch_norm(g, node, dy, sum(1 for o in node.outputs if o) > 1)


@gradient_rule("BatchNormalization", since=14)
def batch_normalization_training_mode_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Opset 14 on: the training_mode attribute."""
    return _batch_norm(g, node, dy, bool(node.attr("training_mode", 0)))


@gradient_rule("LayerNormalization", since=17)
def layer_normalization_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Gradients for X, Scale and B, from Y and from the optional Mean and InvStdDev outputs."""
    dz, dmean, dinvstd = dy
    x = node.inputs[0]
    # Mean and InvStdDev are stashed in stash_type, which may differ from x's type
    dmean, dinvstd = (d if d is None or g.dtype(d) == g.dtype(x) else g.CastLike(d, x) for d in (dmean, dinvstd))
    scale = node.inputs[1]
    bias = node.input(2)
    y = node.outputs[0]
    r = g.need_rank(x)
    m = layer_norm_moments(g, x, node.attr("axis", -1) % r, node.attr("epsilon", 1e-5))
    grads = [None] * len(node.inputs)
    if dz is not None:
        if node.needs_grad(1):
            grads[1] = g.unbroadcast(g.Mul(dz, m.xhat), scale, y)
        if bias and node.needs_grad(2):
            grads[2] = g.unbroadcast(dz, bias, y)
    if node.needs_grad(0):
        terms = []
        if dz is not None:
            terms.append(m.input_grad(g.Mul(dz, scale)))
        if dinvstd is not None:
            # d invstd / dx = -invstd^2 * xhat / count
            slope = g.Mul(g.Mul(m.invstd, m.invstd), m.inv_count)
            terms.append(g.Neg(g.Mul(g.Mul(dinvstd, slope), m.xhat)))
        if dmean is not None:
            spread = g.Mul(dmean, m.inv_count)
            terms.append(g.Expand(spread, g.shape_of(x)) if len(terms) == 0 else spread)
        grads[0] = terms[0] if len(terms) == 1 else g.Sum(*terms)
    return grads


@gradient_rule("InstanceNormalization", since=6)
def instance_normalization_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    dz, = dy
    x, scale = node.inputs[:2]
    r = g.need_rank(x)
    m = Moments(g, x, list(range(2, r)), node.attr("epsilon", 1e-5))
    outer = [0] + list(range(2, r))
    grads = [None] * len(node.inputs)
    if node.needs_grad(0):
        grads[0] = m.input_grad(g.Mul(dz, _per_channel(g, scale, r)))
    if node.needs_grad(1):
        grads[1] = g.reduce_sum(g.Mul(dz, m.xhat), outer, keepdims=False)
    if node.needs_grad(2):
        grads[2] = g.reduce_sum(dz, outer, keepdims=False)
    return grads


def _group_norm(g, node, dy, per_channel: bool) -> Grads:
    """Statistics per (sample, group) over [N, G, C/G * spatial]; scale and bias per channel or per group."""
    dz, = dy
    x, scale = node.inputs[:2]
    r = g.need_rank(x)
    groups = node.attr("num_groups")
    grouped = g.ints([0, groups, -1])
    shape = g.shape(x)
    per_group = None
    if shape is not None and all(isinstance(d, int) for d in shape[1:]):
        per_group = int(np.prod(shape[1:])) // groups
    m = Moments(g, g.Reshape(x, grouped), [2], node.attr("epsilon", 1e-5), per_group)
    grads = [None] * len(node.inputs)
    if per_channel:
        xhat = g.Reshape(m.xhat, g.shape_of(x))
        outer = [0] + list(range(2, r))
        dxhat = g.Reshape(g.Mul(dz, _per_channel(g, scale, r)), grouped)
        dscale, dbias = (lambda: g.Mul(dz, xhat)), (lambda: dz)
    else:
        dzg = g.Reshape(dz, grouped)
        dxhat = g.Mul(dzg, g.unsqueeze(scale, [1]))
        outer = [0, 2]
        dscale, dbias = (lambda: g.Mul(dzg, m.xhat)), (lambda: dzg)
    if node.needs_grad(1):
        grads[1] = g.reduce_sum(dscale(), outer, keepdims=False)
    if node.needs_grad(2):
        grads[2] = g.reduce_sum(dbias(), outer, keepdims=False)
    if node.needs_grad(0):
        grads[0] = g.Reshape(m.input_grad(dxhat), g.shape_of(x))
    return grads


@gradient_rule("GroupNormalization", since=18)
def group_normalization_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Opsets 18 to 20: scale and bias per group."""
    return _group_norm(g, node, dy, per_channel=False)


@gradient_rule("GroupNormalization", since=21)
def group_normalization_per_channel_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Opset 21 on: scale and bias per channel."""
    return _group_norm(g, node, dy, per_channel=True)


# ---- tangents (forward mode) -----------------------------------------------------------------------
def _sum_terms(g, terms: list[str], full: bool, y: str) -> str | None:
    """The sum of tangent terms; broadcast to y's shape unless one of them is ``full`` (shaped like y)."""
    if not terms:
        return None
    t = terms[0] if len(terms) == 1 else g.Sum(*terms) if len(terms) > 2 else g.Add(*terms)
    return t if full else g.expand_like(t, y)


def _batch_norm_jvp(g, node, dx, training: bool) -> Grads:
    """Inference: y = (x - mean) invstd scale + B, linear in x, B and scale, and in mean and var through
    invstd. Training: batch statistics, scale * xhat'(dx) + xhat dscale + dB; the running statistics
    get no tangent (as they get no gradient)."""
    if not node.attr("spatial", 1):
        raise GradientRuleError("BatchNormalization with spatial=0 (opset < 9) has no JVP rule")
    dx = list(dx) + [None] * (5 - len(dx))
    x, scale = node.inputs[:2]
    y = node.outputs[0]
    r = g.need_rank(x)
    axes = [0] + list(range(2, r))
    terms, full = [], False
    if training:
        if dx[2]:
            terms.append(_per_channel(g, dx[2], r))
        m = Moments(g, x, axes, node.attr("epsilon", 1e-5))
        if dx[0]:
            terms.append(g.Mul(m.xhat_tangent(dx[0]), _per_channel(g, scale, r)))
            full = True
        if dx[1]:
            terms.append(g.Mul(m.xhat, _per_channel(g, dx[1], r)))
            full = True
        return [_sum_terms(g, terms, full, y)] + [None] * (len(node.outputs) - 1)
    # y = x gain + shift with per-channel gain = scale invstd: dy = dx gain + x a + c, the per-channel
    # a (from dscale, dvar) and c (from dB, dmean, and -mean a for the centering) formed on [C] vectors
    mean, var = node.inputs[3:5]
    invstd = g.Reciprocal(g.Sqrt(g.Add(var, g.const(node.attr("epsilon", 1e-5), like=var))))
    gain = g.Mul(scale, invstd)
    a = []
    if dx[1]:
        a.append(g.Mul(dx[1], invstd))
    if dx[4]:
        cube = g.Mul(invstd, g.Mul(invstd, invstd))
        a.append(g.Mul(g.Mul(scale, cube), g.Mul(dx[4], g.const(-0.5, like=var))))
    a = (a[0] if len(a) == 1 else g.Add(*a)) if a else None
    c = [] if dx[2] is None else [dx[2]]
    if dx[3]:
        c.append(g.Neg(g.Mul(dx[3], gain)))
    if a is not None:
        c.append(g.Neg(g.Mul(mean, a)))
    c = (c[0] if len(c) == 1 else g.Sum(*c)) if c else None
    folded = _conv_batch_norm_jvp(g, x, dx[0], gain, a, c, r)
    if folded is not None:
        return [folded] + [None] * (len(node.outputs) - 1)
    if dx[0]:
        terms.append(g.Mul(dx[0], _per_channel(g, gain, r)))
        full = True
    if a is not None:
        terms.append(g.Mul(x, _per_channel(g, a, r)))
        full = True
    if c is not None:
        terms.append(_per_channel(g, c, r))
    return [_sum_terms(g, terms, full, y)] + [None] * (len(node.outputs) - 1)


def _conv_batch_norm_jvp(g, x: str, dx: str | None, gain: str, a: str | None, c: str | None, r: int) -> str | None:
    """The tangent of an inference BatchNormalization of a Conv's output x = conv(x0, W) + b that nothing else
    reads, with the per-channel gain and the [C] vectors a and c of ``_batch_norm_jvp`` (dy = dx gain + x a + c)
    folded into the convolutions' weights: conv(dx0, gain W) + conv(x0, gain dW + a W) + (gain db + a b + c).
    No elementwise pass over the activation, and the forward's Conv output is read by the BatchNormalization
    alone again, so onnxruntime fuses the two (and the Relu after) as in the forward. None where it does not
    apply (another producer or reader, or a tangent of x that the Conv's input tangents do not account for)."""
    conv = g.producer(x)
    if conv is None or conv.op_type != "Conv" or conv.domain not in ("", "ai.onnx") or len(g.consumers(x)) != 1:
        return None
    inputs = list(conv.input) + [""] * (3 - len(conv.input))
    x0, w, b = inputs[0], inputs[1], inputs[2] or None
    dx0, dw, db = (g.tangent_of(i) if i else None for i in inputs)
    if (dx is None) != (dx0 is None and dw is None and db is None):
        return None

    def per_out(v: str) -> str:  # [O] -> [O, 1, ...] against the weight [O, C/group, *kernel]
        return g.unsqueeze(v, list(range(1, r)))

    attrs = {a_.name: onnx.helper.get_attribute_value(a_) for a_ in conv.attribute}
    bias = [t for t in (g.Mul(gain, db) if db else None, g.Mul(a, b) if a and b else None, c) if t]
    bias = (bias[0] if len(bias) == 1 else g.Sum(*bias)) if bias else None
    weights = [t for t in (g.Mul(dw, per_out(gain)) if dw else None, g.Mul(w, per_out(a)) if a else None) if t]
    terms = []
    if dx0:
        terms.append(g.op("Conv", dx0, g.Mul(w, per_out(gain)), *([] if weights or not bias else [bias]), **attrs))
    if weights:
        terms.append(g.op("Conv", x0, weights[0] if len(weights) == 1 else g.Add(*weights), *([bias] if bias else []),
                          **attrs))
    if not terms:
        return None
    return terms[0] if len(terms) == 1 else g.Add(*terms)


@jvp_rule("BatchNormalization", since=7)
def batch_normalization_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    return _batch_norm_jvp(g, node, dx, sum(1 for o in node.outputs if o) > 1)


@jvp_rule("BatchNormalization", since=14)
def batch_normalization_training_mode_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    return _batch_norm_jvp(g, node, dx, bool(node.attr("training_mode", 0)))


@jvp_rule("LayerNormalization", since=17)
def layer_normalization_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """Y: xhat'(dx) scale + xhat dscale + dB; Mean: mean(dx); InvStdDev: -invstd^2 mean(xhat dx) (both in
    their stash type)."""
    dx = list(dx) + [None] * (3 - len(dx))
    x, scale = node.inputs[:2]
    y = node.outputs[0]
    r = g.need_rank(x)
    axis = node.attr("axis", -1)
    m = Moments(g, x, list(range(axis % r, r)), node.attr("epsilon", 1e-5))
    terms, full = [], False
    if dx[0]:
        terms.append(g.Mul(m.xhat_tangent(dx[0]), scale))
        full = True
    if dx[1]:
        terms.append(g.Mul(m.xhat, dx[1]))
        full = True
    if dx[2]:
        terms.append(dx[2])
    out = [_sum_terms(g, terms, full, y)]
    if dx[0] and (node.output(1) or node.output(2)):
        def stashed(t, o):
            return t if g.dtype(o) in (None, g.dtype(x)) else g.Cast(t, to=g.dtype(o))

        out.append(stashed(m.average(dx[0]), node.output(1)) if node.output(1) else None)
        if node.output(2):
            slope = g.Neg(g.Mul(m.invstd, m.invstd))
            out.append(stashed(g.Mul(slope, m.average(g.Mul(m.xhat, dx[0]))), node.output(2)))
    return out


@jvp_rule("InstanceNormalization", since=6)
def instance_normalization_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    x, scale = node.inputs[:2]
    y = node.outputs[0]
    r = g.need_rank(x)
    m = Moments(g, x, list(range(2, r)), node.attr("epsilon", 1e-5))
    terms, full = [], False
    if dx[0]:
        terms.append(g.Mul(m.xhat_tangent(dx[0]), _per_channel(g, scale, r)))
        full = True
    if len(dx) > 1 and dx[1]:
        terms.append(g.Mul(m.xhat, _per_channel(g, dx[1], r)))
        full = True
    if len(dx) > 2 and dx[2]:
        terms.append(_per_channel(g, dx[2], r))
    return [_sum_terms(g, terms, full, y)]
