"""Convolution, pooling and normalization gradients against torch autograd.

onnxruntime's CPU provider has no float64 kernel for Conv, ConvTranspose, AveragePool,
GlobalAveragePool, GlobalMaxPool or InstanceNormalization (checked on onnxruntime 1.31), so the
float64 finite-difference sweep in tests/cases cannot run them. Here the lowered gradient runs in
float32 onnxruntime and is held against torch autograd run in float64 on the same (float32) inputs;
float32 accumulation keeps the error near 1e-6 of the gradient's scale, so 1e-4 is a real check.
The ops that do run in float64 are also checked here when torch has a direct counterpart.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

import onnx_autodiff as oa
from onnx_autodiff.testing import In, RuleCase, rule_case_model

RTOL = 1e-4
TRAIN = "ai.onnx.preview.training"


def lowered_gradients(case: RuleCase, seed: int = 0):
    """(feeds, v, {input: gradient of sum(y0 * v)}) from our lowering, run in onnxruntime."""
    model, feeds, wrt = rule_case_model(case, seed)
    g = model.graph
    y = g.output[0]
    ys = _run(model, feeds)[y.name]
    v = np.random.default_rng(seed + 1).standard_normal(ys.shape).astype(ys.dtype)
    elem = y.type.tensor_type.elem_type
    g.input.append(helper.make_tensor_value_info("v", elem, list(ys.shape)))
    g.node.append(helper.make_node("Mul", [y.name, "v"], ["s/prod"], name="s/mul"))
    g.node.append(helper.make_node("ReduceSum", ["s/prod"], ["s"], name="s/sum", keepdims=0))
    names = [f"{w}_grad" for w in wrt]
    g.node.append(helper.make_node("Gradient", wrt, names, name="grad", domain=TRAIN, xs=wrt, y="s"))
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in g.input}
    for w, n in zip(wrt, names):
        g.output.append(helper.make_tensor_value_info(n, elem, shapes[w]))
    model.opset_import.append(helper.make_opsetid(TRAIN, 1))
    lowered = oa.lower(model)
    out = _run(lowered, {**feeds, "v": v})
    return feeds, v, {w: out[n] for w, n in zip(wrt, names)}


def _run(model, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in model.graph.output], sess.run(None, feeds)))


def torch_gradients(fn, feeds, v):
    ts = {k: torch.tensor(a.astype(np.float64), requires_grad=True) for k, a in feeds.items()}
    y = fn(**ts)
    (y * torch.tensor(v.astype(np.float64))).sum().backward()
    return {k: t.grad.numpy() if t.grad is not None else np.zeros_like(feeds[k], dtype=np.float64)
            for k, t in ts.items()}


def assert_matches_torch(case, fn, seed=0):
    feeds, v, ours = lowered_gradients(case, seed)
    ref = torch_gradients(fn, feeds, v)
    assert ours, "nothing was differentiated"
    for name, got in ours.items():
        want = ref[name]
        assert got.shape == want.shape, name
        scale = np.abs(want).max()
        assert scale > 0, f"the torch gradient of {name} is zero: the case tests nothing"
        err = np.abs(got.astype(np.float64) - want).max() / scale
        assert err <= RTOL, f"{case.name}: gradient of {name} off by {err:.2e} (relative to max |grad|)"


def f32(*shape, **kw):
    return In(shape, dtype="float32", **kw)


def _pads(p, r):
    """ONNX pads [b1.., e1..] as the per-side pads torch's F.pad wants (last axis first)."""
    out = []
    for i in reversed(range(r)):
        out += [p[i], p[r + i]]
    return out


