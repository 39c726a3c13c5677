from onnx_autodiff.testing import In, RuleCase

CASES = [
    # before opset 13: x is coerced to 2-D at axis, so the sum runs over every dim from axis on
    RuleCase("Softmax", [In((2, 3, 4))], attrs={"axis": 1}, opset=11, id="opset11-axis1"),
    RuleCase("Softmax", [In((2, 3, 4))], opset=11, id="opset11-default"),
    RuleCase("Softmax", [In((2, 3, 4))], attrs={"axis": -1}, opset=11, id="opset11-axis-1"),
    RuleCase("Softmax", [In((3, 4))], opset=9, id="opset9"),
    RuleCase("Softmax", [In((2, 3, 4))], attrs={"axis": -1}, opset=13, id="opset13-axis-1"),
    RuleCase("Softmax", [In((2, 3, 4))], attrs={"axis": 0}, opset=13, id="opset13-axis0"),
    RuleCase("Softmax", [In((2, 3, 4))], opset=13, id="opset13-default"),
    RuleCase("LogSoftmax", [In((2, 3, 4))], attrs={"axis": 1}, opset=11, id="opset11-axis1"),
    RuleCase("LogSoftmax", [In((2, 3, 4))], opset=11, id="opset11-default"),
    RuleCase("LogSoftmax", [In((3, 4))], opset=9, id="opset9"),
    RuleCase("LogSoftmax", [In((2, 3, 4))], attrs={"axis": -1}, opset=13, id="opset13-axis-1"),
    RuleCase("LogSoftmax", [In((2, 3, 4))], attrs={"axis": 0}, opset=13, id="opset13-axis0"),
    RuleCase("LogSoftmax", [In((2, 3, 4), dims=("N", 3, "D"))], attrs={"axis": 1}, opset=17, id="symbolic"),
]
