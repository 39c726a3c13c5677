"""The nine light model-zoo CNNs shipped in the onnx package (opset 9), made trainable for tests:
their ConstantOfShape weight fills become random initializers (He-scaled conv and dense weights,
batch-norm statistics near identity), so gradients are not degenerate."""
from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import numpy_helper

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
    return model


def first_input(model):
    vi = model.graph.input[0]
    return vi.name, [d.dim_value for d in vi.type.tensor_type.shape.dim]
