"""``jvp(model, wrt)``: the model plus its Jacobian-vector product, J v, as one plain ONNX model."""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import onnx

from ..errors import ForwardSpecError
from ..graph import used_names
from .common import as_model, checked_wrt, float_outputs, with_tangents

SUFFIX = ".tangent"


def tangent_suffix(model: onnx.ModelProto, wrt: Sequence[str], ys: Sequence[str]) -> str:
    """``.tangent``, or ``.tangent2``, ``.tangent3``, ... when a name with the shorter suffix is taken: the
    first suffix under which none of the new names (``<w><suffix>``, ``<y><suffix>``) is in use. A jvp of
    a jvp (second derivatives along two directions) thus names its tangents ``.tangent2``."""
    taken = used_names(model)
    level = 1
    while True:
        suffix = SUFFIX if level == 1 else f"{SUFFIX}{level}"
        if not any(f"{n}{suffix}" in taken for n in list(wrt) + list(ys)):
            return suffix
        level += 1


def jvp(model: onnx.ModelProto | str | os.PathLike, wrt: str | Sequence[str],
        tangents: Mapping[str, str] | None = None) -> onnx.ModelProto:
    """The model plus its Jacobian-vector products: one more input per name in ``wrt`` (a float graph input
    or initializer), its tangent v, and one more output per float graph output y, ``<y>.tangent`` = J v
    (the derivative of y along v; zeros where y does not depend on ``wrt``).

    Tangent inputs are named ``<w>.tangent``, or as ``tangents`` maps them (w -> name). When the model
    already uses one of the new names (a jvp of a jvp), every new name takes the suffix ``.tangent2``
    instead (then ``.tangent3``, ...): the first under which none is taken. A name given in ``tangents``
    that the model uses raises ForwardSpecError. The result has standard ops only and passes
    ``onnx.checker.check_model(full_check=True)``; the model (a ModelProto or a path) is not changed.
    """
    base = as_model(model)
    wrt = checked_wrt(base, wrt, "jvp")
    ys = float_outputs(base)
    if not ys:
        raise ForwardSpecError("jvp: the model has no floating-point output, so no tangent to give")
    suffix = tangent_suffix(base, wrt, ys)
    names = {w: f"{w}{suffix}" for w in wrt}
    if tangents:
        unknown = sorted(set(tangents) - set(wrt))
        if unknown:
            raise ForwardSpecError(f"jvp: tangents names {unknown}, which are not in wrt {wrt}")
        taken = sorted(set(tangents.values()) & used_names(base))
        if taken:
            raise ForwardSpecError(f"jvp: the tangent input names {taken} are already used in the model; "
                                   "pick other names in tangents=")
        names.update(tangents)
    outputs = {y: f"{y}{suffix}" for y in ys}
    clash = sorted(set(names.values()) & set(outputs.values()))
    if clash or len(set(names.values())) < len(names):
        raise ForwardSpecError(f"jvp: the names {clash or sorted(names.values())} would name two tensors; "
                               "pick distinct names in tangents=")
    return with_tangents(base, wrt, names, outputs, where="jvp")
