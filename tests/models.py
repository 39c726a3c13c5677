"""Shared builders for the small models tests write by hand: one place knows a test model's header
(the default-domain opset, the training domain when asked, an IR version stock onnxruntime reads)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

TRAIN = "ai.onnx.preview.training"
IR_VERSION = 10


def vi(name: str, shape=None, dtype: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    """A typed value; ``shape=None`` leaves the shape unknown."""
    return helper.make_tensor_value_info(name, dtype, shape)


def tensors(inits: Mapping[str, np.ndarray] | Iterable[onnx.TensorProto] = ()) -> list[onnx.TensorProto]:
    """Initializers from a name -> array mapping, or TensorProtos as they are."""
    if isinstance(inits, Mapping):
        return [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()]
    return list(inits)


def model_of(graph: onnx.GraphProto, *, opset: int = 17, training: bool = False,
             ir_version: int = IR_VERSION) -> onnx.ModelProto:
    """Wrap a graph into a model at ``opset``, importing the training domain when ``training``."""
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(TRAIN, 1)] if training else [])
    m = helper.make_model(graph, opset_imports=opsets)
    m.ir_version = ir_version
    return m


def model(nodes, inputs, outputs, inits=(), *, name: str = "m", opset: int = 17, training: bool = False,
          ir_version: int = IR_VERSION) -> onnx.ModelProto:
    """A one-graph model from nodes, value infos and initializers (a mapping or TensorProtos)."""
    graph = helper.make_graph(list(nodes), name, list(inputs), list(outputs), initializer=tensors(inits))
    return model_of(graph, opset=opset, training=training, ir_version=ir_version)


def run_ort(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of ``model`` by name, from stock onnxruntime on the CPU; feeds it has no input for are left out."""
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {k: v for k, v in feeds.items()
                                                                          if k in names})))
