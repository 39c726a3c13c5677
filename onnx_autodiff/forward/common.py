"""What ``jvp``, ``hvp`` and ``jacobian`` share: the model argument, the checks of a request, and
``with_tangents``, which adds tangent inputs and tangent outputs to a model (the forward walk of
``engine/forward.py`` on the model's graph, with the opset upgrade ``lower`` also does)."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import onnx
from onnx import helper

from ..engine.forward import jvp_nodes
from ..engine.reverse import prepare_gradient_path
from ..errors import ForwardSpecError, OpsetTooOldError
from ..graph import (
    FLOAT_TYPES,
    TRAINING_DOMAINS,
    TensorInfo,
    ancestors,
    finalize,
    info_from_type,
    name_nodes,
    set_nodes,
    topological_sort,
    used_names,
)
from ..model.carrier import open_model
from ..model.weights import attach_weights, check_model, split_model
from ..passes.opset import convert_opset, default_opset, warn_upgrade
from ..passes.pipeline import lower
from ..passes.static_shapes import shape_hints


def as_model(model) -> onnx.ModelProto:
    """A whole copy of the model we may change, taken through the one door (a path, a ModelProto or what
    onnx-autodiff returned); a model with training-spec nodes (Gradient, optimizers) comes lowered."""
    out = open_model(model).whole()
    if any(n.domain in TRAINING_DOMAINS for n in out.graph.node):
        out = lower(out)
    return out


def names_of(value: str | Sequence[str], what: str) -> list[str]:
    names = [value] if isinstance(value, str) else list(value)
    if not names:
        raise ForwardSpecError(f"{what} is empty: name at least one tensor")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ForwardSpecError(f"{what} lists {dup} more than once")
    return names


def tensor_info(model: onnx.ModelProto) -> dict[str, TensorInfo]:
    """Declared types and shapes of the graph's inputs, initializers and outputs."""
    g = model.graph
    info = {vi.name: info_from_type(vi.type) for vi in list(g.input) + list(g.output)}
    for t in g.initializer:
        info[t.name] = TensorInfo(t.data_type, tuple(t.dims))
    return info


def checked_wrt(model: onnx.ModelProto, wrt: str | Sequence[str], where: str) -> list[str]:
    """``wrt`` as a list of float graph inputs or initializers; ForwardSpecError naming what is not."""
    names = names_of(wrt, f"{where}: wrt")
    info = tensor_info(model)
    g = model.graph
    allowed = {vi.name for vi in g.input} | {t.name for t in g.initializer}
    for w in names:
        if w not in allowed:
            floats = sorted(n for n in allowed if info[n].dtype in FLOAT_TYPES)
            raise ForwardSpecError(f"{where}: wrt names {w!r}, which is not a graph input or initializer; "
                                   f"the float ones are {floats}")
        if info[w].dtype not in FLOAT_TYPES:
            raise ForwardSpecError(f"{where}: wrt names {w!r}, which is not floating point; only a float tensor "
                                   "has a tangent")
    return names


def float_outputs(model: onnx.ModelProto) -> list[str]:
    return [o.name for o in model.graph.output if o.type.tensor_type.elem_type in FLOAT_TYPES]


def value_info(name: str, info: TensorInfo) -> onnx.ValueInfoProto:
    shape = None if info.shape is None else [d if isinstance(d, (int, str)) else None for d in info.shape]
    return helper.make_tensor_value_info(name, info.dtype or onnx.TensorProto.UNDEFINED, shape)


def check_free(model: onnx.ModelProto, names: Sequence[str], where: str, how: str) -> None:
    """ForwardSpecError when a name the result would take is already used in the model."""
    taken = sorted(set(names) & used_names(model))
    if taken:
        raise ForwardSpecError(f"{where}: the model already uses the names {taken}, which the result would "
                               f"take; {how}")


def with_tangents(model: onnx.ModelProto, wrt: Sequence[str], inputs: Mapping[str, str],
                  outputs: Mapping[str, str], *, where: str, keep_outputs: Sequence[str] | None = None
                  ) -> onnx.ModelProto:
    """``model`` (ours to change) plus one tangent input ``inputs[w]`` per w in ``wrt`` (typed like w) and
    one output ``outputs[y]`` per tensor y (the tangent of y, J v); the graph outputs before those are
    ``keep_outputs`` (default: all of them). Checked with onnx.checker (full check). When a JVP needs a
    newer opset, the model is converted once to the lowest that works, with a warning (as ``lower`` does)."""
    light, weights = split_model(model)
    out = upgraded(light, lambda m: _with_tangents(m, wrt, inputs, outputs, where, keep_outputs))
    attach_weights(out, weights)
    return out


def upgraded(light: onnx.ModelProto, build: Callable[[onnx.ModelProto], onnx.ModelProto]) -> onnx.ModelProto:
    """``build(light)``; when a JVP needs a newer opset (OpsetTooOldError), ``build`` of the model converted to
    the lowest opset that works, said once as a warning (as ``lower`` does)."""
    have = default_opset(light)
    tried, first = have, None
    while True:
        try:
            out = build(light)
            break
        except OpsetTooOldError as e:
            first = first or e
            tried = max(e.needs, tried + 1)
            if tried > onnx.defs.onnx_opset_version():
                raise first from None
            light = convert_opset(light, tried, str(e))
    if tried != have:
        warn_upgrade(have, tried, str(first).split(". lower()")[0])
    return out


def prepared(m: onnx.ModelProto, wrt: Sequence[str], ys: Sequence[str], taken: set[str]):
    """The view of ``m`` (ours, changed in place) ready for the forward walk from ``wrt`` to ``ys``: node
    names, function bodies expanded, Dropout masks; with the shapes the integer shape arithmetic tells."""
    with shape_hints(m):
        return prepare_gradient_path(m, wrt, [], list(ys), taken)


def _with_tangents(light: onnx.ModelProto, wrt, inputs, outputs, where, keep_outputs) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(light)
    name_nodes(m)
    info = tensor_info(m)
    taken = used_names(m) | set(inputs.values()) | set(outputs.values())
    ys = list(outputs)
    view = prepared(m, wrt, ys, taken)
    for y in ys:
        info.setdefault(y, TensorInfo(view.dtype(y), view.shape(y)))
    replaced: dict = {}
    nodes = jvp_nodes(view, wrt, [inputs[w] for w in wrt], ys, [outputs[y] for y in ys], taken=taken,
                      scope="jvp", where=where, replaced=replaced)
    g = m.graph
    g.input.extend(value_info(inputs[w], info[w]) for w in wrt)
    kept = {o.name: o for o in g.output}
    declared = [kept[name] for name in (keep_outputs if keep_outputs is not None else list(kept))]
    new = [value_info(outputs[y], info[y]) for y in ys]
    body = [n for n in g.node if n.name not in replaced] + nodes
    if replaced:  # what only a replaced node read is left without a reader: drop it
        body = ancestors(body, [o.name for o in declared + new])
    set_nodes(g, topological_sort(body))
    del g.output[:]
    g.output.extend(declared + new)
    finalize(m)
    check_model(m)
    return m
