"""Models in the wild are often opset 7-8: the seed, zero gradients and constants must be valid there."""
import numpy as np
import pytest
from onnx import TensorProto, helper

import onnx_autodiff as oa
from onnx_autodiff.testing import In, RuleCase, check_rule_case

CASES = [
    RuleCase("Add", [In((2, 3)), In((3,))], opset=7),
    RuleCase("Mul", [In((2, 1, 3)), In((4, 1))], opset=8),
    RuleCase("Relu", [In((2, 3), gap=0.1)], opset=7),
    RuleCase("Sigmoid", [In((2, 3))], opset=7),
    RuleCase("MatMul", [In((2, 3, 4)), In((4, 5))], opset=7),
    RuleCase("Gemm", [In((3, 4)), In((5, 4)), In((5,))], attrs={"transB": 1, "alpha": 0.5}, opset=7),
    RuleCase("Softmax", [In((2, 3, 4))], attrs={"axis": 1}, opset=7),
    RuleCase("ReduceSum", [In((2, 3, 4))], attrs={"axes": [1], "keepdims": 0}, opset=7),
    RuleCase("ReduceMean", [In((2, 3, 4))], attrs={"axes": [0, 2]}, opset=8),
    RuleCase("Reshape", [In((2, 3, 4)), In(value=np.array([6, 4]))], opset=7),
    RuleCase("Transpose", [In((2, 3, 4))], attrs={"perm": [2, 0, 1]}, opset=7),
    RuleCase("Concat", [In((2, 3)), In((2, 2))], attrs={"axis": 1}, opset=7),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.op}-opset{c.opset}" for c in CASES])
def test_rule_at_old_opset(case):
    assert check_rule_case(case).ok


def test_zero_gradient_at_opset_7_is_a_static_constant():
    nodes = [helper.make_node("Exp", ["a"], ["y"], name="e"),
             helper.make_node("Gradient", ["a", "c"], ["da", "dc"], name="g",
                              domain="ai.onnx.preview.training", xs=["a", "c"], y="y")]
    vi = helper.make_tensor_value_info
    m = helper.make_model(helper.make_graph(nodes, "m",
                                            [vi("a", TensorProto.FLOAT, [2]), vi("c", TensorProto.FLOAT, [3, 2])],
                                            [vi("y", TensorProto.FLOAT, [2]), vi("da", TensorProto.FLOAT, [2]),
                                             vi("dc", TensorProto.FLOAT, [3, 2])]),
                          opset_imports=[helper.make_opsetid("", 7),
                                         helper.make_opsetid("ai.onnx.preview.training", 1)])
    m.ir_version = 7
    lowered = oa.lower(m)
    assert all(n.op_type != "ConstantOfShape" for n in lowered.graph.node)
    import onnxruntime as ort

    got = ort.InferenceSession(lowered.SerializeToString()).run(["dc"], {"a": np.ones(2, np.float32),
                                                                         "c": np.ones((3, 2), np.float32)})[0]
    assert got.shape == (3, 2) and not got.any()


def _symbolic_exp_gradient(opset):
    nodes = [helper.make_node("Exp", ["a"], ["y"], name="e"),
             helper.make_node("Gradient", ["a"], ["da"], name="g", domain="ai.onnx.preview.training", xs=["a"], y="y")]
    vi = helper.make_tensor_value_info
    m = helper.make_model(helper.make_graph(nodes, "m", [vi("a", TensorProto.FLOAT, ["N"])],
                                            [vi("y", TensorProto.FLOAT, ["N"]), vi("da", TensorProto.FLOAT, ["N"])]),
                          opset_imports=[helper.make_opsetid("", opset),
                                         helper.make_opsetid("ai.onnx.preview.training", 1)])
    m.ir_version = 7
    return m


def test_symbolic_shape_below_opset_9_converts_the_model_once_with_a_warning():
    # a seed shaped like y needs ConstantOfShape (opset 9) when y's shape is symbolic
    with pytest.warns(UserWarning, match="opset 8.*Converted it to opset 9") as caught:
        lowered = oa.lower(_symbolic_exp_gradient(8))
    assert len([w for w in caught if "Converted" in str(w.message)]) == 1
    assert [o.version for o in lowered.opset_import if o.domain == ""] == [9]
    import onnxruntime as ort

    a = np.array([0.5, -1.0, 2.0], np.float32)
    got = ort.InferenceSession(lowered.SerializeToString()).run(["da"], {"a": a})[0]
    np.testing.assert_allclose(got, np.exp(a), rtol=1e-6)


def test_target_opset_converts_first_and_refuses_to_go_on_when_too_old():
    lowered = oa.lower(_symbolic_exp_gradient(8), target_opset=13)
    assert [o.version for o in lowered.opset_import if o.domain == ""] == [13]
    with pytest.raises(oa.GradientRuleError, match="needs opset 9"):
        oa.lower(_symbolic_exp_gradient(9), target_opset=8)


def test_below_opset_7_asks_for_a_conversion():
    # Before opset 7, Mul broadcasts only with a 'broadcast' attribute (the InstanceNormalization rule
    # failed shape inference there): refuse with a clear error instead of emitting an invalid graph.
    case = RuleCase("InstanceNormalization", [In((2, 3, 3, 2)), In((3,)), In((3,))], opset=6)
    with pytest.raises(oa.GradientRuleError, match="opset 7"):
        check_rule_case(case)


def test_cli_lower_takes_a_target_opset(tmp_path):
    import onnx

    from onnx_autodiff.cli import main

    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(_symbolic_exp_gradient(8), src)
    assert main(["lower", str(src), str(dst), "--target-opset", "11"]) == 0
    assert [o.version for o in onnx.load(dst).opset_import if o.domain == ""] == [11]
