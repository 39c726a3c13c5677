from onnx_autodiff.testing import In, RuleCase

S = (2, 3)

CASES = [
    RuleCase("Identity", [In(S)]),
    RuleCase("Neg", [In(S)]),
    RuleCase("Abs", [In(S, gap=0.05)]),
    RuleCase("Exp", [In(S)]),
    RuleCase("Exp", [In(())], id="scalar"),
    RuleCase("Log", [In(S, low=0.2, high=3.0)]),
    RuleCase("Sqrt", [In(S, low=0.2, high=3.0)]),
    RuleCase("Reciprocal", [In(S, gap=0.3)]),
    RuleCase("Sin", [In(S)]),
    RuleCase("Cos", [In(S)]),
    RuleCase("Tanh", [In(S)]),
    RuleCase("Sigmoid", [In(S)]),
    RuleCase("Relu", [In(S, gap=0.05)]),
    RuleCase("LeakyRelu", [In(S, gap=0.05)]),
    RuleCase("LeakyRelu", [In(S, gap=0.05)], attrs={"alpha": 0.3}, id="alpha"),
    RuleCase("Gelu", [In(S)], attrs={"approximate": "tanh"}, opset=20, id="tanh"),
    RuleCase("Mish", [In(S)], opset=18),
    RuleCase("Cast", [In(S)], attrs={"to": 11}),
    RuleCase("Cast", [In(S)], attrs={"to": 1}, id="to-float"),
    RuleCase("CastLike", [In(S), In(S, const=True)], opset=15),
]

# onnxruntime 1.31 CPU has only float32 kernels for these (Celu's schema is float32 only; Shrink's double
# kernel computes in float32; exact Gelu needs Erf), so the float64 sweep cannot run them. They are
# checked in float32 onnxruntime against torch float64 autograd in tests/test_second_order_elementwise.py.
_FLOAT32_ONLY = ["Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Softplus",
                 "Softsign", "Erf", "ThresholdedRelu", "Elu", "Selu", "Celu", "HardSigmoid", "HardSwish",
                 "Shrink"]
NOT_CASED = {op: "float32-only kernel: checked against torch in tests/test_second_order_elementwise.py"
             for op in _FLOAT32_ONLY}
