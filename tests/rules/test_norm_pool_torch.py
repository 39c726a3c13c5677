"""LpPool, GlobalLpPool and LRN gradients against torch float64 autograd.

onnxruntime 1.31 CPU has no float64 kernel for these ops, so the lowered gradient runs in float32 and
is held against torch autograd (float64) of the ONNX definition on the same inputs, as in
tests/rules/test_conv_torch.py. The torch functions spell out the ONNX formulas: LpPool sums |x|^p
(onnxruntime takes the absolute value; torch's lp_pool does not), and LRN's channel window is
[c - floor((size-1)/2), c + ceil((size-1)/2)] (torch's local_response_norm mirrors it for even sizes;
onnxruntime rejects even sizes, so only odd ones run here).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onnx_autodiff.testing import In, RuleCase
from tests.rules.test_conv_torch import assert_matches_torch


def f32(*shape, **kw):
    return In(shape, dtype="float32", **kw)


def lp_pool(p, kernel, stride=None, pads=None):
    r = len(kernel)
    pool = [F.avg_pool1d, F.avg_pool2d, F.avg_pool3d][r - 1]

    def fn(x0):
        z = x0.abs() ** p
        if pads:
            spec = []
            for i in reversed(range(r)):
                spec += [pads[i], pads[r + i]]
            z = F.pad(z, spec)
        s = pool(z, kernel, stride=stride or 1) * float(torch.tensor(kernel).prod())
        return s ** (1.0 / p)
    return fn


def lrn(size, alpha=1e-4, beta=0.75, bias=1.0):
    lo, hi = (size - 1) // 2, (size - 1) - (size - 1) // 2

    def fn(x0):
        sq = x0 ** 2
        pad = [0, 0] * (x0.dim() - 2) + [lo, hi]
        windows = F.pad(sq, pad).unfold(1, size, 1).sum(-1)
        return x0 / (bias + alpha / size * windows) ** beta
    return fn


# values kept away from zero: |x|^(p-1) sign(x) has a kink there for p < 2
_X = dict(low=-2.0, high=2.0, gap=0.2)

CASES = [
    (RuleCase("LpPool", [f32(2, 3, 5, 6, **_X)], attrs={"p": 2, "kernel_shape": [2, 3]}, id="p2"),
     lp_pool(2, [2, 3])),
    (RuleCase("LpPool", [f32(2, 3, 7, **_X)], attrs={"p": 3, "kernel_shape": [3], "strides": [2]}, id="p3-1d-stride"),
     lp_pool(3, [3], stride=2)),
    (RuleCase("LpPool", [f32(1, 2, 5, 5, **_X)], attrs={"p": 1, "kernel_shape": [3, 3], "strides": [2, 2],
                                                        "pads": [1, 0, 1, 2]}, id="p1-pads"),
     lp_pool(1, [3, 3], stride=2, pads=[1, 0, 1, 2])),
    (RuleCase("LpPool", [f32(1, 2, 6, 5, **_X)], attrs={"p": 2, "kernel_shape": [2, 2], "strides": [2, 2],
                                                        "ceil_mode": 1}, opset=18, id="ceil-opset18"),
     lambda x0: lp_pool(2, [2, 2], stride=2, pads=[0, 0, 0, 1])(x0)),
    (RuleCase("GlobalLpPool", [f32(2, 3, 4, 5, **_X)], attrs={"p": 3}, id="p3"),
     lambda x0: (x0.abs() ** 3).sum(dim=(2, 3), keepdim=True) ** (1 / 3)),
    (RuleCase("GlobalLpPool", [f32(2, 3, 4)], id="default-p2"),
     lambda x0: (x0 ** 2).sum(dim=2, keepdim=True).sqrt()),
    (RuleCase("LRN", [f32(2, 5, 3, 4)], attrs={"size": 3, "alpha": 0.5, "beta": 0.6, "bias": 1.5}, id="odd"),
     lrn(3, 0.5, 0.6, 1.5)),
    (RuleCase("LRN", [f32(2, 6, 3, 2)], attrs={"size": 1, "alpha": 0.9}, id="size1-defaults"),
     lrn(1, 0.9)),
    (RuleCase("LRN", [f32(1, 4, 2, 3)], attrs={"size": 5, "alpha": 1.0, "beta": 1.0, "bias": 2.0}, opset=12,
              id="wide-opset12"),
     lrn(5, 1.0, 1.0, 2.0)),
]


@pytest.mark.parametrize("case,fn", CASES, ids=[c.name for c, _ in CASES])
def test_matches_torch(case, fn):
    assert_matches_torch(case, fn)


def test_torch_lrn_matches_torch_builtin_for_odd_sizes():
    """The hand-written LRN is torch's local_response_norm where the two window conventions agree."""
    x = torch.randn(2, 5, 3, 4, dtype=torch.float64)
    torch.testing.assert_close(lrn(3, 0.5, 0.6, 1.5)(x), F.local_response_norm(x, 3, 0.5, 0.6, 1.5))
