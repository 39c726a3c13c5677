"""Linear algebra: MatMul (batched, broadcast, 1-D operands), Gemm, Einsum.

Each is linear in every operand, so its tangent is the sum of the op applied with one operand replaced by
its tangent (two products for a MatMul whose operands both have tangents).
"""
from __future__ import annotations

from onnx_autodiff.rule_api import GradBuilder, GradientRuleError, Grads, NodeView, gradient_rule, jvp_rule


def swap_last(g, x, rank):
    """x with its last two axes swapped."""
    return g.Transpose(x, perm=list(range(rank - 2)) + [rank - 1, rank - 2])


def _batched(batch, shape):
    """A matrix operand's shape with the broadcast batch dims (None when unknown)."""
    return None if batch is None else batch + tuple(shape[-2:])


def _gemm(g, a, b, trans_a=0, trans_b=0, alpha=1.0):
    """alpha * op(a) @ op(b) as one Gemm."""
    return g.gemm(a, b, transA=trans_a or None, transB=trans_b or None, alpha=None if alpha == 1.0 else float(alpha))


@gradient_rule("MatMul")
def matmul_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """dA = dY @ B^T, dB = A^T @ dY, with 1-D operands promoted and broadcast batch dims summed."""
    dz, = dy
    a, b = node.inputs
    ra, rb = g.need_rank(a), g.need_rank(b)
    need_a, need_b = node.needs_grad(0), node.needs_grad(1)
    if ra == 1 and rb == 1:
        return [g.Mul(dz, b) if need_a else None, g.Mul(dz, a) if need_b else None]
    if ra == 2 and rb == 2 and g.opset >= 11:
        return [_gemm(g, dz, b, trans_b=1) if need_a else None,
                _gemm(g, a, dz, trans_a=1) if need_b else None]

    sa, sb = g.shape(a), g.shape(b)
    batch = g.broadcast_shape(sa[:-2] if ra >= 2 else (), sb[:-2] if rb >= 2 else ()) \
        if sa is not None and sb is not None else None
    if ra == 1:  # a: (K,) acts as (1, K); dz: batch + (N,)
        dz2 = g.unsqueeze(dz, [rb - 2])
        a_t = g.unsqueeze(a, [1])  # (K, 1)
        b_t = swap_last(g, b, rb)
        nb = rb - 2
        da = g.squeeze(g.reduce_sum(g.MatMul(dz2, b_t), list(range(nb)), keepdims=False), [0]) if need_a else None
        db = g.unbroadcast(g.MatMul(a_t, dz2), b, shape=_batched(batch, sb)) \
            if need_b else None
        return [da, db]
    if rb == 1:  # b: (K,) acts as (K, 1); dz: batch + (M,)
        dz2 = g.unsqueeze(dz, [ra - 1])
        b_t = g.unsqueeze(b, [0])  # (1, K)
        a_t = swap_last(g, a, ra)
        nb = ra - 2
        da = g.unbroadcast(g.MatMul(dz2, b_t), a, shape=_batched(batch, sa)) \
            if need_a else None
        db = g.squeeze(g.reduce_sum(g.MatMul(a_t, dz2), list(range(nb)), keepdims=False), [1]) if need_b else None
        return [da, db]
    if rb == 2 and g.opset >= 11:
        return _matmul_by_matrix_grad(g, a, b, dz, need_a, need_b)
    da = g.unbroadcast(g.MatMul(dz, swap_last(g, b, rb)), a, shape=_batched(batch, sa)) \
        if need_a else None
    db = g.unbroadcast(g.MatMul(swap_last(g, a, ra), dz), b, shape=_batched(batch, sb)) \
        if need_b else None
    return [da, db]


def _last_dim_rows(g, t: str) -> str:
    """The Reshape target ``[-1, last dim of t]`` (static, or read at run time)."""
    shape = g.shape(t)
    if shape is not None and isinstance(shape[-1], int):
        return g.ints([-1, shape[-1]])
    return g.Concat(g.ints([-1]), g.Slice(g.Shape(t), g.ints([-1]), g.ints([2 ** 62])), axis=0)


def _matmul_by_matrix_grad(g, a, b, dz, need_a, need_b):
    """A (batch..., M, K) @ B (K, N), as every Linear layer on a sequence is exported.

    dB is one Gemm over the rows of all batches, ``A2^T @ dY2`` with A as [rows, K] and dY as [rows, N]:
    a batched MatMul would write one [K, N] product per batch element and then sum them.
    dA is dY @ B^T, a MatMul whose transposed operand onnxruntime folds into the product.
    """
    da = g.MatMul(dz, swap_last(g, b, 2)) if need_a else None
    db = _gemm(g, g.Reshape(a, _last_dim_rows(g, a)), g.Reshape(dz, _last_dim_rows(g, dz)), trans_a=1) \
        if need_b else None
    return [da, db]


