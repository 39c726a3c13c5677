"""Unary elementwise ops. Most register only their derivative: dx = dy * f'(x), and the tangent
dy = f'(x) * dx (``derivative`` registers both rules).

Derivatives reuse the forward output ``y`` where it is cheaper (Exp, Tanh, Sigmoid, Sqrt, ...), and use
only ops that themselves have a rule or are declared without gradient, so the backward graph can be
differentiated again. Piecewise ops take the derivative of one side at their kinks (documented per rule).
"""
from __future__ import annotations

import math

from onnx_autodiff.rule_api import FLOAT_TYPES, GradBuilder, Grads, NodeView, derivative, gradient_rule, jvp_rule


def square(g, x):
    return g.Mul(x, x)


# ---- rules that are not f'(x) * dy ----------------------------------------------------------------

@gradient_rule("Identity")
def identity_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    return [dy[0]]


@gradient_rule("Neg")
def neg_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    return [g.Neg(dy[0])]


@gradient_rule("Cast")
def cast_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """The gradient is cast back to the input's type; an input that is not floating point gets none."""
    dt = g.dtype(node.inputs[0])
    if dt not in FLOAT_TYPES:
        return [None]
    return [dy[0] if g.dtype(dy[0]) == dt else g.Cast(dy[0], to=dt)]


@gradient_rule("CastLike", since=15)
def cast_like_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Like Cast; the target-type input ``target_type`` only lends its type and gets no gradient."""
    return [cast_grad(g, node, dy)[0], None]


@jvp_rule("Identity")
def identity_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    return [dx[0]]


@jvp_rule("Neg")
def neg_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    return [g.Neg(dx[0])]


@jvp_rule("Cast")
def cast_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """The tangent cast like the value; a cast to a type that is not floating point has none, nor does a
    CastLike whose tangent reaches it only through ``target_type`` (RMSNormalization's and Attention's bodies
    cast a constant like their input)."""
    dt = g.dtype(node.outputs[0])
    if dt not in FLOAT_TYPES or dx[0] is None:
        return [None]
    return [dx[0] if g.dtype(dx[0]) == dt else g.Cast(dx[0], to=dt)]


@jvp_rule("CastLike", since=15)
def cast_like_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    return cast_jvp(g, node, dx[:1])


# ---- smooth functions -------------------------------------------------------------------------------

@derivative("Exp")
def exp_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    return y


@derivative("Log")
def log_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """1/x (x > 0)."""
    return g.Reciprocal(x)


@derivative("Sqrt")
def sqrt_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """1 / (2 sqrt(x)) from y (x > 0)."""
    return g.Div(g.const(0.5, like=x), y)


@derivative("Reciprocal")
def reciprocal_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """-1/x^2 = -y^2."""
    return g.Neg(square(g, y))


@derivative("Sin")
def sin_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    return g.Cos(x)


@derivative("Cos")
def cos_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    return g.Neg(g.Sin(x))


@derivative("Tan")
def tan_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """1 + tan(x)^2 = 1 + y^2."""
    return g.Add(g.const(1.0, like=x), square(g, y))


@derivative("Asin")
def asin_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """1 / sqrt(1 - x^2) (|x| < 1)."""
    return g.Reciprocal(g.Sqrt(g.Sub(g.const(1.0, like=x), square(g, x))))


@derivative("Acos")
def acos_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """-1 / sqrt(1 - x^2) (|x| < 1)."""
    return g.Neg(asin_derivative(g, node, x, y))


@derivative("Atan")
def atan_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    return g.Reciprocal(g.Add(g.const(1.0, like=x), square(g, x)))


@derivative("Sinh", since=9)
def sinh_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    return g.Cosh(x)


@derivative("Cosh", since=9)
def cosh_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    return g.Sinh(x)


@derivative("Asinh", since=9)
def asinh_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """1 / sqrt(x^2 + 1)."""
    return g.Reciprocal(g.Sqrt(g.Add(square(g, x), g.const(1.0, like=x))))


@derivative("Acosh", since=9)
def acosh_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """1 / sqrt(x^2 - 1) (x > 1)."""
    return g.Reciprocal(g.Sqrt(g.Sub(square(g, x), g.const(1.0, like=x))))


@derivative("Atanh", since=9)
def atanh_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """1 / (1 - x^2) (|x| < 1)."""
    return g.Reciprocal(g.Sub(g.const(1.0, like=x), square(g, x)))


@derivative("Tanh")
def tanh_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """1 - y^2."""
    return g.Sub(g.const(1.0, like=x), square(g, y))


@derivative("Sigmoid")
def sigmoid_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """y (1 - y)."""
    return g.Mul(y, g.Sub(g.const(1.0, like=x), y))


@derivative("Softplus")
def softplus_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """log(1 + e^x)' = sigmoid(x)."""
    return g.Sigmoid(x)


@derivative("Softsign")
def softsign_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """x / (1 + |x|)' = 1 / (1 + |x|)^2."""
    return g.Reciprocal(square(g, g.Add(g.const(1.0, like=x), g.Abs(x))))


@derivative("Erf", since=9)
def erf_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """2/sqrt(pi) exp(-x^2)."""
    return g.Mul(g.const(2.0 / math.sqrt(math.pi), like=x), g.Exp(g.Neg(square(g, x))))


