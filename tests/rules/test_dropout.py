"""Dropout in training mode: the backward reuses the forward's mask.

Random dropout cannot be finite-differenced, so these tests run one lowered model and check that the
gradient of sum(y) w.r.t. x is exactly mask / (1 - ratio) for the very mask the forward used (and
that y = x * mask / (1 - ratio) with it). Deterministic cases (ratio 0, inference) are gradchecked
in onnx_autodiff/conformance/cases/dropout.py.
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_autodiff as oa

TRAIN = "ai.onnx.preview.training"


def backend_cases():
    """(node, inputs, outputs, name) of onnx's own test_training_dropout* cases, as ``expect`` got them."""
    import onnx.backend.test.case.node.dropout as mod

    seen = []
    saved = mod.expect
    mod.expect = lambda node, inputs, outputs, name, **kw: seen.append((node, inputs, outputs, name))
    try:
        for attr in sorted(dir(mod.Dropout)):
            if attr.startswith("export_training"):
                np.random.seed(0)
                getattr(mod.Dropout, attr)()
    finally:
        mod.expect = saved
    return seen


BACKEND = backend_cases()


def _run(model, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    return dict(zip(names, sess.run(names, feeds)))


def _mask_name(lowered):
    drop = [n for n in lowered.graph.node if n.op_type == "Dropout"]
    assert len(drop) == 1 and len(drop[0].output) == 2 and drop[0].output[1]
    return drop[0].output[1]


def gradient_model(node, inputs, opset=13, extra_outputs=()):
    """The case's node, a Gradient of sum(y) w.r.t. x, and the mask as an output (lowered)."""
    names = list(node.input)
    vis = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.asarray(v).dtype), np.shape(v))
           for n, v in zip(names, inputs)]
    x_type = vis[0].type.tensor_type.elem_type
    outs = [helper.make_tensor_value_info(o, t, np.shape(inputs[0]))
            for o, t in zip(node.output, [x_type, TensorProto.BOOL])]
    grad = helper.make_node("Gradient", [names[0]], ["dx"], name="grad", domain=TRAIN, xs=[names[0]], y=node.output[0])
    outs.append(helper.make_tensor_value_info("dx", x_type, np.shape(inputs[0])))
    graph = helper.make_graph([node, grad], "dropout", vis, outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(TRAIN, 1)])
    model.ir_version = 10
    lowered = oa.lower(model)
    mask = _mask_name(lowered)
    if mask not in [o.name for o in lowered.graph.output]:
        lowered.graph.output.append(helper.make_tensor_value_info(mask, TensorProto.BOOL, np.shape(inputs[0])))
    return lowered, mask


@pytest.mark.parametrize("case", BACKEND, ids=[c[3] for c in BACKEND])
def test_onnx_backend_training_dropout(case):
    node, inputs, outputs, name = case
    assert len(BACKEND) == 6
    lowered, mask_name = gradient_model(node, inputs)
    out = _run(lowered, {n: np.asarray(v) for n, v in zip(node.input, inputs)})
    x, ratio = inputs[0], float(inputs[1])
    mask = out[mask_name]
    assert mask.dtype == np.bool_ and mask.shape == x.shape
    if len(node.output) > 1:
        assert mask_name == node.output[1], "the case's own mask output is reused, not a second one"
    scale = np.float32(1.0 / (1.0 - ratio))
    np.testing.assert_array_equal(out["dx"], mask.astype(np.float32) * scale)
    np.testing.assert_allclose(out[node.output[0]], x * mask * scale, rtol=1e-6)
    if ratio == 0.0:
        assert mask.all()
    else:
        assert 0 < mask.sum() < mask.size, "a random mask keeps some elements and drops others"


def _training_model(opset=13, ratio=0.5, mode="const", dtype=np.float32):
    """y = Dropout(x * w) with a weight, loss = sum(y * v); Gradient w.r.t. w and x."""
    tt = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    shape = [4, 6]
    inits = [numpy_helper.from_array(np.asarray(ratio, dtype=dtype), "ratio")]
    ins = [helper.make_tensor_value_info(n, tt, shape) for n in ("x", "w", "v")]
    if mode == "const":
        inits.append(numpy_helper.from_array(np.asarray(True), "t"))
    else:
        ins.append(helper.make_tensor_value_info("t", TensorProto.BOOL, []))
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"], name="mul"),
        helper.make_node("Dropout", ["h", "ratio", "t"], ["y"], name="drop", seed=3),
        helper.make_node("Mul", ["y", "v"], ["yv"], name="mulv"),
        helper.make_node("ReduceSum", ["yv"], ["loss"], name="sum", keepdims=0),
        helper.make_node("Gradient", ["x", "w"], ["dx", "dw"], name="grad", domain=TRAIN, xs=["x", "w"], y="loss"),
    ]
    outs = [helper.make_tensor_value_info(n, tt, shape) for n in ("y", "dx", "dw")]
    graph = helper.make_graph(nodes, "dropout_train", ins, outs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(TRAIN, 1)])
    model.ir_version = 10
    return oa.lower(model)


@pytest.mark.parametrize("opset", [12, 13, 22])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mask_reused_through_the_chain(opset, dtype):
    lowered = _training_model(opset=opset, ratio=0.4, dtype=dtype)
    mask_name = _mask_name(lowered)
    lowered.graph.output.append(helper.make_tensor_value_info(mask_name, TensorProto.BOOL, [4, 6]))
    rng = np.random.default_rng(0)
    x, w, v = (rng.standard_normal((4, 6)).astype(dtype) for _ in range(3))
    for _ in range(3):  # each run draws a new mask; the gradient follows it
        out = _run(lowered, {"x": x, "w": w, "v": v})
        m = out[mask_name].astype(dtype) / dtype(0.6)
        np.testing.assert_allclose(out["y"], x * w * m, rtol=1e-6)
        np.testing.assert_allclose(out["dx"], v * m * w, rtol=1e-6)
        np.testing.assert_allclose(out["dw"], v * m * x, rtol=1e-6)


def test_runtime_training_mode():
    lowered = _training_model(ratio=0.5, mode="input")
    mask_name = _mask_name(lowered)
    lowered.graph.output.append(helper.make_tensor_value_info(mask_name, TensorProto.BOOL, [4, 6]))
    rng = np.random.default_rng(1)
    x, w, v = (rng.standard_normal((4, 6)).astype(np.float32) for _ in range(3))
    off = _run(lowered, {"x": x, "w": w, "v": v, "t": np.asarray(False)})
    np.testing.assert_allclose(off["y"], x * w, rtol=1e-6)
    np.testing.assert_allclose(off["dx"], v * w, rtol=1e-6)
    on = _run(lowered, {"x": x, "w": w, "v": v, "t": np.asarray(True)})
    m = on[mask_name].astype(np.float32) * 2
    assert 0 < on[mask_name].sum() < 24
    np.testing.assert_allclose(on["dx"], v * m * w, rtol=1e-6)


def test_a_requested_mask_is_not_duplicated():
    node = helper.make_node("Dropout", ["x", "r", "t"], ["y", "m"], name="drop")
    x = np.ones((2, 3), np.float32)
    lowered, mask = gradient_model(node, [x, np.float32(0.5), np.bool_(True)])
    assert mask == "m"
