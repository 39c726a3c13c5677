"""No identity Transpose (``perm`` 0, 1, ..., r-1) in what we emit: onnxruntime's GemmTransposeFusion folds
``perm=[0, 1]`` into a Gemm as if it were ``[1, 0]`` (microsoft/onnxruntime#32228), and it is a copy for nothing.

The lowered step models of small models of each kind (MLP, CNN with BatchNormalization and MaxPool,
TransformerEncoderLayer, LSTM) hold none; a forward identity Transpose (the user's, kept) gets no identity
Transpose in its backward, where the Transpose rule's inverse permutation would be one."""
from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from onnx_autodiff import build_step_model, lower, make_training_model
from onnx_autodiff.engine.cleanup import cleanup_nodes
from tests.cli_models import mlp, transformer_block


def identity_perm(node: onnx.NodeProto) -> bool:
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
    return node.op_type == "Transpose" and perm is not None and perm == list(range(len(perm)))


def _identity_transposes(graph: onnx.GraphProto) -> list[str]:
    found = [n.name for n in graph.node if identity_perm(n)]
    for n in graph.node:
        for a in n.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                found += _identity_transposes(sub)
    return found


def _export(module: nn.Module, x: torch.Tensor) -> onnx.ModelProto:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), (x,), buf, dynamo=False, opset_version=17, input_names=["x"],
                          output_names=["logits"], training=torch.onnx.TrainingMode.PRESERVE,
                          do_constant_folding=False)
    return onnx.load_from_string(buf.getvalue())


class _CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class _LSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


def _zoo(name: str) -> onnx.ModelProto:
    torch.manual_seed(0)
    if name == "mlp":
        return mlp(hidden=16, features=8, classes=3)
    if name == "transformer":
        return transformer_block(d_model=16, heads=2, seq=4, classes=3)
    if name == "cnn":
        return _export(_CNN(), torch.randn(2, 1, 8, 8))
    return _export(_LSTM(), torch.randn(2, 5, 6))


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "lstm"])
def test_lowered_step_model_has_no_identity_transpose(name):
    for optimizer in ("sgd", "adam"):
        step = build_step_model(lower(make_training_model(_zoo(name), "cross_entropy", optimizer, lr=0.01)))
        assert _identity_transposes(step.graph) == []


def _transposed_linear() -> onnx.ModelProto:
    """x [2, 3] -> Gemm with Transpose(W, perm=[0, 1]) -> logits: the forward's own identity Transpose of the
    weight, whose gradient by the Transpose rule is a Transpose of the inverse (the same) perm."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "W")
    nodes = [helper.make_node("Transpose", ["W"], ["Wt"], name="same", perm=[0, 1]),
             helper.make_node("Gemm", ["x", "Wt"], ["logits"], name="fc")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 4])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_backward_of_an_identity_transpose_emits_none():
    model = _transposed_linear()
    step = build_step_model(lower(make_training_model(model, "cross_entropy", "sgd", lr=0.1)))
    assert _identity_transposes(step.graph) == ["same"]  # the forward's own stays; the backward adds none
    x = np.random.default_rng(2).standard_normal((2, 3)).astype(np.float32)
    labels = np.array([1, 3], np.int64)
    sess = ort.InferenceSession(step.SerializeToString(), providers=["CPUExecutionProvider"])
    new_w, = sess.run(["train/W.new"], {"x": x, "labels": labels})
    w = torch.tensor(numpy_helper.to_array(model.graph.initializer[0]), requires_grad=True)
    nn.functional.cross_entropy(torch.tensor(x) @ w, torch.tensor(labels)).backward()
    np.testing.assert_allclose(new_w, (w - 0.1 * w.grad).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_cleanup_folds_an_emitted_identity_transpose_and_keeps_the_value():
    nodes = [helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("Transpose", ["r"], ["t"], name="t", perm=[0, 1, 2]),
             helper.make_node("Transpose", ["t"], ["u"], name="u", perm=[0, 2, 1]),
             helper.make_node("Transpose", ["u"], ["out"], name="out", perm=[0, 1, 2])]
    cleaned = cleanup_nodes([onnx.NodeProto.FromString(n.SerializeToString()) for n in nodes], {"out"})
    assert [(n.op_type, list(n.output)) for n in cleaned] == [("Relu", ["t"]), ("Transpose", ["out"])]
    a = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)
    results = []
    for body in (nodes, cleaned):
        g = helper.make_graph(body, "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3, 4])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        results.append(ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
                       .run(None, {"a": a})[0])
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], np.maximum(a, 0).transpose(0, 2, 1))
