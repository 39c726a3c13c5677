from onnx_autodiff.testing import In, RuleCase

NOT_CASED = {
    "GroupNormalization": "onnx shape inference leaves its output untyped, which the rule-case harness needs; "
                          "gradchecked in float64 in tests/rules/test_conv_torch.py",
}

_C = In((3,), low=0.5, high=1.5)
_VAR = In((3,), low=0.5, high=2.0)

CASES = [
    RuleCase("BatchNormalization", [In((2, 3, 4, 5)), _C, In((3,)), In((3,)), _VAR], id="inference"),
    RuleCase("BatchNormalization", [In((2, 3, 4)), _C, In((3,)), In((3,), const=True), In((3,), low=0.5, const=True)],
             attrs={"epsilon": 1e-3}, opset=9, id="inference-opset9"),
    RuleCase("BatchNormalization", [In((4, 3, 2, 3)), _C, In((3,)), In((3,), const=True), _VAR],
             attrs={"training_mode": 1}, outputs=3, check_outputs=[0], opset=15, id="training"),
    RuleCase("BatchNormalization", [In((5, 3)), _C, In((3,)), In((3,), const=True), In((3,), low=0.5, const=True)],
             attrs={"training_mode": 1}, outputs=3, check_outputs=[0], opset=14, id="training-2d"),
    RuleCase("LayerNormalization", [In((2, 3, 4)), In((4,)), In((4,))]),
    RuleCase("LayerNormalization", [In((2, 3, 4)), In((3, 4)), None], attrs={"axis": 1, "epsilon": 1e-3},
             id="axis1-nobias"),
    # (no case with the Mean/InvStdDev outputs: they stay float32 for float64 X, which gradcheck's
    # float64 promotion breaks; tests/rules/test_conv_torch.py checks them in float32 against torch)
    RuleCase("LayerNormalization", [In((2, 3, 4)), In((1, 4)), In((4,))], attrs={"axis": -2}, id="broadcast-scale"),
]

# onnxruntime 1.31 CPU has no float64 InstanceNormalization: gradcheck's runtime="auto" runs it through onnx's
# reference evaluator (tests/rules/test_conv_torch.py also holds it against torch)
CASES += [
    RuleCase("InstanceNormalization", [In((2, 3, 4, 5)), _C, In((3,))]),
    RuleCase("InstanceNormalization", [In((2, 3, 7)), _C, In((3,))], attrs={"epsilon": 1e-2}, id="1d"),
    RuleCase("InstanceNormalization", [In((2, 3, 3, 2, 2)), _C, In((3,))], opset=12, id="3d-opset12"),
]
