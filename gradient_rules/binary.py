"""Binary and variadic elementwise ops with numpy broadcasting.

Every input gradient is computed at the forward output's shape and summed back to the input's shape by
``g.unbroadcast``; no rule undoes broadcasting itself. A tangent has its output's shape: a term built from
one input's tangent alone is broadcast to it (``g.expand_to``, no node when the shapes say it already is).
"""
from onnx_autodiff.rule_api import FLOAT_TYPES, GradBuilder, Grads, NodeView, gradient_rule, jvp_rule


def _to(g, x, dtype):
    """``x`` in element type ``dtype`` (no node when it already is)."""
    return x if g.dtype(x) == dtype else g.Cast(x, to=dtype)


@gradient_rule("Add")
def add_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    dz, = dy
    a, b = node.inputs
    z = node.outputs[0]
    return [g.unbroadcast(dz, a, z) if node.needs_grad(0) else None,
            g.unbroadcast(dz, b, z) if node.needs_grad(1) else None]


@gradient_rule("Sub")
def sub_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    dz, = dy
    a, b = node.inputs
    z = node.outputs[0]
    return [g.unbroadcast(dz, a, z) if node.needs_grad(0) else None,
            g.unbroadcast(g.Neg(dz), b, z) if node.needs_grad(1) else None]


@gradient_rule("Mul")
def mul_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    dz, = dy
    a, b = node.inputs
    z = node.outputs[0]
    return [g.unbroadcast(g.Mul(dz, b), a, z) if node.needs_grad(0) else None,
            g.unbroadcast(g.Mul(dz, a), b, z) if node.needs_grad(1) else None]


@gradient_rule("Div")
def div_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """z = a / b: da = dz / b, db = -dz a / b^2 = -dz z / b."""
    dz, = dy
    a, b = node.inputs
    z = node.outputs[0]
    da = g.Div(dz, b) if node.needs_grad(0) else None
    db = g.Neg(g.Div(g.Mul(dz, z), b)) if node.needs_grad(1) else None
    return [da and g.unbroadcast(da, a, z), db and g.unbroadcast(db, b, z)]


@gradient_rule("Pow")
def pow_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """z = a^b: da = dz b a^(b-1); db = dz z log(a).

    The exponent's gradient is real only for a > 0 (log of the base): for a < 0 it is NaN and for
    a = 0 it is NaN or 0 * -inf, as the function itself is not differentiable in b there. From opset 12
    the exponent may have another element type (even an integer type, then it gets no gradient); the
    work is done in the base's type and the exponent's gradient cast back.
    """
    dz, = dy
    a, b = node.inputs
    z = node.outputs[0]
    dt = g.dtype(a)
    bf = _to(g, b, dt)
    da = db = None
    if node.needs_grad(0):
        da = g.unbroadcast(g.Mul(dz, g.Mul(bf, g.Pow(a, g.Sub(bf, g.const(1.0, like=a))))), a, z)
    if node.needs_grad(1) and g.dtype(b) in FLOAT_TYPES:
        db = g.unbroadcast(_to(g, g.Mul(g.Mul(dz, z), g.Log(a)), g.dtype(b)), b, z)
    return [da, db]


