"""onnxruntime's RMS and skip normalizations, as onnxruntime-genai's model builder emits them.

``SimplifiedLayerNormalization`` (RMS norm: y = x * r * scale, r = 1 / sqrt(mean(x^2) + epsilon) over the
axes from ``axis`` on) lives in the default domain, where onnxruntime registers it (onnx has no such op);
some converters write it in com.microsoft, so the rule is registered there too. The com.microsoft skip
forms first add ``s = input + skip (+ bias)`` and normalize s over the last axis:
``SkipSimplifiedLayerNormalization`` by RMS, ``SkipLayerNormalization`` by mean and variance (then
``+ beta``). Their outputs are (y, mean, inv_std_var, s): s is the residual stream of the next layer, so
its gradient joins the normalization's. The simplified forms' mean output is zeros (onnxruntime writes
none) and passes no gradient.

The statistics are recomputed in the stash type (float) when x is a 16-bit float, as the kernels compute.
"""
from __future__ import annotations

from onnx import TensorProto

from onnx_autodiff.rule_api import GradBuilder, GradientRuleError, Grads, NodeView, StandIn, gradient_rule, type_rule

_MS = "com.microsoft"
_HALF = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


class _Norm:
    """The statistics of ``x`` over static ``axes`` and the input gradient through them; ``centred``:
    layer norm (x - mean) rather than RMS norm."""

    def __init__(self, g: GradBuilder, x: str, axes: list[int], epsilon: float, centred: bool, stash: int):
        self.g, self.axes = g, axes
        self.x = g.Cast(x, to=stash) if g.dtype(x) in _HALF and stash not in _HALF else x
        shape = g.shape(x)
        if shape is not None and all(isinstance(shape[a], int) for a in axes):
            count = 1
            for a in axes:
                count *= shape[a]
            self.inv_count = g.const(1.0 / count, like=self.x)
        else:
            self.inv_count = g.Reciprocal(g.count(self.x, g.reduce_sum(self.x, axes, keepdims=True)))
        self.mean = self.average(self.x) if centred else None
        self.centred = g.Sub(self.x, self.mean) if centred else self.x
        var = self.average(g.Mul(self.centred, self.centred))
        self.invstd = g.Reciprocal(g.Sqrt(g.Add(var, g.const(epsilon, like=self.x))))
        self.xhat = g.Mul(self.centred, self.invstd)

    def average(self, t: str) -> str:
        return self.g.Mul(self.g.reduce_sum(t, self.axes, keepdims=True), self.inv_count)

    def up(self, t: str) -> str:
        """``t`` in the statistics' type."""
        return t if self.g.dtype(t) == self.g.dtype(self.x) else self.g.Cast(t, to=self.g.dtype(self.x))

    def input_grad(self, dxhat: str | None, dinvstd: str | None, dmean: str | None, like: str) -> str | None:
        """dx from the gradients of xhat, of the inverse standard deviation and of the mean output, in
        ``like``'s type (None when none of them flows)."""
        g = self.g
        terms = []
        if dxhat is not None:
            dxhat = self.up(dxhat)
            inner = g.Sub(dxhat, g.Mul(self.xhat, self.average(g.Mul(dxhat, self.xhat))))
            if self.mean is not None:
                inner = g.Sub(inner, self.average(dxhat))
            terms.append(g.Mul(self.invstd, inner))
        if dinvstd is not None:  # d invstd / dx = -invstd^2 * xhat / count
            slope = g.Mul(g.Mul(self.invstd, self.invstd), self.inv_count)
            terms.append(g.Neg(g.Mul(g.Mul(self.up(dinvstd), slope), self.xhat)))
        if dmean is not None:
            terms.append(g.Expand(g.Mul(self.up(dmean), self.inv_count), g.shape_of(self.x)))
        if not terms:
            return None
        dx = terms[0] if len(terms) == 1 else g.Sum(*terms)
        return dx if g.dtype(dx) == g.dtype(like) else g.Cast(dx, to=g.dtype(like))


def _scaled_grads(g: GradBuilder, node: NodeView, norm: _Norm, dy: str | None, scale_at: int, y: str,
                  grads: list) -> str | None:
    """The scale's gradient into ``grads[scale_at]``; returns the gradient of xhat (dy * scale)."""
    if dy is None:
        return None
    scale = node.inputs[scale_at]
    if node.needs_grad(scale_at):
        grads[scale_at] = g.unbroadcast(g.cast_like(g.Mul(norm.up(dy), norm.xhat), scale), scale, y)
    return g.Mul(dy, scale)


