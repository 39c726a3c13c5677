"""A Conv read only by training-mode BatchNormalizations: its bias gradient is zero exactly (each normalization
subtracts its batch mean per channel), where the sum over batch and space of dz is float rounding around zero.
The option ``conv_bias_before_batch_norm_zero`` False restores the sum: the two forms are compared here."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.engine.builder import emit_options
from tests.rules.test_fast_paths import _grads, _model

F32 = TensorProto.FLOAT  # onnxruntime has no float64 Conv


def _conv_bn(opset=17, training=True, extra_reader=False, conv_output=False, c=3):
    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array(v.astype(np.float32), n) for n, v in [
        ("w", rng.standard_normal((c, 2, 3, 3))), ("b", rng.standard_normal(c)), ("s", rng.standard_normal(c)),
        ("beta", rng.standard_normal(c)), ("m", np.zeros(c)), ("v", np.ones(c))]]
    if opset >= 14:
        bn = helper.make_node("BatchNormalization", ["z", "s", "beta", "m", "v"],
                              ["y", "rm", "rv"] if training else ["y"], training_mode=int(training))
    else:
        bn = helper.make_node("BatchNormalization", ["z", "s", "beta", "m", "v"],
                              ["y", "rm", "rv", "sm", "sv"] if training else ["y"])
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["z"], pads=[1, 1, 1, 1]), bn]
    outputs = ["y"]
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["z"], ["r"]))
        outputs.append("r")
    if conv_output:
        outputs.append("z")
    return _model(nodes, [helper.make_tensor_value_info("x", F32, [4, 2, 5, 6])], outputs, inits, opset=opset)


def _both(model):
    x = (3.0 + np.random.default_rng(8).standard_normal((4, 2, 5, 6))).astype(np.float32)
    wrt = ["x", "w", "b", "s", "beta"]
    new, new_ops = _grads(model, wrt, {"x": x})
    with emit_options(conv_bias_before_batch_norm_zero=False):
        old, old_ops = _grads(model, wrt, {"x": x})
    return new, old, new_ops, old_ops


@pytest.mark.parametrize("opset", [17, 13])
def test_conv_bias_gradient_before_training_batch_norm_is_zero(opset):
    new, old, new_ops, old_ops = _both(_conv_bn(opset))
    assert np.array_equal(new["b"], np.zeros(3))
    assert np.abs(old["b"]).max() < 1e-5 * np.abs(old["w"]).max()  # the sum it replaces: rounding around zero
    assert old_ops.count("ReduceSum") == new_ops.count("ReduceSum") + 1
    for k in ("x", "w", "s", "beta"):
        np.testing.assert_array_equal(new[k], old[k])


@pytest.mark.parametrize("case", [dict(training=False), dict(extra_reader=True), dict(conv_output=True)],
                         ids=["inference-batch-norm", "another-reader", "conv-output-is-an-output"])
def test_conv_bias_gradient_kept_where_the_mean_is_not_removed(case):
    new, old, _, _ = _both(_conv_bn(**case))
    assert np.abs(new["b"]).max() > 1e-3
    np.testing.assert_array_equal(new["b"], old["b"])
