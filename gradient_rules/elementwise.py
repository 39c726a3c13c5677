"""Unary elementwise ops. Most register only their derivative: dx = dy * f'(x), and the tangent
dy = f'(x) * dx (``derivative`` registers both rules).

Derivatives reuse the forward output ``y`` where it is cheaper (Exp, Tanh, Sigmoid, Sqrt, ...), and use
only ops that themselves have a rule or are declared without gradient, so the backward graph can be
differentiated again. Piecewise ops take the derivative of one side at their kinks (documented per rule).
"""
from __future__ import annotations

import math

from onnx import AttributeProto, helper

from onnx_autodiff.rule_api import (
    FLOAT_TYPES,
    GradBuilder,
    GradientRuleError,
    Grads,
    NodeView,
    derivative,
    gradient_group,
    gradient_rule,
    jvp_rule,
)


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


def gelu_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """A Gelu node (opset 20+): the erf form in the closed form of the patterns, its s and b made here (10 full-size
    passes where dy times ``gelu_derivative`` took 11); the tanh form dy times ``gelu_derivative``. Below opset 20
    ONNX has no Gelu op: a node with more inputs is the group node of an exported pattern (``gelu_patterns``), which
    stands for the pattern's nodes in the reverse walk only: ``gelu_pattern_grad``."""
    if len(node.inputs) > 1:
        return [gelu_pattern_grad(g, node, dy[0])]
    if g.opset < 20:
        raise GradientRuleError("Gelu is an ONNX op from opset 20: convert the model to opset 20 or newer")
    x = node.inputs[0]
    if node.attr("approximate", "none") == "tanh":
        return [g.Mul(dy[0], gelu_derivative(g, node, x, node.outputs[0]))]
    s = g.Mul(x, g.const(1.0 / math.sqrt(2.0), like=x))
    return [_erf_gelu_grad(g, s, g.Add(g.Erf(s), g.const(1.0, like=x)), None, dy[0])]


gradient_rule("Gelu")(gelu_grad)
gradient_rule("Gelu", since=20)(gelu_grad)  # over the rule ``derivative`` made (its JVP stays)


def gelu_pattern_grad(g: GradBuilder, node: NodeView, dz: str) -> str:
    """dx of a GELU pattern from the forward's intermediates: the group node reads x, then s = x / sqrt 2 (the erf
    form; empty for the tanh form), b = 1 + erf(s) or 1 + tanh(u), and, where the forward made it, b / 2.

    Erf: y' = b/2 + x phi(x) = (b + 2 s exp(-s^2) / sqrt(pi)) / 2, the constant folded into the exponent. The 1/2
    scales dz: onnxruntime folds a scalar Mul into the product that wrote dz (MatMulScaleFusion), so 6 full-size
    passes (7 where dz is not a product's output; 6 with the forward's b/2) where op by op took 10, and x is not
    read. Tanh: y' = (b + x (1 - t^2) c (1 + 3 k x^2)) / 2, 1 - t^2 = (2 - b) b: 9-10 passes where op by op took
    12-13."""
    x, s, b = node.inputs[:3]
    half = node.input(3)
    if node.attr("approximate", "none") != "tanh":
        return _erf_gelu_grad(g, s, b, half, dz)
    scale = 0.5 if half else 1.0  # the terms beside b/2, or beside b
    c, k = math.sqrt(2.0 / math.pi), 0.044715
    slope = g.Add(g.Mul(square(g, x), g.const(3 * k * c * scale, like=x)), g.const(c * scale, like=x))
    rest = g.Mul(g.Mul(g.Mul(g.Sub(g.const(2.0, like=x), b), b), slope), x)
    if half:
        return g.Mul(dz, g.Add(half, rest))
    return g.Mul(g.Mul(dz, g.const(0.5, like=x)), g.Add(b, rest))