@gradient_rule("Mod", since=10)
def mod_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Floating-point Mod needs fmod=1: z = a - b trunc(a/b), so da = dz and db = -dz trunc(a/b)
    (trunc is piecewise constant; at its jumps the gradient is that of one side)."""
    dz, = dy
    a, b = node.inputs
    z = node.outputs[0]
    db = None
    if node.needs_grad(1):
        q = g.Div(a, b)
        db = g.unbroadcast(g.Neg(g.Mul(dz, g.Mul(g.sign(q), g.Floor(g.Abs(q))))), b, z)
    return [g.unbroadcast(dz, a, z) if node.needs_grad(0) else None, db]


def _ties(g, xs, z, beaten_by):
    """Max / Min of ``xs`` is ``z``: a float mask per input of where it equals z, and their count (the ties)."""
    hits = [g.mask(g.Not(beaten_by(x, z)), z) for x in xs]
    count = hits[0]
    for h in hits[1:]:
        count = g.Add(count, h)
    return hits, count


def _extremum_grad(g, node, dy, beaten_by):
    """Max / Min: dz goes to the inputs equal to z, split evenly among ties (torch.maximum does the
    same for two inputs). ``beaten_by(x, z)`` is true where x is not the extremum (Less for Max)."""
    dz, = dy
    z = node.outputs[0]
    xs = node.inputs
    if len(xs) == 1:
        return [dz]
    hits, count = _ties(g, xs, z, beaten_by)
    share = g.Div(dz, count)
    return [g.unbroadcast(g.Mul(share, h), x, z) if node.needs_grad(i) else None
            for i, (x, h) in enumerate(zip(xs, hits))]


@gradient_rule("Max")
def max_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    return _extremum_grad(g, node, dy, g.Less)


@gradient_rule("Min")
def min_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    return _extremum_grad(g, node, dy, g.Greater)


@gradient_rule("Sum")
def sum_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    dz, = dy
    z = node.outputs[0]
    return [g.unbroadcast(dz, x, z) if node.needs_grad(i) else None for i, x in enumerate(node.inputs)]


@gradient_rule("Mean")
def mean_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    dz, = dy
    z = node.outputs[0]
    share = g.Div(dz, g.const(float(len(node.inputs)), like=z))
    return [g.unbroadcast(share, x, z) if node.needs_grad(i) else None for i, x in enumerate(node.inputs)]


@gradient_rule("Where", since=9)
def where_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """The condition gets no gradient; each branch gets dz where it was chosen, exact zeros elsewhere
    (a Where, not a product with the 0/1 mask, so a non-finite dz does not leak into the other branch)."""
    dz, = dy
    cond, a, b = node.inputs
    z = node.outputs[0]
    zero = g.const(0.0, like=z)
    return [None,
            g.unbroadcast(g.Where(cond, dz, zero), a, z) if node.needs_grad(1) else None,
            g.unbroadcast(g.Where(cond, zero, dz), b, z) if node.needs_grad(2) else None]


def _clip_grads(g, node, dz: str, lo: str | None, hi: str | None) -> Grads:
    """z = min(max(x, lo), hi). x gets dz where lo <= x <= hi, lo where x < lo, hi where the result
    is hi (x > hi, or everywhere when lo > hi, as ONNX defines). At x = lo or x = hi the gradient
    goes to x."""
    x = node.inputs[0]
    z = node.outputs[0]
    below = g.Less(x, lo) if lo else None
    above = None
    if hi:
        above = g.Greater(x, hi)
        if lo:
            above = g.Or(above, g.Greater(lo, hi))
    grads = [None, None, None]
    if node.needs_grad(0):
        out = g.Or(below, above) if below and above else below or above
        grads[0] = dz if out is None else g.Mul(dz, g.mask(g.Not(out), z))
    if lo and node.needs_grad(1):
        hit = below if above is None else g.And(below, g.Not(above))
        grads[1] = g.unbroadcast(g.Mul(dz, g.mask(hit, z)), lo, z)
    if hi and node.needs_grad(2):
        grads[2] = g.unbroadcast(g.Mul(dz, g.mask(above, z)), hi, z)
    return grads


@gradient_rule("Clip")
def clip_attrs_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Opsets 1 to 10: the bounds are the min and max attributes, constants that get no gradient."""
    x = node.inputs[0]
    lo = g.const(node.attr("min"), like=x) if node.has_attr("min") else None
    hi = g.const(node.attr("max"), like=x) if node.has_attr("max") else None
    return _clip_grads(g, node, dy[0], lo, hi)[:1]


