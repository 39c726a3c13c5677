"""Whole PyTorch models, exported to ONNX, differentiated by us, held against torch autograd.

Each model computes its scalar loss inside ``forward``. We add a Gradient node of the loss w.r.t. every
float initializer (every parameter and float buffer: the export keeps them under their state_dict
names, see tests/torch_export.py) and every float input, lower it, run it in float32 onnxruntime and
compare with torch autograd in float64 on the same float32 values, through
``torch.func.functional_call`` with those values as leaves. Each gradient must be within 1e-4 of the
max abs of its reference tensor.

BatchNorm in eval mode: torch's batch_norm gives the running statistics no gradient, while they are
ordinary inputs of ONNX BatchNormalization, so the reference computes eval-mode BatchNorm by hand
(the export still sees nn.BatchNorm2d).
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.torch_export import annotate_unknown_shapes, assert_close, export, float_initializers, lowered_gradients

RTOL = 1e-4


class BatchNorm2d(nn.BatchNorm2d):
    """Exports as BatchNormalization; outside the export, eval mode by hand so the running mean and
    variance get gradients in the reference as they do in ONNX."""

    def forward(self, x):
        if self.training or torch.onnx.is_in_onnx_export():
            return super().forward(x)
        c = (1, -1, 1, 1)
        scale = self.weight.view(c) * torch.rsqrt(self.running_var.view(c) + self.eps)
        return (x - self.running_mean.view(c)) * scale + self.bias.view(c)


class CNN(nn.Module):
    """Conv-BN-ReLU-MaxPool, Conv-BN-ReLU, global average pool, Linear, cross-entropy."""

    def __init__(self, targets):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.bn1 = BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 6, 3, stride=2, bias=False)
        self.bn2 = BatchNorm2d(6)
        self.fc = nn.Linear(6, 3)
        self.register_buffer("targets", targets)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2, stride=1)
        h = F.relu(self.bn2(self.conv2(h)))
        logits = self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))
        return F.cross_entropy(logits, self.targets)


class ResidualBlock(nn.Module):
    """Bottleneck residual block: 1x1 conv, grouped 3x3 conv, 1x1 conv, BN after each, identity skip."""

    def __init__(self, channels=4, width=6, groups=2):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, width, 1, bias=False)
        self.bn1 = BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, groups=groups, bias=False)
        self.bn2 = BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, channels, 1, bias=False)
        self.bn3 = BatchNorm2d(channels)
        self.register_buffer("w", torch.randn(2, channels, 5, 5))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        out = F.relu(self.bn3(self.conv3(h)) + x)
        return (out * self.w).sum()


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=24, dropout=0.1, activation="gelu",
                                                batch_first=True)
        self.register_buffer("w", torch.randn(2, 3, 16))

    def forward(self, x):
        return (self.layer(x) * self.w).sum()


class LSTM(nn.Module):
    """Uses all three outputs: the sequence, the last hidden state and the last cell state."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(3, 5, batch_first=True)
        self.register_buffer("w", torch.randn(2, 4, 5))
        self.register_buffer("w_h", torch.randn(1, 2, 5))
        self.register_buffer("w_c", torch.randn(1, 2, 5))

    def forward(self, x):
        y, (h, c) = self.rnn(x)
        return (y * self.w).sum() + (h * self.w_h).sum() + (c * self.w_c).sum()


class GRU(nn.Module):
    """Two layers, both directions, sequence first."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 4, num_layers=2, bidirectional=True)
        self.register_buffer("w", torch.randn(4, 2, 8))
        self.register_buffer("w_h", torch.randn(4, 2, 4))

    def forward(self, x):
        y, h = self.rnn(x)
        return (y * self.w).sum() + (h * self.w_h).sum()


class EmbeddingLayerNorm(nn.Module):
    """Embedding (repeated tokens), LayerNorm, Linear, cross-entropy over every position."""

    def __init__(self, targets):
        super().__init__()
        self.embed = nn.Embedding(7, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 5)
        self.register_buffer("targets", targets)

    def forward(self, tokens):
        logits = self.head(self.norm(self.embed(tokens)))
        return F.cross_entropy(logits.reshape(-1, 5), self.targets)


def randomize(module: nn.Module, seed: int) -> nn.Module:
    """Random values for every float parameter and buffer: the defaults (ones, zeros) are equal across
    layers, and the exporter merges equal initializers into one."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if not t.is_floating_point():
                continue
            r = torch.randn(t.shape, generator=gen)
            if name.endswith("running_var"):
                r = 0.5 + r.abs()
            elif name.endswith(("bn1.weight", "bn2.weight", "bn3.weight", "norm.weight")):
                r = 0.5 + 0.5 * r.abs()
            elif t.dim() >= 2 and name.endswith("weight"):
                r = r / np.sqrt(t[0].numel())
            t.copy_(r)
    return module.eval()


