"""Hypothesis strategies for shapes and one-node cases: shapes, broadcast pairs, symbolic dims, ``In`` specs,
and ``RuleCase`` of unary and broadcasting binary ops (random graphs of many ops: ``graphs.rule_graphs``)."""
from __future__ import annotations

from .deps import strategies
from .rule_cases import In, RuleCase


def shapes(min_rank: int = 0, max_rank: int = 4, min_side: int = 1, max_side: int = 4):
    """Strategy: a shape tuple."""
    st = strategies()
    return st.lists(st.integers(min_side, max_side), min_size=min_rank, max_size=max_rank).map(tuple)


def broadcast_shapes(max_rank: int = 4, max_side: int = 4):
    """Strategy: a pair of shapes that broadcast against each other (ranks and size-1 dims differ)."""
    st = strategies()

    @st.composite
    def pair(draw):
        full = draw(shapes(1, max_rank, 1, max_side))

        def derive():
            rank = draw(st.integers(0, len(full)))
            tail = full[len(full) - rank:]
            return tuple(1 if draw(st.booleans()) else d for d in tail)

        return derive(), derive()

    return pair()


def symbolic_dims(shape, prefix: str = "d"):
    """Strategy: ``shape`` with some dims replaced by symbolic names (for the declared type)."""
    st = strategies()
    return st.lists(st.booleans(), min_size=len(shape), max_size=len(shape)).map(
        lambda flags: [f"{prefix}{i}" if f else d for i, (d, f) in enumerate(zip(shape, flags))]
    )


def inputs(shape, low: float = -2.0, high: float = 2.0, gap: float = 0.0, symbolic: bool = False,
           prefix: str = "d"):
    """Strategy: an ``In`` of this shape inside [low, high], optionally with symbolic declared dims
    (named ``<prefix><axis>``: give each input its own prefix, a symbol means one size)."""
    st = strategies()
    dims = symbolic_dims(shape, prefix) if symbolic else st.none()
    return dims.map(lambda d: In(tuple(shape), low=low, high=high, gap=gap, dims=d))


def unary_cases(op: str, low: float = -2.0, high: float = 2.0, gap: float = 0.0, opset: int = 17,
                attrs=None):
    """Strategy: ``RuleCase`` of a unary elementwise op on a random shape (values in its domain)."""
    return shapes(0, 3).flatmap(lambda s: inputs(s, low, high, gap)).map(
        lambda i: RuleCase(op, [i], attrs=dict(attrs or {}), opset=opset))


def binary_broadcast_cases(op: str, low: float = -2.0, high: float = 2.0, gap: float = 0.0,
                           opset: int = 17, symbolic: bool = True):
    """Strategy: ``RuleCase`` of a broadcasting binary op on a random broadcast pair."""
    st = strategies()

    @st.composite
    def case(draw):
        a, b = draw(broadcast_shapes())
        return RuleCase(op, [draw(inputs(a, low, high, gap, symbolic, "a")),
                             draw(inputs(b, low, high, gap, symbolic, "b"))], opset=opset)

    return case()
