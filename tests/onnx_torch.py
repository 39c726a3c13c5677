"""A small ONNX -> torch interpreter for the ops of the model-zoo CNNs, in float64: the reference that
their lowered gradients are held against (torch autograd through the same computation).

Covers Conv, MaxPool, AveragePool, GlobalAveragePool, BatchNormalization (inference), LRN, Gemm,
Relu, Softmax, Reshape, Flatten, Transpose, Concat, Unsqueeze, Mul, Add, Sum, Dropout (inference).
"""
from __future__ import annotations

import math

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper


def _attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _explicit_pads(x, attrs, kernel, ceil=False):
    """(begins, ends) of the spatial pads, auto_pad made explicit."""
    r = len(kernel)
    strides = attrs.get("strides", [1] * r)
    dil = attrs.get("dilations", [1] * r)
    auto = attrs.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    size = list(x.shape[2:])
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        b, e = [], []
        for n, s, k, d in zip(size, strides, kernel, dil):
            total = max((math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n, 0)
            lo, hi = total // 2, total - total // 2
            b.append(lo if auto == "SAME_UPPER" else hi)
            e.append(hi if auto == "SAME_UPPER" else lo)
        return b, e
    pads = attrs.get("pads", [0] * (2 * r))
    return list(pads[:r]), list(pads[r:])


def _pad(x, begins, ends, value=0.0):
    spec = []
    for b, e in zip(reversed(begins), reversed(ends)):
        spec += [b, e]
    return F.pad(x, spec, value=value) if any(spec) else x


def _pool_out_pads(x, kernel, strides, begins, ends, ceil):
    """Extra end padding so that floor division gives the ceil_mode output size."""
    if not ceil:
        return ends
    out = []
    for n, k, s, b, e in zip(x.shape[2:], kernel, strides, begins, ends):
        o = math.ceil((n + b + e - k) / s) + 1
        out.append(e + max((o - 1) * s + k - (n + b + e), 0))
    return out


def run(model: onnx.ModelProto, feeds: dict[str, torch.Tensor], dtype=np.float64, pieces=None,
        visit=None) -> dict[str, torch.Tensor]:
    """Every tensor of the model's graph; float initializers not in ``feeds`` are taken as ``dtype``.

    ``pieces`` ({tensor name: array}): the inputs of Relu and MaxPool nodes as another run computed
    them (onnxruntime in float32); where given, the Relu mask and the MaxPool argmax come from those
    values, so autograd differentiates the same linear piece that run was on. ``visit(node, inputs)``
    is called before each node (tests/zoo.py sets batch-norm statistics with it)."""
    pieces = pieces or {}
    env = dict(feeds)
    for t in model.graph.initializer:
        v = numpy_helper.to_array(t)
        env.setdefault(t.name, torch.from_numpy(v.astype(dtype) if v.dtype.kind == "f" else v.copy()))
    for node in model.graph.node:
        a = _attrs(node)
        ins = [env[i] if i else None for i in node.input]
        if visit is not None:
            visit(node, ins)
        op = node.op_type
        piece = pieces.get(node.input[0]) if node.input else None
        if op == "Conv":
            x, w = ins[0], ins[1]
            kernel = list(w.shape[2:])
            b, e = _explicit_pads(x, a, kernel)
            y = F.conv2d(_pad(x, b, e), w, ins[2] if len(ins) > 2 else None, stride=a.get("strides", 1),
                         dilation=a.get("dilations", 1), groups=a.get("group", 1))
        elif op == "MaxPool":
            x, kernel = ins[0], a["kernel_shape"]
            strides = a.get("strides", [1] * len(kernel))
            b, e = _explicit_pads(x, a, kernel)
            e = _pool_out_pads(x, kernel, strides, b, e, a.get("ceil_mode", 0))
            y = F.max_pool2d(_pad(x, b, e, -math.inf), kernel, strides)
            if piece is not None:  # the window maxima where the other run found them (first maximum on ties)
                _, at = F.max_pool2d(_pad(torch.from_numpy(piece), b, e, -math.inf), kernel, strides,
                                     return_indices=True)
                flat = _pad(x, b, e, -math.inf).flatten(2)
                y = flat.gather(2, at.flatten(2)).view(y.shape)
        elif op == "AveragePool":
            x, kernel = ins[0], a["kernel_shape"]
            strides = a.get("strides", [1] * len(kernel))
            b, e0 = _explicit_pads(x, a, kernel)
            e = _pool_out_pads(x, kernel, strides, b, e0, a.get("ceil_mode", 0))
            sums = F.avg_pool2d(_pad(x, b, e), kernel, strides) * float(np.prod(kernel))
            ones = torch.ones_like(x[:1, :1])
            if a.get("count_include_pad", 0):  # the explicit pads count, the ceil_mode overhang does not
                ones = _pad(ones, b, e0, 1.0)
                b, e = [0] * len(b), [p - q for p, q in zip(e, e0)]
            counts = F.avg_pool2d(_pad(ones, b, e), kernel, strides) * float(np.prod(kernel))
            y = sums / counts
        elif op == "GlobalAveragePool":
            y = ins[0].mean(dim=tuple(range(2, ins[0].dim())), keepdim=True)
        elif op == "BatchNormalization":
            x, s, bias, mean, var = ins[:5]
            c = [1, -1] + [1] * (x.dim() - 2)
            y = (x - mean.view(c)) / torch.sqrt(var.view(c) + a.get("epsilon", 1e-5)) * s.view(c) + bias.view(c)
        elif op == "LRN":
            x, size = ins[0], a["size"]
            sq = _pad((x * x).unsqueeze(1), [(size - 1) // 2, 0, 0], [size - 1 - (size - 1) // 2, 0, 0])
            ssum = F.avg_pool3d(sq, (size, 1, 1), stride=1).squeeze(1) * size
            y = x / (a.get("bias", 1.0) + a.get("alpha", 1e-4) / size * ssum) ** a.get("beta", 0.75)
        elif op == "Gemm":
            x, w = ins[0], ins[1]
            x = x.t() if a.get("transA", 0) else x
            w = w.t() if a.get("transB", 0) else w
            y = a.get("alpha", 1.0) * (x @ w)
            if len(ins) > 2 and ins[2] is not None:
                y = y + a.get("beta", 1.0) * ins[2]
        elif op == "Relu":
            y = torch.relu(ins[0]) if piece is None else ins[0] * torch.from_numpy(piece > 0)
        elif op == "Softmax":
            x, axis = ins[0], a.get("axis", 1)
            flat = x.reshape(int(np.prod(x.shape[:axis])), -1)
            y = torch.softmax(flat, dim=1).reshape(x.shape)
        elif op == "Reshape":
            shape = [int(v) for v in ins[1].tolist()]
            shape = [ins[0].shape[i] if v == 0 else v for i, v in enumerate(shape)]
            y = ins[0].reshape(shape)
        elif op == "Flatten":
            axis = a.get("axis", 1)
            y = ins[0].reshape(int(np.prod(ins[0].shape[:axis])), -1)
        elif op == "Transpose":
            y = ins[0].permute(*a["perm"])
        elif op == "Concat":
            y = torch.cat(ins, dim=a["axis"])
        elif op == "Constant":
            y = torch.from_numpy(numpy_helper.to_array(a["value"]).copy())
        elif op == "Unsqueeze":
            y = ins[0]
            for ax in sorted(a["axes"] if "axes" in a else ins[1].tolist()):
                y = y.unsqueeze(ax)
        elif op == "Mul":
            y = ins[0] * ins[1]
        elif op == "Add":
            y = ins[0] + ins[1]
        elif op == "Sum":
            y = ins[0]
            for t in ins[1:]:
                y = y + t
        elif op == "Dropout":
            y = ins[0]
        else:
            raise NotImplementedError(op)
        env[node.output[0]] = y
    return env
