"""Model rewrites that gradcheck and the driver share: float64 promotion, lifting initializers."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from .graph import walk_graphs

_F32 = TensorProto.FLOAT
_F64 = TensorProto.DOUBLE
_DTYPE_ATTRS = {"to", "dtype", "output_dtype"}


def _tensor_to_f64(t: onnx.TensorProto) -> None:
    if t.data_type == _F32:
        arr = numpy_helper.to_array(t).astype(np.float64)
        t.CopyFrom(numpy_helper.from_array(arr, t.name))


def _type_to_f64(tp: onnx.TypeProto) -> None:
    if tp.HasField("tensor_type") and tp.tensor_type.elem_type == _F32:
        tp.tensor_type.elem_type = _F64


def _graph_to_f64(g: onnx.GraphProto) -> None:
    for t in g.initializer:
        _tensor_to_f64(t)
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        _type_to_f64(vi.type)
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                _tensor_to_f64(a.t)
            elif a.type == onnx.AttributeProto.INT and a.name in _DTYPE_ATTRS and a.i == _F32:
                a.i = _F64


def to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` computing in float64 wherever it computed in float32."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for g in walk_graphs(out):
        _graph_to_f64(g)
    return out


def lift_initializers(model: onnx.ModelProto, names) -> None:
    """Make the named initializers graph inputs too (their values stay as defaults), in place."""
    have = {i.name for i in model.graph.input}
    for t in model.graph.initializer:
        if t.name in names and t.name not in have:
            model.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
