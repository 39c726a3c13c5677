"""Small training models the CLI tests train (a two-layer MLP with Adam by default)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.training_builder import make_training_model
from tests.models import model_of


def mlp(hidden=384, features=128, classes=10, seed=0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((rng.standard_normal((hidden, features)) * 0.05).astype(np.float32), "W1"),
             numpy_helper.from_array(np.zeros(hidden, np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((classes, hidden)) * 0.05).astype(np.float32), "W2"),
             numpy_helper.from_array(np.zeros(classes, np.float32), "b2")]
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], name="fc1", transB=1),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "W2", "b2"], ["logits"], name="fc2", transB=1)]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", features])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])], inits)
    return model_of(g, ir_version=8)


def mlp_training_model(optimizer="adam", lr=0.01, **kwargs) -> onnx.ModelProto:
    return make_training_model(mlp(**kwargs), "cross_entropy", optimizer, lr=lr)


def digits_like(n=256, features=128, classes=10, seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, features)).astype(np.float32), rng.integers(0, classes, n)