@gradient_rule("SimplifiedLayerNormalization")
@gradient_rule("SimplifiedLayerNormalization", domain=_MS)
def simplified_layer_normalization_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """y = x * r * scale, r = 1 / sqrt(mean(x^2) + epsilon): dscale = dy * x * r summed over the batch axes,
    dx = r * (dxhat - xhat * mean(dxhat * xhat)) with dxhat = dy * scale (plus the inv_std_var output's)."""
    dz, dinvstd = (list(dy) + [None])[:2]
    x, y = node.inputs[0], node.outputs[0]
    r = g.need_rank(x)
    axes = list(range(int(node.attr("axis", -1)) % r, r))
    norm = _Norm(g, x, axes, float(node.attr("epsilon", 1e-5)), False, int(node.attr("stash_type", 1)))
    grads: list = [None] * len(node.inputs)
    dxhat = _scaled_grads(g, node, norm, dz, 1, y, grads)
    if node.needs_grad(0):
        grads[0] = norm.input_grad(dxhat, dinvstd, None, x)
    return grads


def _skip_norm(g: GradBuilder, node: NodeView, dy: Grads, centred: bool) -> Grads:
    """s = input + skip (+ bias), y = norm(s) * gamma (+ beta): the gradient of s (from y, inv_std_var and,
    for the centred form, mean, plus the sum output's own) goes to input, skip and bias unbroadcast."""
    dz, dmean, dinvstd, dsum = (list(dy) + [None] * 4)[:4]
    beta_at, bias_at = (3, 4) if centred else (None, 3)
    x, skip = node.inputs[0], node.inputs[1]
    y = node.outputs[0]
    if g.rank(x) not in (2, 3):
        raise GradientRuleError(f"{node}: the input must be 2-D or 3-D (onnxruntime's layout), got rank {g.rank(x)}")
    s = node.output(3)
    if s is None:
        s = g.Add(x, skip) if node.input(bias_at) is None else g.Add(g.Add(x, skip), node.inputs[bias_at])
    norm = _Norm(g, s, [g.rank(x) - 1], float(node.attr("epsilon", 1e-12 if centred else 1e-5)), centred,
                 TensorProto.FLOAT)
    grads: list = [None] * len(node.inputs)
    dxhat = _scaled_grads(g, node, norm, dz, 2, y, grads)
    if beta_at is not None and dz is not None and node.input(beta_at) and node.needs_grad(beta_at):
        grads[beta_at] = g.unbroadcast(dz, node.inputs[beta_at], y)
    terms = [t for t in (norm.input_grad(dxhat, dinvstd, dmean if centred else None, x), dsum) if t is not None]
    if not terms:
        return grads
    ds = terms[0] if len(terms) == 1 else g.Add(*terms)
    if node.needs_grad(0):
        grads[0] = g.unbroadcast(ds, x, s)
    if node.needs_grad(1):
        grads[1] = g.unbroadcast(ds, skip, s)
    if node.input(bias_at) and node.needs_grad(bias_at):
        grads[bias_at] = g.unbroadcast(ds, node.inputs[bias_at], s)
    return grads


@gradient_rule("SkipSimplifiedLayerNormalization", domain=_MS)
def skip_simplified_layer_normalization_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """RMS norm of input + skip (+ bias) over the last axis, times gamma; outputs (y, mean (zeros),
    inv_std_var, input_skip_bias_sum)."""
    return _skip_norm(g, node, dy, centred=False)


@gradient_rule("SkipLayerNormalization", domain=_MS)
def skip_layer_normalization_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Layer norm of input + skip (+ bias) over the last axis, times gamma, plus beta; outputs (y, mean,
    inv_std_var, input_skip_bias_sum)."""
    return _skip_norm(g, node, dy, centred=True)


@type_rule("SimplifiedLayerNormalization")
@type_rule("SimplifiedLayerNormalization", domain=_MS)
def simplified_layer_normalization_type(s: StandIn, node: NodeView) -> None:
    """y like x; inv_std_var: x reduced over the normalized axes (kept) in the stash type."""
    x = node.inputs[0]
    s.op("Identity", x, out=node.outputs[0])
    axis, rank = int(node.attr("axis", -1)), len(s.info(x).shape or ()) or None
    if node.output(1) is None or (axis >= 0 and rank is None):
        return
    axes = list(range(axis, 0)) if axis < 0 else list(range(axis, rank))
    s.op("Cast", s.reduce_mean(x, axes), out=node.outputs[1], to=int(node.attr("stash_type", 1)))


@type_rule("SkipSimplifiedLayerNormalization", "SkipLayerNormalization", domain=_MS)
def skip_normalization_type(s: StandIn, node: NodeView) -> None:
    """y and input_skip_bias_sum like input + skip; mean and inv_std_var that sum reduced over the last axis
    (kept), in float."""
    total = s.Add(node.inputs[0], node.inputs[1])
    s.op("Identity", total, out=node.outputs[0])
    for i in (1, 2):
        if node.output(i):
            s.op("Cast", s.reduce_mean(total, [-1]), out=node.outputs[i], to=TensorProto.FLOAT)
    if node.output(3):
        s.op("Identity", total, out=node.outputs[3])
