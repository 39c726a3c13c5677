"""hvp through convolutions with symbolic batch and spatial dims (Conv, Relu, MaxPool), where reverse over
reverse (a Gradient of a Gradient) needs static spatial sizes: the tangent of a convolution is two
convolutions with the node's own attributes, whatever the shapes. A float32 model (onnxruntime has no
float64 Conv) against torch in float64 on the same values, within 2e-4 of the reference's max abs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onnx import helper

import onnx_autodiff as oa
from tests.models import model, vi
from tests.torch_export import session


def cnn(group: int, stride: int, w: np.ndarray):
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1], strides=[stride, stride], group=group),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[1, 1]),
             helper.make_node("Mul", ["p", "p"], ["p2"]), helper.make_node("ReduceSum", ["p2"], ["loss"], keepdims=0)]
    return model(nodes, [vi("x", ["N", 4, "H", "W"])], [vi("loss", [])], {"W": w})


def torch_loss(group, stride):
    def f(w, x):
        p = F.max_pool2d(F.relu(F.conv2d(x, w, padding=1, stride=stride, groups=group)), 2, stride=1)
        return (p * p).sum()
    return f


@pytest.mark.parametrize("group,stride", [(1, 1), (2, 2), (4, 1)])
def test_hvp_through_conv_relu_maxpool_with_symbolic_spatial_dims(group, stride):
    rng = np.random.default_rng(group + stride)
    w, vw = (rng.standard_normal((4, 4 // group, 3, 3)).astype(np.float32) for _ in range(2))
    x, vx = (rng.standard_normal((2, 4, 7, 6)).astype(np.float32) for _ in range(2))
    out = oa.hvp(cnn(group, stride, w), ["W", "x"])
    gw, gx, hw, hx = session(out).run(["W.grad", "x.grad", "W.hvp", "x.hvp"],
                                      {"x": x, "W.tangent": vw, "x.tangent": vx})
    f = torch_loss(group, stride)
    args = (torch.tensor(w, dtype=torch.float64), torch.tensor(x, dtype=torch.float64))
    rgw, rgx = torch.autograd.functional.jacobian(f, args)
    v = tuple(torch.tensor(t, dtype=torch.float64) for t in (vw, vx))
    _, (rhw, rhx) = torch.autograd.functional.hvp(f, args, v)
    for got, want in ((gw, rgw), (gx, rgx), (hw, rhw), (hx, rhx)):
        want = want.numpy()
        assert np.abs(got - want).max() <= 2e-4 * np.abs(want).max()
