"""The nine light model-zoo CNNs of the onnx package (opset 9) lower at their own opset and at their
opset-11 and opset-13 conversions, run in stock onnxruntime (float32), and their gradients match torch
float64 autograd through the same computation (tests/onnx_torch.py).

Weights are random (tests/zoo.py); the loss is <logits, v> for a random v (logits: the Softmax input);
the gradients checked are those of the image, the first and a middle Conv weight, a batch-norm scale
where there is one, and the last layer's weight. The default run holds SqueezeNet and Inception v1
(overlapping MaxPools, LRN, AveragePool, Concat, Dropout) at opset 9 and SqueezeNet converted;
``pytest -m sweep tests/integration/test_zoo_models.py`` runs all nine at opsets 9, 11 and 13 (several minutes).
"""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper, version_converter

import onnx_autodiff as oa
from onnx_autodiff.gradcheck import _gradient_model

from tests.onnx_torch import run as torch_run
from tests.zoo import NAMES, first_input, zoo_model

RTOL = 1e-5  # relative error of a float32 gradient tensor against float64 (SqueezeNet: < 4e-7)


def _logits(model):
    producer = {o: n for n in model.graph.node for o in n.output}
    out = model.graph.output[0].name
    node = producer[out]
    return node.input[0] if node.op_type == "Softmax" else out


def _wrt(model):
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    picks = [convs[0].input[1], convs[len(convs) // 2].input[1]]
    bns = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    if bns:
        picks.append(bns[len(bns) // 2].input[1])
    last = [n for n in model.graph.node if n.op_type in ("Gemm", "Conv")][-1]
    picks += list(last.input[1:])
    inits = {t.name for t in model.graph.initializer}
    return [p for p in dict.fromkeys(picks) if p in inits]


def torch_gradients(model, logits, wrt, image, x, v, dtype):
    """Autograd of <logits, v> through the model in ``dtype``."""
    leaves = {image: torch.tensor(x, dtype=dtype, requires_grad=True)}
    for t in model.graph.initializer:
        if t.name in wrt:
            leaves[t.name] = torch.tensor(onnx.numpy_helper.to_array(t), dtype=dtype, requires_grad=True)
    env = torch_run(model, leaves, dtype=np.float64 if dtype == torch.float64 else np.float32)
    (env[logits] * torch.tensor(v, dtype=dtype).reshape(env[logits].shape)).sum().backward()
    return {k: t.grad.double().numpy() for k, t in leaves.items()}, list(env[logits].shape)


def rel_err(got, ref):
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def check_zoo_model(name, opset):
    """Our float32 gradients (onnxruntime) against torch float64 autograd: relative error below RTOL, or
    where float32 itself cannot get that close (VGG-19, ResNet-50, Inception v2 with these random
    weights: torch's own float32 autograd is 1e-3 to 0.45 off float64), below 3x torch float32's error.

    onnxruntime runs at ORT_ENABLE_EXTENDED: at ORT_ENABLE_ALL (its NCHWc layout transforms) Inception
    v1's gradients drift to 2e-3 relative (at every opset, with either MaxPool gradient), 6e-7 without."""
    model = zoo_model(name)
    image, shape = first_input(model)
    logits = _logits(model)
    wrt = [image] + _wrt(model)
    x = np.random.default_rng(1).standard_normal(shape)
    v = np.random.default_rng(2).standard_normal(1000)
    expected, logits_shape = torch_gradients(model, logits, wrt, image, x, v, torch.float64)  # of the opset-9 model
    if opset != 9:
        model = version_converter.convert_version(model, opset)
    assert all(np.linalg.norm(g) > 0 for g in expected.values()), f"{name}: a zero reference gradient"

    shapes = {logits: logits_shape, **{w: list(expected[w].shape) for w in wrt}}
    if logits not in [o.name for o in model.graph.output]:
        model.graph.output.append(helper.make_tensor_value_info(logits, onnx.TensorProto.FLOAT, logits_shape))
    grad_model = _gradient_model(model, [logits], wrt, shapes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no silent conversion: the rules work at this opset
        lowered = oa.lower(grad_model)
    assert [o.version for o in lowered.opset_import if o.domain == ""] == [opset]
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    sess = ort.InferenceSession(lowered.SerializeToString(), so)
    got = sess.run([f"{w}__gradcheck_grad" for w in wrt],
                   {image: x.astype(np.float32), "gradcheck/v0": v.reshape(logits_shape).astype(np.float32)})
    errs = {w: rel_err(g, expected[w]) for w, g in zip(wrt, got)}
    bound = {w: RTOL for w in wrt}
    if max(errs.values()) >= RTOL:  # as close as float32 can be: torch's own float32 autograd is the yardstick
        single, _ = torch_gradients(zoo_model(name), logits, wrt, image, x, v, torch.float32)
        bound = {w: max(RTOL, 3 * rel_err(single[w], expected[w])) for w in wrt}
    print(name, opset, {k: f"{e:.1e} (bound {bound[k]:.1e})" for k, e in errs.items()})
    bad = {w: (errs[w], bound[w]) for w in wrt if errs[w] >= bound[w]}
    assert not bad, f"{name} opset {opset}: relative errors (error, bound) {bad}"


DEFAULT = [("squeezenet", 9), ("inception_v1", 9), ("squeezenet", 13)]
ALL = [(n, v) for n in NAMES for v in (9, 11, 13) if (n, v) not in DEFAULT]


@pytest.mark.parametrize("name,opset", DEFAULT, ids=[f"{n}-opset{v}" for n, v in DEFAULT])
def test_zoo_model_gradients_match_torch(name, opset):
    check_zoo_model(name, opset)


@pytest.mark.sweep
@pytest.mark.parametrize("name,opset", ALL, ids=[f"{n}-opset{v}" for n, v in ALL])
def test_every_zoo_model_at_9_11_13_matches_torch(name, opset):
    check_zoo_model(name, opset)
