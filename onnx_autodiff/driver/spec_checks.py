"""Checks of a TrainingInfoProto's update_binding that the spec implies but onnx's checker does not make.

- an ``update_binding`` that is empty trains nothing: an error, not a silent no-op;
- each key (a mutable initializer) and the value bound to it must agree in element type and shape, or the
  first step silently replaces the tensor with one of another shape and a later step (or loading the
  checkpoint saved in between) fails inside onnxruntime.

The value's type comes from the algorithm's declared outputs or from onnx shape inference over the inference
graph and the algorithm together; where neither knows it, the check passes (the step model, where every op is
plain ONNX, can be checked again with :func:`check_step_bindings`).
"""
from __future__ import annotations

import onnx
from onnx import helper

from ..errors import TrainingSpecError


def _type(vi: onnx.ValueInfoProto) -> tuple[int | None, list | None]:
    tt = vi.type.tensor_type
    dtype = tt.elem_type or None
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim] if tt.HasField("shape") else None
    return dtype, dims


def _name(dtype: int | None) -> str:
    return helper.tensor_dtype_to_string(dtype).replace("TensorProto.", "").lower() if dtype else "?"


def _shown(dims) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]" if dims is not None else "(unknown shape)"


def _disagree(key_type, value_type) -> bool:
    (kd, ks), (vd, vs) = key_type, value_type
    if kd and vd and kd != vd:
        return True
    if ks is not None and vs is not None:
        return len(ks) != len(vs) or any(a is not None and b is not None and a != b for a, b in zip(ks, vs))
    return False


def _initializer_types(graphs) -> dict[str, tuple[int, list]]:
    return {t.name: (t.data_type, list(t.dims)) for g in graphs for t in g.initializer}


def _value_types(model: onnx.ModelProto, alg: onnx.GraphProto, wanted: set[str]) -> dict[str, tuple]:
    """Types of ``wanted`` names: declared outputs first, then inferred over graph + algorithm."""
    out = {o.name: _type(o) for o in list(alg.output) + list(model.graph.output) if o.name in wanted}
    unknown = {n for n in wanted if n not in out or out[n][0] is None or out[n][1] is None}
    if not unknown:
        return out
    g = helper.make_graph(list(model.graph.node) + list(alg.node), "bindings",
                          list(model.graph.input) + list(alg.input), [],
                          list(model.graph.initializer) + list(alg.initializer))
    m = helper.make_model(g, opset_imports=list(model.opset_import))
    m.ir_version = model.ir_version
    try:
        inferred = onnx.shape_inference.infer_shapes(m, strict_mode=False)
    except Exception:  # noqa: BLE001 - inference is a help here; unknown types are not checked
        return out
    for vi in inferred.graph.value_info:
        if vi.name in unknown:
            dtype, dims = _type(vi)
            old_dtype, old_dims = out.get(vi.name, (None, None))
            out[vi.name] = (old_dtype or dtype, old_dims if old_dims is not None else dims)
    return out


def _check(bindings, key_types, value_types, where: str) -> None:
    for key, value in bindings:
        if key not in key_types or value not in value_types:
            continue
        if _disagree(key_types[key], value_types[value]):
            (kd, ks), (vd, vs) = key_types[key], value_types[value]
            raise TrainingSpecError(
                f"{where}: key {key!r} ({_name(kd)} {_shown(ks)}) is bound to {value!r}, which is "
                f"{_name(vd)} {_shown(vs)}; a step would replace {key!r} with a tensor of another "
                f"{'type' if kd != vd and kd and vd else 'shape'}. Bind {key!r} to the new value of {key!r} itself")


def check_update_bindings(model: onnx.ModelProto) -> None:
    """Raise TrainingSpecError for an empty update_binding or a key/value pair whose type or shape differ."""
    for k, ti in enumerate(model.training_info):
        where = f"training_info[{k}].update_binding"
        if not len(ti.update_binding):
            raise TrainingSpecError(
                f"{where} is empty: the algorithm's results are never written back, so training changes nothing. "
                "Bind each trained initializer to its updated value (make_training_model does this)")
        bindings = [(b.key, b.value) for b in ti.update_binding]
        keys = _initializer_types([model.graph, ti.algorithm])
        values = _value_types(model, ti.algorithm, {v for _, v in bindings})
        _check(bindings, keys, values, where)


def check_step_bindings(step_model: onnx.ModelProto, update_binding: dict[str, str]) -> None:
    """The same check on a built step model (plain ONNX, so inference sees every op)."""
    keys = _initializer_types([step_model.graph])
    try:
        inferred = onnx.shape_inference.infer_shapes(step_model, strict_mode=False)
    except Exception:  # noqa: BLE001
        return
    wanted = set(update_binding.values())  # the types of the bound values only (of 7,000 inferred on BERT-base)
    values = {vi.name: _type(vi) for vi in list(inferred.graph.value_info) + list(inferred.graph.output)
              if vi.name in wanted}
    _check(update_binding.items(), keys, values, "update_binding")


__all__ = ["check_update_bindings", "check_step_bindings"]
