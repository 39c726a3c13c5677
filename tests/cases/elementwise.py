from onnx_autodiff.testing import In, RuleCase

CASES = [
    RuleCase("Identity", [In((2, 3))]),
    RuleCase("Neg", [In((2, 3))]),
    RuleCase("Exp", [In((2, 3))]),
    RuleCase("Relu", [In((2, 3), gap=0.05)]),
]
