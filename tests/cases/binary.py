from onnx_autodiff.testing import In, RuleCase

CASES = [
    RuleCase("Add", [In((2, 3)), In((3,))], id="broadcast"),
    RuleCase("Sub", [In((2, 1, 3)), In((4, 1))], id="broadcast-both"),
    RuleCase("Mul", [In((2, 3)), In((2, 3))]),
    RuleCase("Mul", [In((2, 3)), In(())], id="scalar"),
    RuleCase("Sum", [In((2, 3)), In((3,)), In((1, 3))], id="variadic"),
]
