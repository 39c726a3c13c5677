"""The five models the forward mode is held against PyTorch on: an MLP, a CNN (BatchNorm in eval mode,
MaxPool), a TransformerEncoderLayer (eval: its Dropout exported away), an LSTM and a self-attention block.

Each comes in two forms: ``features`` returns a tensor (for jvp and jacobian), ``scalar`` a weighted sum of
it or a cross-entropy (for hvp). Exported by tests/torch_export.py (TorchScript, opset 17, no constant
folding: parameters and buffers keep their state_dict names); the references run the same float32 values
in float64 through ``torch.func.functional_call``.
"""
from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.integration.test_torch_models import BatchNorm2d, randomize
from tests.torch_export import export, float_initializers


class MLP(nn.Module):
    def __init__(self, scalar: bool):
        super().__init__()
        self.scalar = scalar
        self.fc1, self.fc2, self.fc3 = nn.Linear(3, 8), nn.Linear(8, 6), nn.Linear(6, 2)
        self.register_buffer("w", torch.randn(4, 2))

    def forward(self, x):
        y = self.fc3(torch.sigmoid(self.fc2(torch.tanh(self.fc1(x)))))
        return (y * self.w).sum() if self.scalar else y


class CNN(nn.Module):
    """Conv-BN-ReLU-MaxPool, Conv-BN-ReLU, Flatten, Linear (Gemm); the scalar form adds cross-entropy."""

    def __init__(self, scalar: bool):
        super().__init__()
        self.scalar = scalar
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1)
        self.bn1 = BatchNorm2d(3)
        self.conv2 = nn.Conv2d(3, 4, 3, stride=2)
        self.bn2 = BatchNorm2d(4)
        self.fc = nn.Linear(16, 3)
        self.register_buffer("targets", torch.tensor([0, 2]))

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2, stride=1)
        logits = self.fc(torch.flatten(F.relu(self.bn2(self.conv2(h))), 1))
        return F.cross_entropy(logits, self.targets) if self.scalar else logits


class Transformer(nn.Module):
    def __init__(self, scalar: bool):
        super().__init__()
        self.scalar = scalar
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.1, activation="gelu",
                                                batch_first=True)
        self.register_buffer("w", torch.randn(2, 3, 8))

    def forward(self, x):
        y = self.layer(x)
        return (y * self.w).sum() if self.scalar else y


class LSTM(nn.Module):
    def __init__(self, scalar: bool):
        super().__init__()
        self.scalar = scalar
        self.rnn = nn.LSTM(3, 4, batch_first=True)
        self.register_buffer("w", torch.randn(2, 3, 4))
        self.register_buffer("w_c", torch.randn(1, 2, 4))

    def forward(self, x):
        y, (_, c) = self.rnn(x)
        return (y * self.w).sum() + (c * self.w_c).sum() if self.scalar else y


class Attention(nn.Module):
    """Self-attention (q/k/v projections, scaled dot products, softmax, output projection) with a residual."""

    def __init__(self, scalar: bool):
        super().__init__()
        self.scalar = scalar
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.register_buffer("w", torch.randn(2, 3, 8))

    def forward(self, x):
        y = x + self.attn(x, x, x, need_weights=False)[0]
        return (y * self.w).sum() if self.scalar else y


INPUTS = {"mlp": (MLP, (4, 3)), "cnn": (CNN, (2, 2, 6, 6)), "transformer": (Transformer, (2, 3, 8)),
          "lstm": (LSTM, (2, 3, 3)), "attention": (Attention, (2, 3, 8))}


class Exported:
    """One model exported: the module (eval mode), the ONNX model, its float initializers and the input x."""

    def __init__(self, name: str, scalar: bool):
        cls, shape = INPUTS[name]
        torch.manual_seed(len(name))
        self.module = randomize(cls(scalar), seed=len(name) + scalar)
        self.x = torch.randn(shape).numpy()
        self.output = "loss" if scalar else "y"
        self.onnx = export(self.module, (torch.tensor(self.x),), ["x"], output_names=(self.output,))
        self.inits = float_initializers(self.onnx)

    def function(self, names: list[str]):
        """f(*tensors) in float64: the module with the named initializers (and ``x``) taken from the arguments,
        the other initializers at their exported values."""
        module = copy.deepcopy(self.module).double()
        fixed = {k: torch.tensor(v.astype(np.float64)) for k, v in self.inits.items() if k not in names}
        x0 = torch.tensor(self.x.astype(np.float64))

        def f(*tensors):
            given = dict(zip(names, tensors))
            params = {**fixed, **{k: v for k, v in given.items() if k != "x"}}
            fast = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)  # the fused eval kernel has no forward AD
            try:
                with sdpa_kernel(SDPBackend.MATH):  # nor has the flash kernel; the plain one has both
                    return torch.func.functional_call(module, params, (given.get("x", x0),))
            finally:
                torch.backends.mha.set_fastpath_enabled(fast)

        return f

    def values(self, names: list[str]) -> tuple:
        return tuple(torch.tensor((self.x if n == "x" else self.inits[n]).astype(np.float64)) for n in names)