@gradient_rule("Clip", since=11)
def clip_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Opset 11 on: the bounds are optional inputs and get their gradients."""
    return _clip_grads(g, node, dy[0], node.input(1), node.input(2))


@gradient_rule("PRelu")
def prelu_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """z = x for x >= 0, slope x for x < 0 (slope broadcasts to x): dx = dz (1 or slope),
    dslope = dz x where x < 0, summed over the broadcast axes."""
    dz, = dy
    x, slope = node.inputs
    z = node.outputs[0]
    neg = g.Less(x, g.const(0.0, like=x))
    dx = dslope = None
    if node.needs_grad(0):
        dx = g.unbroadcast(g.Mul(dz, g.where(neg, slope, g.const(1.0, like=x))), x, z)
    if node.needs_grad(1):
        dslope = g.unbroadcast(g.Mul(g.Mul(dz, x), g.mask(neg, x)), slope, z)
    return [dx, dslope]


# ---- tangents (forward mode) -----------------------------------------------------------------------
def _total(g, terms: list[tuple[str, str]], z: str) -> str | None:
    """The sum of tangent terms (term, the tensor whose shape it has), shaped like output z."""
    if not terms:
        return None
    t = terms[0][0] if len(terms) == 1 else g.Add(*[t for t, _ in terms]) if len(terms) == 2 else \
        g.Sum(*[t for t, _ in terms])
    shape = g.shape(terms[0][1])
    for _, like in terms[1:]:
        shape = g.broadcast_shape(shape, g.shape(like))
    if shape is not None and shape == g.shape(z) and None not in shape:
        return t
    return g.expand_like(t, z)


@jvp_rule("Add", "Sub")
def add_sub_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    da, db = dx
    a, b = node.inputs
    z = node.outputs[0]
    if da and db:
        return [g.op(node.op_type, da, db)]
    if da:
        return [g.expand_to(da, a, z)]
    t = g.expand_to(db, b, z)
    return [t if node.op_type == "Add" else g.Neg(t)]


@jvp_rule("Mul")
def mul_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """da b + a db (each term has the output's shape)."""
    da, db = dx
    a, b = node.inputs
    terms = [g.Mul(da, b)] if da else []
    terms += [g.Mul(a, db)] if db else []
    return [terms[0] if len(terms) == 1 else g.Add(*terms)]


@jvp_rule("Div")
def div_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """z = a / b: dz = (da - z db) / b."""
    da, db = dx
    b, z = node.inputs[1], node.outputs[0]
    if db is None:
        return [g.Div(da, b)]
    zdb = g.Mul(z, db)
    return [g.Div(g.Sub(da, zdb), b) if da else g.Neg(g.Div(zdb, b))]


@jvp_rule("Pow")
def pow_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """z = a^b: dz = da b a^(b-1) + db z log(a) (the second term real for a > 0 only, as for the
    gradient); an exponent of another float type has its tangent cast to the base's."""
    da, db = dx
    a, b = node.inputs
    z = node.outputs[0]
    terms = []
    if da:
        bf = _to(g, b, g.dtype(a))
        terms.append(g.Mul(da, g.Mul(bf, g.Pow(a, g.Sub(bf, g.const(1.0, like=a))))))
    if db and g.dtype(b) in FLOAT_TYPES:
        terms.append(g.Mul(_to(g, db, g.dtype(a)), g.Mul(z, g.Log(a))))
    return [terms[0] if len(terms) == 1 else g.Add(*terms) if terms else None]


@jvp_rule("Mod", since=10)
def mod_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """fmod: z = a - b trunc(a/b), dz = da - db trunc(a/b)."""
    da, db = dx
    a, b = node.inputs
    z = node.outputs[0]
    terms = [(da, a)] if da else []
    if db:
        q = g.Div(a, b)
        terms.append((g.Neg(g.Mul(db, g.Mul(g.sign(q), g.Floor(g.Abs(q))))), z))
    return [_total(g, terms, z)]


def _extremum_jvp(g, node, dx, beaten_by):
    """Max / Min: the tangent of the inputs equal to z, averaged over ties (the gradient's split)."""
    z = node.outputs[0]
    xs = node.inputs
    if len(xs) == 1:
        return [dx[0]]
    hits, count = _ties(g, xs, z, beaten_by)
    terms = [g.Mul(h, d) for h, d in zip(hits, dx) if d]
    return [g.Div(terms[0] if len(terms) == 1 else g.Sum(*terms), count)]


@jvp_rule("Max")
def max_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    return _extremum_jvp(g, node, dx, g.Less)


@jvp_rule("Min")
def min_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    return _extremum_jvp(g, node, dx, g.Greater)


@jvp_rule("Sum")
def sum_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    return [_total(g, [(d, x) for d, x in zip(dx, node.inputs) if d], node.outputs[0])]


@jvp_rule("Mean")
def mean_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    z = node.outputs[0]
    total = _total(g, [(d, x) for d, x in zip(dx, node.inputs) if d], z)
    return [g.Div(total, g.const(float(len(node.inputs)), like=z))]


@jvp_rule("Where", since=9)
def where_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """The tangent of the branch chosen, exact zeros from the other (a Where, like the gradient)."""
    _, da, db = dx
    cond, a, b = node.inputs
    z = node.outputs[0]
    zero = g.const(0.0, like=z)
    t = g.Where(cond, da or zero, db or zero)
    made = g.broadcast_shape(g.shape(cond), g.broadcast_shape(g.shape(a) if da else (), g.shape(b) if db else ()))
    if made is not None and made == g.shape(z) and None not in made:
        return [t]
    return [g.expand_like(t, z)]


@jvp_rule("Clip")
def clip_attrs_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """Opsets 1 to 10: constant bounds; the tangent is dx where x lies inside them."""
    x = node.inputs[0]
    lo = g.const(node.attr("min"), like=x) if node.has_attr("min") else None
    hi = g.const(node.attr("max"), like=x) if node.has_attr("max") else None
    return [_clip_tangent(g, node, [dx[0], None, None], lo, hi)]


@jvp_rule("Clip", since=11)
def clip_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    return [_clip_tangent(g, node, list(dx) + [None] * (3 - len(dx)), node.input(1), node.input(2))]


def _clip_tangent(g, node, dx, lo, hi) -> str:
    """The tangent of the input that gives z, with the gradient's choice: x inside [lo, hi] (ends
    included), lo where x < lo, hi where the result is hi."""
    x, z = node.inputs[0], node.outputs[0]
    below = g.Less(x, lo) if lo else None
    above = None
    if hi:
        above = g.Greater(x, hi)
        if lo:
            above = g.Or(above, g.Greater(lo, hi))
    terms = []
    if dx[0]:
        out = g.Or(below, above) if below and above else below or above
        terms.append((dx[0] if out is None else g.Mul(dx[0], g.mask(g.Not(out), z)), x))
    if lo and dx[1]:
        hit = below if above is None else g.And(below, g.Not(above))
        terms.append((g.Mul(dx[1], g.mask(hit, z)), z))
    if hi and dx[2]:
        terms.append((g.Mul(dx[2], g.mask(above, z)), z))
    return _total(g, terms, z)


@jvp_rule("PRelu")
def prelu_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """dz = dx (1 or slope) + dslope x where x < 0."""
    d, dslope = dx
    x, slope = node.inputs
    z = node.outputs[0]
    neg = g.Less(x, g.const(0.0, like=x))
    terms = []
    if d:
        terms.append((g.Mul(d, g.where(neg, slope, g.const(1.0, like=x))), z))
    if dslope:
        terms.append((g.Mul(g.Mul(dslope, x), g.mask(neg, x)), z))
    return [_total(g, terms, z)]
