"""gradcheck itself: it must catch a wrong rule, and run float64 where onnxruntime has no double kernel."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_autodiff as oa
from onnx_autodiff.engine.registry import override_rule
from onnx_autodiff.testing import In, RuleCase, check_rule_case
from tests.models import model_of


def _conv_model():
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((3, 2, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "b")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Tanh", ["c"], ["y"])]
    g = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2, 5, 5])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 5, 5])], [w, b])
    return model_of(g)


def test_float64_conv_falls_back_to_the_reference_evaluator():
    report = oa.gradcheck(_conv_model())
    assert report.runtime == "onnx.reference" and report.ok
    assert max(c.rel_err for c in report.checks) < 1e-6


def test_onnxruntime_only_says_what_to_do():
    with pytest.raises(oa.GradcheckError, match="runtime='reference'"):
        oa.gradcheck(_conv_model(), runtime="onnxruntime")


def test_a_wrong_rule_is_caught_and_the_worst_tensor_named():
    def wrong_tanh_grad(g, node, dy):  # 1 - y instead of 1 - y^2
        return [g.Mul(dy[0], g.Sub(g.const(1.0, like=node.outputs[0]), node.outputs[0]))]

    with override_rule("Tanh", wrong_tanh_grad), pytest.raises(oa.GradcheckError, match="'x0'") as err:
        check_rule_case(RuleCase("Tanh", [In((2, 3))]))
    assert not err.value.report.ok
    assert check_rule_case(RuleCase("Tanh", [In((2, 3))])).ok
