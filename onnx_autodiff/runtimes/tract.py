"""tract as a bundle runner. tract plans a model for fixed input shapes: one plan per shape of the feeds
(the batch size may change at the last batch of an epoch), with the facts of outputs that are not static or of
rank 0 cleared (tract cannot unify a symbolic dim it was told with the concrete one it plans, nor rank 0 with the
[1] it gives rank-0 outputs). tract hands a rank-0 output back with shape (1,): outputs declared with a static shape
are reshaped to it (the iteration counter stays a scalar); an int64 Cast comes back as tract's TDim, converted to
i64."""
from __future__ import annotations

import numpy as np
import onnx
import tract

from ..errors import BundleError
from .loop import check_feeds
from .refusal import refused

_DT = {np.dtype(t): name for t, name in ((np.float32, "f32"), (np.float64, "f64"), (np.float16, "f16"),
                                         (np.int64, "i64"), (np.int32, "i32"), (np.int16, "i16"), (np.int8, "i8"),
                                         (np.uint64, "u64"), (np.uint32, "u32"), (np.uint16, "u16"), (np.uint8, "u8"),
                                         (np.bool_, "bool"))}


def version() -> str:
    from importlib.metadata import version as installed

    return installed("tract")


def load(path: str):
    graph = onnx.load(path, load_external_data=False).graph
    inputs = [i.name for i in graph.input]
    outputs = [o.name for o in graph.output]
    shapes = {o.name: _static(o) for o in graph.output}
    plans = {}

    def plan(arrays):
        key = tuple((a.shape, a.dtype.str) for a in arrays)
        if key not in plans:
            try:
                model = tract.onnx().load(path)
            except tract.bindings.TractError as e:
                raise refused("tract", "convert", path, e) from None
            for k, a in enumerate(arrays):
                if a.ndim:  # a rank-0 input keeps the model's own fact (tract reads a bare "f32" as rank 1)
                    model.set_input_fact(k, f"{','.join(str(d) for d in a.shape)},{_DT[a.dtype]}")
            for k, name in enumerate(outputs):
                if not shapes[name]:  # a symbolic dim (or rank 0, which tract reads as [1]) would not unify
                    model.set_output_fact(k, None)
            try:
                plans[key] = model.into_model().into_runnable()  # (into_optimized folds state inputs away)
            except tract.bindings.TractError as e:
                raise refused("tract", "convert", path, e) from None
        return plans[key]

    def run(feeds):
        check_feeds(path, "tract", inputs, feeds)
        missing = [n for n in inputs if n not in feeds]
        if missing:
            raise BundleError(f"{path!r} (tract): no feed for the inputs {missing[:5]}")
        arrays = [np.ascontiguousarray(feeds[n]) for n in inputs]
        runnable = plan(arrays)
        try:
            result = runnable.run(arrays)
        except tract.bindings.TractError as e:
            raise refused("tract", "run", path, e) from None
        out = {n: _numpy(r) for n, r in zip(outputs, result)}
        for n, shape in shapes.items():
            if shape is not None and out[n].shape != shape and out[n].size == int(np.prod(shape)):
                out[n] = out[n].reshape(shape)
        return out
    return run


def _numpy(value) -> np.ndarray:
    """A result as numpy. tract computes a Cast to int64 as its symbolic-dim type TDim, which its Python API does
    not hand out: that one is converted to i64 first. Bundles written now have none among their outputs (the
    counter is fed as int64 on the tract and portable targets); this keeps older bundles, whose step cast it from
    int32, training here."""
    try:
        return value.to_numpy()
    except tract.TractError:
        return value.convert_to(tract.DatumType.I64).to_numpy()


def _static(vi: onnx.ValueInfoProto) -> tuple | None:
    dims = vi.type.tensor_type.shape.dim if vi.type.tensor_type.HasField("shape") else None
    if dims is None or not all(d.HasField("dim_value") for d in dims):
        return None
    return tuple(d.dim_value for d in dims)
