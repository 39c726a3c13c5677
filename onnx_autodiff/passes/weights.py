"""Keep the weights' bytes out of the way while lowering.

Lowering reads types and shapes, never the values of large float tensors, yet every shape inference,
model copy and check would otherwise serialize all of them (100 MB for a ResNet-50). ``detach_weights``
takes the raw data of the large float initializers out of the model (dims and type stay);
``attach_weights`` puts it back, and ``checkable`` gives a copy the checker accepts meanwhile, where
the detached tensors are typed graph inputs.
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

_FLOATS = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
MIN_BYTES = 1 << 16


def _top_graphs(model: onnx.ModelProto):
    yield "graph", model.graph
    for k, ti in enumerate(model.training_info):
        yield f"algorithm{k}", ti.algorithm
        yield f"initialization{k}", ti.initialization


def detach_weights(model: onnx.ModelProto, min_bytes: int = MIN_BYTES) -> dict[tuple[str, str], bytes]:
    """Empty the raw data of every float initializer of at least ``min_bytes``; returns the bytes."""
    store = {}
    for where, g in _top_graphs(model):
        for t in g.initializer:
            if t.data_type in _FLOATS and len(t.raw_data) >= min_bytes and t.data_location != TensorProto.EXTERNAL:
                store[(where, t.name)] = t.raw_data
                t.raw_data = b""
    return store


def attach_weights(model: onnx.ModelProto, store: dict[tuple[str, str], bytes]) -> None:
    for where, g in _top_graphs(model):
        for t in g.initializer:
            data = store.get((where, t.name))
            if data is not None and not t.raw_data:
                t.raw_data = data


def checkable(model: onnx.ModelProto, store: dict[tuple[str, str], bytes]) -> onnx.ModelProto:
    """A copy in which each detached initializer is a graph input of its type and shape."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for where, g in _top_graphs(m):
        keep = [t for t in g.initializer if (where, t.name) not in store]
        gone = [t for t in g.initializer if (where, t.name) in store]
        if not gone:
            continue
        del g.initializer[:]
        g.initializer.extend(keep)
        inputs = {i.name for i in g.input}
        g.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in gone
                       if t.name not in inputs)
    return m
