"""Linear algebra: MatMul (batched, broadcast, 1-D operands), Gemm, Einsum."""
from __future__ import annotations

from onnx_autodiff.engine.builder import GradBuilder, Grads, NodeView
from onnx_autodiff.engine.registry import gradient_rule
from onnx_autodiff.errors import GradientRuleError


def broadcast_shape(s1, s2):
    """numpy broadcast of two shapes with int / symbolic dims; None where it cannot tell."""
    if s1 is None or s2 is None:
        return None
    n = max(len(s1), len(s2))
    s1 = (1,) * (n - len(s1)) + tuple(s1)
    s2 = (1,) * (n - len(s2)) + tuple(s2)
    out = []
    for a, b in zip(s1, s2):
        if a == b:
            out.append(a)
        elif a == 1:
            out.append(b)
        elif b == 1:
            out.append(a)
        else:
            out.append(None)
    return tuple(out)


def unbroadcast_to(g, dz, x, z_shape):
    """``g.unbroadcast`` for an emitted tensor ``dz`` whose shape (``z_shape``) the rule knows.

    Records the shape so the builder can take its static path; with ``z_shape`` None it works at run time.
    """
    if z_shape is not None:
        g.declare(dz, g.dtype(dz) or g.dtype(x), tuple(z_shape))
    return g.unbroadcast(dz, x, dz)


def swap_last(g, x, rank):
    """x with its last two axes swapped."""
    return g.Transpose(x, perm=list(range(rank - 2)) + [rank - 1, rank - 2])


def _gemm(g, a, b, trans_a=0, trans_b=0, alpha=1.0):
    """alpha * op(a) @ op(b) as one Gemm (C is required below opset 11: a zero scalar then)."""
    c = g.const(0.0, like=a) if g.opset < 11 else None
    return g.Gemm(a, b, c, transA=trans_a or None, transB=trans_b or None,
                  alpha=None if alpha == 1.0 else float(alpha))


@gradient_rule("MatMul")
def matmul_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """dA = dY @ B^T, dB = A^T @ dY, with 1-D operands promoted and broadcast batch dims summed."""
    dz, = dy
    a, b = node.inputs
    ra, rb = g.rank(a), g.rank(b)
    if ra is None or rb is None:
        raise GradientRuleError(f"{node}: the MatMul gradient needs the ranks of {a!r} and {b!r}; "
                                "run shape inference or annotate their shapes")
    need_a, need_b = node.needs_grad(0), node.needs_grad(1)
    if ra == 1 and rb == 1:
        return [g.Mul(dz, b) if need_a else None, g.Mul(dz, a) if need_b else None]
    if ra == 2 and rb == 2 and g.opset >= 11:
        return [_gemm(g, dz, b, trans_b=1) if need_a else None,
                _gemm(g, a, dz, trans_a=1) if need_b else None]

    sa, sb = g.shape(a), g.shape(b)
    batch = broadcast_shape(sa[:-2] if ra >= 2 else (), sb[:-2] if rb >= 2 else ()) \
        if sa is not None and sb is not None else None
    if ra == 1:  # a: (K,) acts as (1, K); dz: batch + (N,)
        dz2 = g.unsqueeze(dz, [rb - 2])
        a_t = g.unsqueeze(a, [1])  # (K, 1)
        b_t = swap_last(g, b, rb)
        nb = rb - 2
        da = g.squeeze(g.reduce_sum(g.MatMul(dz2, b_t), list(range(nb)), keepdims=False), [0]) if need_a else None
        db = unbroadcast_to(g, g.MatMul(a_t, dz2), b, None if batch is None else batch + tuple(sb[-2:])) \
            if need_b else None
        return [da, db]
    if rb == 1:  # b: (K,) acts as (K, 1); dz: batch + (M,)
        dz2 = g.unsqueeze(dz, [ra - 1])
        b_t = g.unsqueeze(b, [0])  # (1, K)
        a_t = swap_last(g, a, ra)
        nb = ra - 2
        da = unbroadcast_to(g, g.MatMul(dz2, b_t), a, None if batch is None else batch + tuple(sa[-2:])) \
            if need_a else None
        db = g.squeeze(g.reduce_sum(g.MatMul(a_t, dz2), list(range(nb)), keepdims=False), [1]) if need_b else None
        return [da, db]
    if rb == 2 and g.opset >= 11:
        return _matmul_by_matrix_grad(g, a, b, dz, need_a, need_b)
    da = unbroadcast_to(g, g.MatMul(dz, swap_last(g, b, rb)), a,
                        None if batch is None else batch + tuple(sa[-2:])) if need_a else None
    db = unbroadcast_to(g, g.MatMul(swap_last(g, a, ra), dz), b,
                        None if batch is None else batch + tuple(sb[-2:])) if need_b else None
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
        raise GradientRuleError(f"{node}: the Einsum gradient does not handle ellipsis ('...') in {equation!r}; "
                                "write the batch dimensions out as letters")
    grads = []
    for i, x in enumerate(node.inputs):
        if not node.needs_grad(i):
            grads.append(None)
            continue
        term = terms[i]
        if len(set(term)) != len(term):
            raise GradientRuleError(f"{node}: the Einsum gradient does not handle a letter repeated within "
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
