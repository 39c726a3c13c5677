"""tract as a bundle runner. tract plans a model for fixed input shapes: one plan per shape of the feeds
(the batch size may change at the last batch of an epoch). tract hands a rank-0 output back with shape
(1,): outputs declared with a static shape are reshaped to it (the iteration counter stays a scalar); an int64
Cast comes back as tract's TDim, converted to i64."""
from __future__ import annotations

import numpy as np
import onnx
import tract

from ..errors import BundleError

_DT = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64", np.dtype(np.int64): "i64",
       np.dtype(np.int32): "i32", np.dtype(np.bool_): "bool", np.dtype(np.float16): "f16"}


def load(path: str):
    graph = onnx.load(path, load_external_data=False).graph
    inputs = [i.name for i in graph.input]
    outputs = [o.name for o in graph.output]
    shapes = {o.name: _static(o) for o in graph.output}
    plans = {}

    def plan(arrays):
        key = tuple((a.shape, a.dtype.str) for a in arrays)
        if key not in plans:
            model = tract.onnx().load(path)
            for k, a in enumerate(arrays):
                shape = ",".join(str(d) for d in a.shape)
                model.set_input_fact(k, f"{shape},{_DT[a.dtype]}" if shape else _DT[a.dtype])
            plans[key] = model.into_model().into_runnable()  # (into_optimized folds state inputs away)
        return plans[key]

    def run(feeds):
        unknown = sorted(set(feeds) - set(inputs))
        missing = [n for n in inputs if n not in feeds]
        if unknown or missing:
            raise BundleError(f"{path!r} (tract): inputs {unknown[:5]} are not in the model"
                              if unknown else f"{path!r} (tract): no feed for the inputs {missing[:5]}")
        arrays = [np.ascontiguousarray(feeds[n]) for n in inputs]
        result = plan(arrays).run(arrays)
        out = {n: _numpy(r) for n, r in zip(outputs, result)}
        for n, shape in shapes.items():
            if shape is not None and out[n].shape != shape and out[n].size == int(np.prod(shape)):
                out[n] = out[n].reshape(shape)
        return out
    return run


def _numpy(value) -> np.ndarray:
    """A result as numpy. tract computes a Cast to int64 (the step counter's next value) as its symbolic-dim
    type TDim, which its Python API does not hand out: that one is converted to i64 first."""
    try:
        return value.to_numpy()
    except tract.TractError:
        return value.convert_to(tract.DatumType.I64).to_numpy()


def _static(vi: onnx.ValueInfoProto) -> tuple | None:
    dims = vi.type.tensor_type.shape.dim if vi.type.tensor_type.HasField("shape") else None
    if dims is None or not all(d.HasField("dim_value") for d in dims):
        return None
    return tuple(d.dim_value for d in dims)