@derivative("Gelu", since=20)
def gelu_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """Exact: Phi(x) + x phi(x). approximate="tanh": y = x/2 (1 + tanh(u)), u = c (x + k x^3), so
    y' = (1 + t)/2 + x/2 (1 - t^2) c (1 + 3 k x^2)."""
    one, half = g.const(1.0, like=x), g.const(0.5, like=x)
    approx = node.attr("approximate", "none")
    if approx == "tanh":
        c, k = math.sqrt(2.0 / math.pi), 0.044715
        x2 = square(g, x)
        u = g.Mul(g.const(c, like=x), g.Add(x, g.Mul(g.const(k, like=x), g.Mul(x2, x))))
        t = g.Tanh(u)
        du = g.Mul(g.const(c, like=x), g.Add(one, g.Mul(g.const(3 * k, like=x), x2)))
        return g.Add(g.Mul(half, g.Add(one, t)),
                     g.Mul(g.Mul(half, x), g.Mul(g.Sub(one, square(g, t)), du)))
    cdf = g.Mul(half, g.Add(one, g.Erf(g.Mul(x, g.const(1.0 / math.sqrt(2.0), like=x)))))
    pdf = g.Mul(g.const(1.0 / math.sqrt(2.0 * math.pi), like=x), g.Exp(g.Mul(g.const(-0.5, like=x), square(g, x))))
    return g.Add(cdf, g.Mul(x, pdf))


@derivative("Mish", since=18)
def mish_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """x tanh(softplus(x)): t + x sigmoid(x) (1 - t^2), t = tanh(softplus(x))."""
    t = g.Tanh(g.Softplus(x))
    return g.Add(t, g.Mul(g.Mul(x, g.Sigmoid(x)), g.Sub(g.const(1.0, like=x), square(g, t))))


# ---- piecewise functions (the derivative at a kink is that of the side named) ------------------

@derivative("Abs")
def abs_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """sign(x) (0 at x = 0)."""
    return g.sign(x)


@derivative("Relu")
def relu_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """1 for x > 0, else 0 (as a 0/1 mask times dy or dx: in onnxruntime, Cast + Mul over a LeNet-sized
    activation took a third of the time of a Where, and half that of Sign(y) * dx)."""
    return g.mask(g.Greater(x, g.const(0.0, like=x)), x)


@jvp_rule("Relu")
def relu_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """dx where y > 0 (the same mask as x > 0), read off the output: then nothing but the Relu reads its
    input, so onnxruntime can fuse the Relu into the Conv or BatchNormalization before it, as in the forward."""
    y = node.outputs[0]
    return [g.Mul(dx[0], g.mask(g.Greater(y, g.const(0.0, like=y)), y)) if dx[0] else None]


@derivative("LeakyRelu")
def leaky_relu_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """1 for x > 0, else alpha."""
    alpha = node.attr("alpha", 0.01)
    m = g.mask(g.Greater(x, g.const(0.0, like=x)), x)
    return g.Add(g.const(alpha, like=x), g.Mul(m, g.const(1.0 - alpha, like=x)))


@derivative("ThresholdedRelu", since=10)
def thresholded_relu_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """1 for x > alpha, else 0."""
    return g.mask(g.Greater(x, g.const(node.attr("alpha", 1.0), like=x)), x)


@derivative("Elu")
def elu_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """1 for x > 0, else alpha e^x = y + alpha."""
    alpha = g.const(node.attr("alpha", 1.0), like=x)
    return g.where(g.Greater(x, g.const(0.0, like=x)), g.const(1.0, like=x), g.Add(y, alpha))


@derivative("Selu")
def selu_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """gamma for x > 0, else gamma alpha e^x = y + gamma alpha."""
    alpha = node.attr("alpha", 1.67326319217681884765625)
    gamma = node.attr("gamma", 1.05070102214813232421875)
    return g.where(g.Greater(x, g.const(0.0, like=x)), g.const(gamma, like=x),
                   g.Add(y, g.const(alpha * gamma, like=x)))


@derivative("Celu", since=12)
def celu_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """1 for x > 0, else e^(x/alpha) = y/alpha + 1."""
    alpha = node.attr("alpha", 1.0)
    one = g.const(1.0, like=x)
    return g.Where(g.Greater(x, g.const(0.0, like=x)), one, g.Add(g.Div(y, g.const(alpha, like=x)), one))


@derivative("HardSigmoid")
def hard_sigmoid_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """alpha where 0 < alpha x + beta < 1 (read off y), else 0."""
    alpha = node.attr("alpha", 0.2)
    inside = g.Mul(g.mask(g.Greater(y, g.const(0.0, like=x)), x), g.mask(g.Less(y, g.const(1.0, like=x)), x))
    return g.Mul(inside, g.const(alpha, like=x))


@derivative("HardSwish", since=14)
def hard_swish_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """x hardsigmoid(x) with alpha 1/6, beta 1/2: 0 for x < -3, x/3 + 1/2 on [-3, 3], 1 for x > 3."""
    three = g.const(3.0, like=x)
    inside = g.Mul(g.mask(g.Greater(x, g.Neg(three)), x), g.mask(g.Less(x, three), x))
    ramp = g.Add(g.Div(x, three), g.const(0.5, like=x))
    return g.Add(g.Mul(inside, ramp), g.mask(g.Greater(x, three), x))


@derivative("Shrink", since=9)
def shrink_derivative(g: GradBuilder, node: NodeView, x: str, y: str) -> str:
    """1 where |x| > lambd (the shifted linear pieces), 0 in the dead zone."""
    lambd = g.const(node.attr("lambd", 0.5), like=x)
    return g.Add(g.mask(g.Greater(x, lambd), x), g.mask(g.Less(x, g.Neg(lambd)), x))


# Floor, Ceil, Round, Sign (piecewise constant) and IsNaN, IsInf, Not, BitwiseNot (boolean or integer
# output) are declared without gradient in no_grad.py.