def _erf_gelu_grad(g: GradBuilder, s: str, b: str, half: str | None, dz: str) -> str:
    """dz (b/2 + s exp(-s^2) / sqrt(pi)), s = x / sqrt 2 and b = 1 + erf(s); ``half`` b/2 where the forward made it."""
    log_scale = math.log((1.0 if half else 2.0) / math.sqrt(math.pi))
    rest = g.Mul(s, g.Exp(g.Sub(g.const(log_scale, like=s), square(g, s))))
    if half:
        return g.Mul(dz, g.Add(half, rest))
    return g.Mul(g.Mul(dz, g.const(0.5, like=s)), g.Add(b, rest))


# ---- GELU as exporters write it, differentiated as one Gelu (engine/registry.gradient_group) ---------
_STD = ("", "ai.onnx")
_SQRT2 = math.sqrt(2.0)


def _made_by(view, name: str, *ops: str):
    """The standard-domain node writing ``name`` when its op is one of ``ops``, else None."""
    n = view.producer.get(name)
    return n if n is not None and n.op_type in ops and n.domain in _STD and len(n.input) == 2 else None


def _near(view, name: str, want: float) -> bool:
    """Whether ``name`` is a constant scalar equal to ``want`` up to float32 rounding."""
    v = view.value(name)
    return v is not None and v.size == 1 and abs(float(v.reshape(-1)[0]) - want) <= 1e-6 * abs(want)


def _with_constant(view, node, want: float) -> str | None:
    """The other input of ``node`` (a Mul or Add) when one input is the constant ``want``, else None."""
    if node is None or node.op_type not in ("Mul", "Add"):
        return None
    a, b = node.input
    return a if _near(view, b, want) else b if _near(view, a, want) else None


def _read_in_subgraphs(nodes) -> set[str]:
    """Every name a node inside a subgraph of ``nodes`` reads (more than the outer names they read: safe here)."""
    def bodies(n):
        for a in n.attribute:
            if a.type == AttributeProto.GRAPH:
                yield a.g
            elif a.type == AttributeProto.GRAPHS:
                yield from a.graphs

    out, stack = set(), [b for n in nodes for b in bodies(n)]
    while stack:
        body = stack.pop()
        for n in body.node:
            out.update(n.input)
            stack.extend(bodies(n))
    return out


class _Readers:
    """Who reads a tensor: a pattern's intermediate must have its next member as its only reader."""

    def __init__(self, view):
        self.view = view
        self.fixed = set(view.graph_outputs) | _read_in_subgraphs(view.nodes)

    def only(self, name: str, op: str | None = None):
        """The one node reading ``name`` (of ``op``), else None (several readers, a graph output, a subgraph's)."""
        readers = self.view.consumers.get(name, [])
        if len(readers) != 1 or name in self.fixed:
            return None
        n = readers[0]
        return n if op is None or (n.op_type == op and n.domain in _STD and len(n.input) == 2) else None


def _tail(view, readers: _Readers, b: str, x: str):
    """``(y, members, b / 2 or "")`` when ``b`` is multiplied by x and 0.5 in two Muls (any order), else None."""
    m1 = readers.only(b, "Mul")
    if m1 is None or m1.input[0] == m1.input[1]:
        return None
    other = m1.input[1] if m1.input[0] == b else m1.input[0]
    if other == x:  # (x b) 0.5: the TorchScript exporter
        m2 = readers.only(m1.output[0], "Mul")
        ok = m2 is not None and _with_constant(view, m2, 0.5) == m1.output[0]
        return (m2.output[0], [m1, m2], "") if ok else None
    if _near(view, other, 0.5):  # (0.5 b) x: the dynamo exporter
        m2 = readers.only(m1.output[0], "Mul")
        return (m2.output[0], [m1, m2], m1.output[0]) if m2 is not None and x in m2.input \
            and m2.input[0] != m2.input[1] else None
    h = _made_by(view, other, "Mul")  # (0.5 x) b
    if h is not None and _with_constant(view, h, 0.5) == x and readers.only(h.output[0]) is m1:
        return m1.output[0], [h, m1], ""
    return None


