"""Ops whose outputs carry no gradient: shapes, comparisons, indices, piecewise-constant maps, and ops whose
differentiable-looking inputs never reach a float output (quantized and integer arithmetic, strings,
indices) or whose output is constant in them."""
from onnx_autodiff.rule_api import no_gradient

no_gradient(
    "Shape", "Size", "Constant", "ConstantOfShape", "Range", "NonZero", "EyeLike",
    "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual",
    "Not", "And", "Or", "Xor", "IsNaN", "IsInf",
    "ArgMax", "ArgMin", "OneHot", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot",
    "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli",
    reason="output is integer, boolean, a shape or random",
)
no_gradient("Floor", "Ceil", "Round", "Sign", reason="piecewise constant: the gradient is zero almost everywhere")

no_gradient("QuantizeLinear", "MatMulInteger", "ConvInteger", "QLinearConv", "QLinearMatMul",
            reason="the output is quantized (integer or float8)")
no_gradient("NonMaxSuppression", "SequenceLength", "OptionalHasElement",
            reason="the output is indices, a count or a boolean")
no_gradient("StringNormalizer", "StringConcat", "StringSplit", "RegexFullMatch", "TfIdfVectorizer",
            reason="string inputs or outputs")
no_gradient("HammingWindow", "HannWindow", "BlackmanWindow",
            reason="the output depends only on an integer size")
no_gradient("MelWeightMatrix", reason="the weights depend on the band edges through integer bin indices only "
                                      "(piecewise constant)")

