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

# onnxruntime 1.31 CPU has only float32 kernels for these; gradcheck's runtime="auto" runs them in float64
# through onnx's reference evaluator. tests/rules/test_second_order_elementwise.py also holds them against torch.
SELU_A, SELU_G = 1.3, 0.8
CASES += [
    RuleCase("Tan", [In(S, low=-1.2, high=1.2)]),
    RuleCase("Asin", [In(S, low=-0.9, high=0.9)]),
    RuleCase("Acos", [In(S, low=-0.9, high=0.9)]),
    RuleCase("Atan", [In(S)]),
    RuleCase("Sinh", [In(S)]),
    RuleCase("Cosh", [In(S)]),
    RuleCase("Asinh", [In(S)]),
    RuleCase("Acosh", [In(S, low=1.1, high=3.0)]),
    RuleCase("Atanh", [In(S, low=-0.9, high=0.9)]),
    RuleCase("Softplus", [In(S)]),
    RuleCase("Softsign", [In(S, gap=0.05)]),
    RuleCase("ThresholdedRelu", [In((3, 4), low=-3, high=3)], attrs={"alpha": 0.5}),
    RuleCase("ThresholdedRelu", [In((3, 4), low=-3, high=3)], id="default"),
    RuleCase("Elu", [In(S, gap=0.05)]),
    RuleCase("Elu", [In(S, gap=0.05)], attrs={"alpha": 0.7}, id="alpha"),
    RuleCase("Selu", [In(S, gap=0.05)]),
    RuleCase("Selu", [In(S, gap=0.05)], attrs={"alpha": SELU_A, "gamma": SELU_G}, id="attrs"),
    RuleCase("HardSigmoid", [In((3, 4), low=-4, high=4)]),
    RuleCase("HardSigmoid", [In((3, 4), low=-2, high=2)], attrs={"alpha": 0.4, "beta": 0.3}, id="attrs"),
    RuleCase("HardSwish", [In((3, 4), low=-5, high=5)], opset=14),
    # (no exact Gelu case: onnx.reference has no Gelu kernel and expands its function body, whose Erf
    # is float32-precise; see NOT_CASED["Erf"])
]

_TORCH = " tests/rules/test_second_order_elementwise.py checks it in float32 onnxruntime against torch float64 autograd"
NOT_CASED = {
    "Erf": "onnx.reference's Erf is float32-precise for float64 input (np.vectorize(math.erf, otypes=['f'])), so "
           "central differences in float64 are off by ~1e-2 (onnxruntime 1.31 has no float64 Erf);" + _TORCH,
    "Celu": "Celu's schema admits float32 only: a float64 Celu model fails onnx shape inference;" + _TORCH,
    "Shrink": "onnxruntime 1.31 has a double Shrink kernel that computes in float32, and runtime='auto' takes it "
              "(finite differences off by ~2e-2); it passes under runtime='reference', which a RuleCase cannot "
              "select;" + _TORCH,
}
