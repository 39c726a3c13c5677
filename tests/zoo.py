"""The nine light model-zoo CNNs shipped in the onnx package (opset 9), made trainable for tests:
their ConstantOfShape weight fills become random initializers: He-scaled conv and dense weights
(variance 2 / fan-in) and batch-norm statistics set to the per-channel mean and variance of each
BatchNormalization's input for a random image, so activations stay O(1) through every layer (with the
fills' placeholder statistics ResNet-50's logits were 1e4, ShuffleNet's 3e5) and gradients are neither
degenerate nor dominated by a few huge units."""
from __future__ import annotations

import os

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from tests.onnx_torch import run

LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
NAMES = ["bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet", "squeezenet",
         "vgg19", "zfnet512"]


def _fill(rng, shape, consumer, index):
    op = consumer.op_type if consumer is not None else ""
    if op in ("Conv", "Gemm") and index == 1:
        fan_in = int(np.prod(shape[1:])) if op == "Conv" else shape[-1] if consumer_trans_b(consumer) else shape[0]
        return rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)
    if op == "BatchNormalization" and index in (1, 4):
        return 1.0 + 0.1 * rng.random(shape)
    if op == "Mul":
        return 1.0 + 0.1 * rng.standard_normal(shape)
    return 0.05 * rng.standard_normal(shape)


def consumer_trans_b(node):
    return any(a.name == "transB" and a.i for a in node.attribute)


def zoo_model(name: str, seed: int = 0) -> onnx.ModelProto:
    """The light model ``name`` with random weights as initializers (float32), its own opset 9."""
    model = onnx.load(os.path.join(LIGHT, f"light_{name}.onnx"))
    rng = np.random.default_rng(seed)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    consumers = {}
    for n in model.graph.node:
        for k, i in enumerate(n.input):
            consumers.setdefault(i, (n, k))
    keep, weights = [], []
    for n in model.graph.node:
        if n.op_type == "ConstantOfShape" and n.input[0] in inits:
            shape = [int(d) for d in inits[n.input[0]]]
            consumer, index = consumers.get(n.output[0], (None, 0))
            while consumer is not None and consumer.op_type == "Unsqueeze":  # DenseNet's scale: Unsqueeze -> Mul
                consumer, index = consumers.get(consumer.output[0], (None, 0))
            weights.append(numpy_helper.from_array(_fill(rng, shape, consumer, index).astype(np.float32), n.output[0]))
        else:
            keep.append(n)
    del model.graph.node[:]
    model.graph.node.extend(keep)
    used = {i for n in keep for i in n.input}
    kept_inits = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept_inits + weights)
    names = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in names and i.name in used]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    model.ir_version = max(model.ir_version, 4)  # initializers that are not graph inputs
    _condition_batch_norms(model, RELU_SHIFT.get(name, 0.0))
    _calibrate_batch_norms(model, np.random.default_rng(seed + 100))
    return model


RELU_SHIFT = {"inception_v2": 1.5, "resnet50": 1.5}  # the mean of a Relu's input after a batch norm (93% active)
RESIDUAL_GAIN = 0.2  # the scale of a batch norm closing a residual branch


def _condition_batch_norms(model: onnx.ModelProto, shift: float) -> None:
    """Shifts and scales after batch norms that keep float32 rounding from growing layer by layer.

    After a calibrated batch norm every channel has mean 0 and variance 1. A Relu of N(0, 1) is half
    zeros and its output's variance is 0.34 of its second moment; the next batch norm divides by that
    variance while rounding errors scale with the second moment, so errors grow by sqrt(1.47) per layer
    (the (pi / (pi - 1)) gradient growth of batch-normed ReLU networks): float32 logits of Inception v2
    was 1e-5 off float64 with 1e-4 inside. A Relu of N(1.5, 1) grows them by 1.05 (``shift``; only
    where it helps: in DenseNet, whose concatenations keep early features, the shifted means make the
    next batch norms cancel digits instead, 2e-6 -> 8e-6). A residual branch closed at full scale adds a
    unit-variance block at each step; scaled by 0.2 (as
    "zero-init residual" schemes do) the stream stays nearer identity; ResNet-50 needs both (its float32
    logits: 2e-5 off with neither or with the scaling alone, 1e-6 with both)."""
    inits = {t.name: t for t in model.graph.initializer}
    readers, source = {}, {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
        if n.op_type == "Unsqueeze" and n.input[0] in inits:
            source[n.output[0]] = n.input[0]

    def init_of(node):
        for i in node.input[1:] if node.op_type in ("Mul", "Add") else []:
            if i in inits or i in source:
                return source.get(i, i)
        return None

    def scaled(name, fn):
        inits[name].CopyFrom(numpy_helper.from_array(fn(numpy_helper.to_array(inits[name])).astype(np.float32), name))

    for n in model.graph.node:
        if n.op_type != "BatchNormalization":
            continue
        scale, bias, out = [n.input[1]], n.input[2], n.output[0]
        while len(readers.get(out, [])) == 1 and init_of(readers[out][0]):
            nxt = readers[out][0]
            (scale.append if nxt.op_type == "Mul" else lambda _: None)(init_of(nxt))
            bias = init_of(nxt) if nxt.op_type == "Add" else bias
            out = nxt.output[0]
        ops = {r.op_type for r in readers.get(out, [])}
        if ops == {"Relu"} and shift:
            scaled(n.input[2], np.zeros_like)
            scaled(bias, lambda b: b + shift)
        elif ops & {"Sum", "Add"}:
            scaled(scale[-1], lambda s: s * RESIDUAL_GAIN)


def _calibrate_batch_norms(model: onnx.ModelProto, rng) -> None:
    """Each BatchNormalization's mean and variance := those of its input per channel for a random image
    (in float64, layer by layer in graph order, so each layer sees the statistics set before it)."""
    image, shape = first_input(model)
    stats = {}

    def visit(node, ins):
        if node.op_type == "BatchNormalization":
            x = ins[0]
            dims = [0] + list(range(2, x.dim()))
            ins[3].copy_(x.mean(dims))
            ins[4].copy_(x.var(dims, unbiased=False))
            stats[node.input[3]], stats[node.input[4]] = ins[3].numpy().copy(), ins[4].numpy().copy()

    with torch.no_grad():
        run(model, {image: torch.from_numpy(rng.standard_normal(shape))}, visit=visit)
    for t in model.graph.initializer:
        if t.name in stats:
            t.CopyFrom(numpy_helper.from_array(stats[t.name].astype(np.float32), t.name))


def first_input(model):
    vi = model.graph.input[0]
    return vi.name, [d.dim_value for d in vi.type.tensor_type.shape.dim]