def _erf_gelu(view, readers: _Readers, erf):
    """``0.5 x (1 + erf(x / sqrt 2))`` around ``erf``: (x, s, b, y, members, b/2), else None."""
    s = erf.input[0]
    pre = _made_by(view, s, "Div", "Mul")
    if pre is None or readers.only(s) is not erf:
        return None
    x = (pre.input[0] if _near(view, pre.input[1], _SQRT2) else None) if pre.op_type == "Div" \
        else _with_constant(view, pre, 1.0 / _SQRT2)
    add = readers.only(erf.output[0], "Add")
    if x is None or add is None or _with_constant(view, add, 1.0) != erf.output[0]:
        return None
    tail = _tail(view, readers, add.output[0], x)
    return None if tail is None else (x, s, add.output[0], tail[0], [pre, erf, add, *tail[1]], tail[2])


def _cube(view, readers: _Readers, name: str, x: str, reader) -> list | None:
    """The nodes of ``x^3`` (``Pow(x, 3)``, ``x (x x)`` or ``(x x) x``) writing ``name``, read only by ``reader``."""
    p = _made_by(view, name, "Pow", "Mul")
    if p is None or readers.only(name) is not reader:
        return None
    if p.op_type == "Pow":
        return [p] if p.input[0] == x and _near(view, p.input[1], 3.0) else None
    sq_name = p.input[1] if p.input[0] == x else p.input[0] if p.input[1] == x else None
    sq = _made_by(view, sq_name, "Mul") if sq_name else None
    ok = sq is not None and list(sq.input) == [x, x] and readers.only(sq_name) is p
    return [sq, p] if ok else None


def _tanh_gelu(view, readers: _Readers, tanh):
    """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` around ``tanh``: (x, "", b, y, members, b/2), else None."""
    mu = _made_by(view, tanh.input[0], "Mul")
    if mu is None or readers.only(tanh.input[0]) is not tanh:
        return None
    v = _with_constant(view, mu, math.sqrt(2.0 / math.pi))
    av = _made_by(view, v, "Add") if v else None
    if av is None or readers.only(v) is not mu:
        return None
    for x, w in ((av.input[0], av.input[1]), (av.input[1], av.input[0])):
        mw = _made_by(view, w, "Mul")
        cube = _with_constant(view, mw, 0.044715) if mw is not None and readers.only(w) is av else None
        powers = _cube(view, readers, cube, x, mw) if cube else None
        add = readers.only(tanh.output[0], "Add") if powers else None
        if add is None or _with_constant(view, add, 1.0) != tanh.output[0]:
            continue
        tail = _tail(view, readers, add.output[0], x)
        if tail is not None:
            return x, "", add.output[0], tail[0], [*powers, mw, av, mu, tanh, add, *tail[1]], tail[2]
    return None


@gradient_group
def gelu_patterns(view, nodes) -> list:
    """GELU as the torch exporters write it below opset 20 (TorchScript: ``Div(x, sqrt 2)``, Erf, ``Add 1``,
    ``Mul x``, ``Mul 0.5``; dynamo: the 0.5 first; the tanh form with Pow or two Muls for x^3) as one Gelu whose
    rule reads the forward's s and b (``gelu_pattern_grad``). Only an exact match: the constants to float32
    rounding, each intermediate read by the next node alone (else the pattern stays op by op)."""
    if not any(n.op_type in ("Erf", "Tanh") for n in nodes):
        return []
    names, readers, found = {n.name for n in nodes}, _Readers(view), []
    for n in nodes:
        if n.domain not in _STD or n.op_type not in ("Erf", "Tanh"):
            continue
        match = (_erf_gelu if n.op_type == "Erf" else _tanh_gelu)(view, readers, n)
        if match is None or not all(m.name in names for m in match[4]):
            continue
        x, s, b, y, members, half_b = match
        approximate = "none" if n.op_type == "Erf" else "tanh"
        node = helper.make_node("Gelu", [x, s, b, half_b], [y], name=view.producer[y].name, approximate=approximate)
        found.append((node, {m.name for m in members}))
    return found


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