@gradient_rule("Gemm")
def gemm_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Y = alpha * op(A) @ op(B) + beta * C: each gradient is one Gemm, C's is dY summed to C's shape."""
    dz, = dy
    a, b = node.inputs[:2]
    c = node.input(2)
    alpha = float(node.attr("alpha", 1.0))
    beta = float(node.attr("beta", 1.0))
    ta, tb = int(node.attr("transA", 0)), int(node.attr("transB", 0))
    da = db = dc = None
    if node.needs_grad(0):
        da = (_gemm(g, dz, b, trans_b=1 - tb, alpha=alpha) if not ta
              else _gemm(g, b, dz, trans_a=tb, trans_b=1, alpha=alpha))
    if node.needs_grad(1):
        db = (_gemm(g, a, dz, trans_a=1 - ta, alpha=alpha) if not tb
              else _gemm(g, dz, a, trans_a=1, trans_b=ta, alpha=alpha))
    if c is not None and node.needs_grad(2):
        scaled = dz if beta == 1.0 else g.Mul(dz, g.const(beta, like=dz))
        dc = g.unbroadcast(scaled, c, node.outputs[0])
    return [da, db, dc]


def parse_einsum(equation: str, n_inputs: int):
    """(input subscripts, output subscripts) of an einsum equation, the output made explicit."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != n_inputs:
        raise GradientRuleError(f"einsum equation {equation!r} names {len(terms)} operands, the node has {n_inputs}")
    if not arrow:
        letters = "".join(terms)
        rhs = "".join(sorted(ch for ch in set(letters) if letters.count(ch) == 1))
    return terms, rhs


@gradient_rule("Einsum", since=12)
def einsum_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """The gradient of operand i is an Einsum of dY with the other operands into operand i's subscripts;
    letters only operand i carries are summed away in forward, so their gradient is broadcast back."""
    dz, = dy
    equation = node.attr("equation")
    terms, out = parse_einsum(equation, len(node.inputs))
    if "." in equation:
        raise GradientRuleError(f"the Einsum gradient does not handle ellipsis ('...') in {equation!r}; "
                                "write the batch dimensions out as letters")
    grads = []
    for i, x in enumerate(node.inputs):
        if not node.needs_grad(i):
            grads.append(None)
            continue
        term = terms[i]
        if len(set(term)) != len(term):
            raise GradientRuleError(f"the Einsum gradient does not handle a letter repeated within "
                                    f"operand {i} ({term!r} in {equation!r})")
        others = [t for k, t in enumerate(terms) if k != i] + [out]
        seen = set("".join(others))
        target = "".join(ch for ch in term if ch in seen)
        lone = [k for k, ch in enumerate(term) if ch not in seen]
        inputs = [t for k, t in enumerate(node.inputs) if k != i] + [dz]
        gx = g.Einsum(*inputs, equation=",".join(others) + "->" + target)
        if lone:
            gx = g.Expand(g.unsqueeze(gx, lone), g.shape_of(x))
        grads.append(gx)
    return grads


@jvp_rule("MatMul")
def matmul_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """dA @ B + A @ dB; for matrices the second product is a Gemm that adds the first (no separate Add)."""
    da, db = dx
    a, b = node.inputs
    if da and db and g.rank(a) == 2 and g.rank(b) == 2:
        return [g.Gemm(a, db, g.MatMul(da, b))]
    terms = ([g.MatMul(da, b)] if da else []) + ([g.MatMul(a, db)] if db else [])
    return [terms[0] if len(terms) == 1 else g.Add(*terms)]


@jvp_rule("Gemm")
def gemm_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """alpha op(dA) op(B) + alpha op(A) op(dB) + beta dC: the first Gemm carries beta dC in its C, the second
    adds the first through its own C."""
    da, db, dc = list(dx) + [None] * (3 - len(dx))
    a, b = node.inputs[:2]
    beta = node.attr("beta")
    attrs = {"alpha": node.attr("alpha"), "transA": node.attr("transA"), "transB": node.attr("transB")}
    out = None
    if da:
        out = g.gemm(da, b, dc, beta=beta, **attrs)
    if db:
        out = g.gemm(a, db, out or dc, beta=None if out else beta, **attrs)
    if out is None:
        scale = float(node.attr("beta", 1.0))
        scaled = dc if scale == 1.0 else g.Mul(dc, g.const(scale, like=dc))
        return [g.expand_to(scaled, node.inputs[2], node.outputs[0])]
    return [out]


@jvp_rule("Einsum", since=12)
def einsum_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    terms = [g.same_op(node, *[d if k == i else x for k, x in enumerate(node.inputs)])
             for i, d in enumerate(dx) if d]
    return [terms[0] if len(terms) == 1 else g.Sum(*terms)]