def torch_gradients(module: nn.Module, inits: dict, inputs: dict) -> dict[str, np.ndarray]:
    """d(loss)/d(initializers, float inputs) by torch autograd in float64 on the exported values."""
    known = dict(module.state_dict())
    missing = sorted(set(inits) - set(known))
    assert not missing, f"initializers that are not parameters or buffers of the module: {missing}"
    m64 = copy.deepcopy(module).double()
    leaves = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in inits.items()}
    args = {k: torch.tensor(v.astype(np.float64) if v.dtype.kind == "f" else v, requires_grad=v.dtype.kind == "f")
            for k, v in inputs.items()}
    torch.func.functional_call(m64, leaves, tuple(args.values())).backward()
    out = {k: t.grad.numpy() for k, t in {**leaves, **args}.items() if t.requires_grad}
    nones = sorted(k for k, t in {**leaves, **args}.items() if t.requires_grad and t.grad is None)
    assert not nones, f"torch gives no gradient for {nones}"
    return out


def _cnn():
    torch.manual_seed(0)
    return CNN(torch.tensor([0, 2, 1])), {"x": torch.randn(3, 2, 7, 7)}


def _residual():
    torch.manual_seed(1)
    return ResidualBlock(), {"x": torch.randn(2, 4, 5, 5)}


def _transformer():
    torch.manual_seed(2)
    return Transformer(), {"x": torch.randn(2, 3, 16)}


def _lstm():
    torch.manual_seed(3)
    return LSTM(), {"x": torch.randn(2, 4, 3)}


def _gru():
    torch.manual_seed(4)
    return GRU(), {"x": torch.randn(4, 2, 3)}


def _embedding():
    torch.manual_seed(5)
    targets = torch.tensor([0, 4, 1, 1, 3, 2, 0, 4])
    return EmbeddingLayerNorm(targets), {"tokens": torch.tensor([[1, 3, 3, 0], [6, 1, 2, 3]])}


MODELS = {
    "cnn-batchnorm": (_cnn, {"Conv", "BatchNormalization", "MaxPool", "GlobalAveragePool", "SoftmaxCrossEntropyLoss"}),
    "residual-grouped-conv": (_residual, {"Conv", "BatchNormalization", "Add", "Relu"}),
    "transformer-encoder-gelu": (_transformer, {"LayerNormalization", "Softmax", "MatMul", "Erf"}),
    "lstm": (_lstm, {"LSTM"}),
    "gru-2-layer-bidirectional": (_gru, {"GRU"}),
    "embedding-layernorm": (_embedding, {"Gather", "LayerNormalization", "SoftmaxCrossEntropyLoss"}),
}


def exported(name: str):
    """(module, inputs, onnx model, float initializers, numpy feeds) for one entry of MODELS."""
    build, expected_ops = MODELS[name]
    module, inputs = build()
    randomize(module, seed=len(name))
    onnx_model = export(module, tuple(inputs.values()), list(inputs))
    ops = {n.op_type for n in onnx_model.graph.node}
    assert expected_ops <= ops, f"the export changed: {sorted(expected_ops - ops)} missing from {sorted(ops)}"
    assert "Dropout" not in ops  # eval mode exports dropout away
    feeds = {k: v.numpy() for k, v in inputs.items()}
    return module, onnx_model, float_initializers(onnx_model), feeds


def check_model(module, onnx_model, inits, feeds):
    xs = list(inits) + [k for k, v in feeds.items() if v.dtype.kind == "f"]
    ours = lowered_gradients(onnx_model, "loss", xs, feeds)
    assert_close(ours, torch_gradients(module, inits, feeds), RTOL)


@pytest.mark.parametrize("name", list(MODELS))
def test_model_gradients_match_torch(name):
    check_model(*exported(name))


def test_transformer_with_annotated_shapes_matches_torch():
    """nn.MultiheadAttention splits its in-projection with unflatten, a Reshape whose target is
    Concat(Slice(Shape(p), 0, Mod(Add(c, c), c)), ...): onnx's data propagation does not evaluate Mod,
    so those tensors have no rank for onnx. With them annotated by their run-time shapes (value_info,
    the remedy our rank errors suggest) the gradients match torch as well."""
    module, onnx_model, inits, feeds = exported("transformer-encoder-gelu")
    annotated, names = annotate_unknown_shapes(onnx_model, feeds)
    assert any("self_attn" in n for n in names), names
    check_model(module, annotated, inits, feeds)
