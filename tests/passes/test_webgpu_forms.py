"""The forms the ``webgpu`` target emits where onnxruntime's WebGPU EP lacks a kernel (passes/targets.py): the
MaxPool gradient without MaxPool's Indices output, LogSoftmax, Sum, ConstantOfShape and an idle Dropout in
standard ops, and static shape arithmetic folded away. Each computes what the default form computes (on the CPU:
the forms are plain ONNX), and the form is what was emitted (the test fails if the target's record is ignored)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import lower
from onnx_autodiff.errors import TrainingSpecError
from onnx_autodiff.passes.static_shapes import fix_dims
from onnx_autodiff.passes.step_quirks import fold_static_shape_arithmetic
from onnx_autodiff.runtimes.targets import TARGETS

F32 = TensorProto.FLOAT
PREVIEW = "ai.onnx.preview.training"


def _gradient_model(nodes, x_shape, y_shape):
    """``nodes`` (x -> y) then ``loss = ReduceSum(y * w)`` (w an input) and its Gradient w.r.t. x."""
    extra = [helper.make_node("Mul", ["y", "w"], ["yw"]), helper.make_node("ReduceSum", ["yw"], ["loss"], keepdims=0),
             helper.make_node("Gradient", ["x"], ["x_grad"], domain=PREVIEW, xs=["x"], y="loss")]
    g = helper.make_graph(nodes + extra, "m", [helper.make_tensor_value_info("x", F32, list(x_shape)),
                                               helper.make_tensor_value_info("w", F32, list(y_shape))],
                          [helper.make_tensor_value_info("loss", F32, []),
                           helper.make_tensor_value_info("x_grad", F32, list(x_shape))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(PREVIEW, 1)])
    m.ir_version = 8
    return m


def _run(m, feeds):
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in list(sess.get_inputs()) + list(sess.get_overridable_initializers())}
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {k: v for k, v in feeds.items()
                                                                           if k in names})))


@pytest.mark.parametrize("shape,attrs,form", [
    ((2, 3, 8, 6), {"kernel_shape": [2, 2], "strides": [2, 2]}, "Equal"),  # windows that tile x: compare with y
    ((2, 3, 9, 6), {"kernel_shape": [3, 2], "strides": [3, 2]}, "Equal"),
    ((2, 3, 12), {"kernel_shape": [3], "strides": [3]}, "Equal"),
    ((2, 3, 9, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, "Conv"),  # overlapping: masks
    ((2, 3, 9, 6), {"kernel_shape": [2, 2], "strides": [2, 2]}, "Conv"),  # a row in no window
])
def test_max_pool_gradient_without_indices_sends_dy_to_the_first_maximum(shape, attrs, form):
    """Ties everywhere (a ReLU'd input of small integers): the webgpu forms send dy where the Indices form does,
    to the first maximum of each window."""
    rng = np.random.default_rng(6)
    x = np.maximum(rng.integers(-3, 3, shape), 0).astype(np.float32)
    w = rng.standard_normal(_pooled(x, attrs)).astype(np.float32)
    model = _gradient_model([helper.make_node("MaxPool", ["x"], ["y"], **attrs)], shape, w.shape)
    default, webgpu = lower(model), lower(model, target="webgpu")
    ops = {t: [(n.op_type, len(n.output)) for n in m.graph.node] for t, m in (("default", default), ("webgpu", webgpu))}
    assert ("MaxPool", 2) not in ops["webgpu"] and not {"ScatterElements", "MaxUnpool"} & {o for o, _ in ops["webgpu"]}
    assert {"ScatterElements", "MaxUnpool"} & {o for o, _ in ops["default"]}
    used = {o for o, _ in ops["webgpu"]}
    assert form in used and not ({"Equal", "Conv"} - {form}) & used
    want, got = _run(default, {"x": x, "w": w})["x_grad"], _run(webgpu, {"x": x, "w": w})["x_grad"]
    np.testing.assert_array_equal(got != 0, want != 0)  # the same maxima got dy
    np.testing.assert_allclose(got, want, rtol=1e-6)  # overlapping windows add in another order
    assert np.count_nonzero(want) and np.count_nonzero(want) <= w.size


def _pooled(x, attrs):
    m = helper.make_model(helper.make_graph([helper.make_node("MaxPool", ["x"], ["y"], **attrs)], "p",
                                            [helper.make_tensor_value_info("x", F32, list(x.shape))],
                                            [helper.make_tensor_value_info("y", F32, None)]),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return _run(m, {"x": x})["y"].shape


def test_webgpu_record_says_maxpool_has_no_indices():
    t = TARGETS["webgpu"]
    assert t.has_op("MaxPool") and not t.has_output("MaxPool", 1) and t.has_output("MaxPool", 0)
    assert not TARGETS["portable"].has_output("MaxPool", 1)  # the union of every runtime's gaps
    assert TARGETS["onnxruntime"].has_output("MaxPool", 1)


@pytest.mark.parametrize("opset,axis,shape", [(17, -1, (3, 5)), (17, 1, (2, 4, 3)), (11, 1, (2, 4, 3))])
def test_log_softmax_sum_and_constant_of_shape_forms(opset, axis, shape):
    """LogSoftmax (below opset 13: over every axis from ``axis`` on), Sum and ConstantOfShape in the ops the
    WebGPU EP has, equal to the ops themselves (large logits: the form must subtract the maximum)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 30).astype(np.float32)
    fill = numpy_helper.from_array(np.array([2.5], np.float32))
    nodes = [helper.make_node("LogSoftmax", ["x"], ["ls"], axis=axis),
             helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("ConstantOfShape", ["s"], ["c"], value=fill),
             helper.make_node("Sum", ["ls", "x", "c"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, list(shape))],
                          [helper.make_tensor_value_info("y", F32, list(shape))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    out = lower(m, target="webgpu")
    assert not {"LogSoftmax", "Sum", "ConstantOfShape"} & {n.op_type for n in out.graph.node}
    np.testing.assert_allclose(_run(out, {"x": x})["y"], _run(m, {"x": x})["y"], rtol=1e-6, atol=1e-5)


def test_fixed_dims_fold_the_shape_arithmetic_and_keep_state_defaults():
    """``fix_dims`` sizes a symbolic batch; the webgpu step fix then folds Shape/Size arithmetic into constants,
    but never an input's default (a step counter fed at every step)."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Size", ["x"], ["n"]),
             helper.make_node("Cast", ["n"], ["nf"], to=f), helper.make_node("ReduceSum", ["x"], ["t"], keepdims=0),
             helper.make_node("Div", ["t", "nf"], ["mean"]), helper.make_node("Reshape", ["x", "s"], ["x2"]),
             helper.make_node("Add", ["counter", "one"], ["counter_new"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, ["N", 3]),
                                       helper.make_tensor_value_info("counter", TensorProto.INT64, [])],
                          [helper.make_tensor_value_info(o, t, d) for o, t, d in
                           (("mean", f, []), ("x2", f, ["N", 3]), ("counter_new", TensorProto.INT64, []))],
                          [numpy_helper.from_array(np.array(0, np.int64), "counter"),
                           numpy_helper.from_array(np.array(1, np.int64), "one")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    assert not fold_static_shape_arithmetic(m)  # N symbolic: nothing is known
    fixed = fix_dims(m, {"N": 4})
    assert fold_static_shape_arithmetic(fixed)
    assert [n.op_type for n in fixed.graph.node] == ["Cast", "ReduceSum", "Div", "Reshape", "Add"]
    onnx.checker.check_model(fixed, full_check=True)
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    got = _run(fixed, {"x": x, "counter": np.array(7, np.int64)})
    assert float(got["mean"]) == pytest.approx(5.5) and int(got["counter_new"]) == 8
    with pytest.raises(TrainingSpecError, match=r"dims \['M'\] are not symbolic dims .* it has \['N'\]"):
        fix_dims(m, {"M": 2})