def conv(r, stride=1, padding=(0,), dilation=1, groups=1, bias=True):
    def fn(x0, x1, x2=None):
        pad = list(padding) * (2 * r // len(padding))
        xp = F.pad(x0, _pads(pad, r))
        return [F.conv1d, F.conv2d, F.conv3d][r - 1](xp, x1, x2, stride=stride, dilation=dilation, groups=groups)
    return fn


CONV = [
    (RuleCase("Conv", [f32(2, 3, 7), f32(4, 3, 3), f32(4)], id="1d-bias"), conv(1)),
    (RuleCase("Conv", [f32(2, 4, 6, 5), f32(6, 2, 3, 2)],
              attrs={"group": 2, "strides": [2, 1], "dilations": [1, 2], "pads": [1, 0, 2, 1]}, id="2d-group-stride-dil"),
     lambda x0, x1: F.conv2d(F.pad(x0, [0, 1, 1, 2]), x1, stride=(2, 1), dilation=(1, 2), groups=2)),
    (RuleCase("Conv", [f32(2, 3, 8, 8), f32(3, 1, 3, 3), f32(3)], attrs={"group": 3, "pads": [1, 1, 1, 1]},
              id="depthwise"),
     lambda x0, x1, x2: F.conv2d(x0, x1, x2, padding=1, groups=3)),
    (RuleCase("Conv", [f32(1, 2, 9, 7), f32(3, 2, 3, 3)], attrs={"strides": [2, 3]}, id="stride-not-dividing"),
     lambda x0, x1: F.conv2d(x0, x1, stride=(2, 3))),
    (RuleCase("Conv", [f32(2, 2, 7, 6), f32(3, 2, 3, 2)], attrs={"auto_pad": "SAME_UPPER", "strides": [2, 2]},
              id="same-upper"),
     lambda x0, x1: F.conv2d(F.pad(x0, [0, 0, 1, 1]), x1, stride=2)),
    (RuleCase("Conv", [f32(2, 2, 6, 6), f32(3, 2, 4, 3)], attrs={"auto_pad": "SAME_LOWER"}, id="same-lower"),
     lambda x0, x1: F.conv2d(F.pad(x0, [1, 1, 2, 1]), x1)),
    (RuleCase("Conv", [f32(1, 2, 6, 5), f32(2, 2, 2, 2)], attrs={"auto_pad": "VALID", "strides": [2, 2]},
              id="valid"),
     lambda x0, x1: F.conv2d(x0, x1, stride=2)),
    (RuleCase("Conv", [f32(1, 2, 5, 4, 6), f32(2, 1, 2, 3, 2), f32(2)],
              attrs={"group": 2, "strides": [1, 2, 2], "pads": [1, 0, 1, 0, 1, 0]}, id="3d-group"),
     lambda x0, x1, x2: F.conv3d(F.pad(x0, [1, 0, 0, 1, 1, 0]), x1, x2, stride=(1, 2, 2), groups=2)),
    (RuleCase("Conv", [f32(2, 3, 8, 8), f32(4, 3, 3, 3)], attrs={"strides": [2, 2], "pads": [1, 1, 1, 1]},
              opset=11, id="opset11"),
     lambda x0, x1: F.conv2d(x0, x1, stride=2, padding=1)),
]

CONV_TRANSPOSE = [
    (RuleCase("ConvTranspose", [f32(2, 3, 5), f32(3, 2, 3), f32(2)], attrs={"strides": [2], "pads": [1, 1]},
              id="1d-stride"),
     lambda x0, x1, x2: F.conv_transpose1d(x0, x1, x2, stride=2, padding=1)),
    (RuleCase("ConvTranspose", [f32(1, 4, 4, 3), f32(4, 1, 3, 2)],
              attrs={"group": 2, "strides": [2, 3], "output_padding": [1, 2], "dilations": [2, 1]},
              id="2d-group-outpad"),
     lambda x0, x1: F.conv_transpose2d(x0, x1, stride=(2, 3), output_padding=(1, 2), dilation=(2, 1), groups=2)),
]

POOL = [
    (RuleCase("MaxPool", [f32(2, 3, 7, 6)], attrs={"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 1, 1]},
              id="overlap-pads"),
     lambda x0: F.max_pool2d(F.pad(x0, [0, 1, 1, 1], value=-float("inf")), (3, 2), stride=2)),
    (RuleCase("MaxPool", [f32(1, 2, 9)], attrs={"kernel_shape": [3], "strides": [2], "dilations": [2],
                                              "ceil_mode": 1}, id="1d-dilated-ceil"),
     lambda x0: F.max_pool1d(x0, 3, stride=2, dilation=2, ceil_mode=True)),
    (RuleCase("AveragePool", [f32(2, 3, 7, 6)], attrs={"kernel_shape": [3, 3], "strides": [2, 2],
                                                    "pads": [1, 1, 1, 1]}, id="exclude-pad"),
     lambda x0: F.avg_pool2d(x0, 3, stride=2, padding=1, count_include_pad=False)),
    (RuleCase("AveragePool", [f32(2, 3, 7, 6)], attrs={"kernel_shape": [3, 2], "strides": [2, 1],
                                                    "pads": [1, 1, 1, 0], "count_include_pad": 1}, id="include-pad"),
     lambda x0: F.avg_pool2d(x0, (3, 2), stride=(2, 1), padding=1, count_include_pad=True)[..., :-1]),
    (RuleCase("AveragePool", [f32(1, 2, 8)], attrs={"kernel_shape": [3], "strides": [2], "ceil_mode": 1},
              id="1d-ceil"),
     lambda x0: F.avg_pool1d(x0, 3, stride=2, ceil_mode=True)),
    (RuleCase("AveragePool", [f32(1, 2, 5, 4, 4)], attrs={"kernel_shape": [2, 2, 2], "strides": [2, 2, 2]},
              id="3d"),
     lambda x0: F.avg_pool3d(x0, 2, stride=2)),
    (RuleCase("GlobalAveragePool", [f32(2, 3, 4, 5)]), lambda x0: x0.mean(dim=(2, 3), keepdim=True)),
    (RuleCase("GlobalMaxPool", [f32(2, 3, 4, 5)]), lambda x0: x0.amax(dim=(2, 3), keepdim=True)),
]


@pytest.mark.parametrize("case,fn", CONV + CONV_TRANSPOSE + POOL, ids=[c.name for c, _ in CONV + CONV_TRANSPOSE + POOL])
def test_pool_conv_matches_torch(case, fn):
    assert_matches_torch(case, fn)
