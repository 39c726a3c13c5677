"""Small training models the CLI tests train (a two-layer MLP with Adam by default)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.training import make_training_model
from tests.models import model_of


def mlp(hidden=384, features=128, classes=10, seed=0, dtype=np.float32) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((rng.standard_normal((hidden, features)) * 0.05).astype(dtype), "W1"),
             numpy_helper.from_array(np.zeros(hidden, dtype), "b1"),
             numpy_helper.from_array((rng.standard_normal((classes, hidden)) * 0.05).astype(dtype), "W2"),
             numpy_helper.from_array(np.zeros(classes, dtype), "b2")]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], name="fc1", transB=1),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "W2", "b2"], ["logits"], name="fc2", transB=1)]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", elem, ["N", features])],
                          [helper.make_tensor_value_info("logits", elem, ["N", classes])], inits)
    return model_of(g, ir_version=8)


def mlp_training_model(optimizer="adam", lr=0.01, **kwargs) -> onnx.ModelProto:
    return make_training_model(mlp(**kwargs), "cross_entropy", optimizer, lr=lr)


def digits_like(n=256, features=128, classes=10, seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, features)).astype(np.float32), rng.integers(0, classes, n)


def transformer_block(d_model=16, heads=2, seq=4, classes=5, dtype="float32", seed=0) -> onnx.ModelProto:
    """One nn.TransformerEncoderLayer (dropout 0, batch_first) and a mean-pooled linear head, exported by
    torch's TorchScript exporter (imports torch): input x [N, seq, d_model], output logits [N, classes]."""
    import io
    import warnings

    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=2 * d_model, dropout=0.0,
                                                    batch_first=True)
            self.head = nn.Linear(d_model, classes)

        def forward(self, x):
            return self.head(self.layer(x).mean(dim=1))

    torch.manual_seed(seed)
    dt = getattr(torch, dtype)
    block = Block().to(dt).eval()
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(block, (torch.zeros(2, seq, d_model, dtype=dt),), buf, dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["logits"],
                          dynamic_axes={"x": {0: "N"}, "logits": {0: "N"}}, do_constant_folding=False,
                          training=torch.onnx.TrainingMode.TRAINING)
    return onnx.load_from_string(buf.getvalue())
