"""Ops whose outputs carry no gradient: shapes, comparisons, indices, piecewise-constant maps."""
from onnx_autodiff.engine.registry import no_gradient

no_gradient(
    "Shape", "Size", "Constant", "ConstantOfShape", "Range", "NonZero", "EyeLike",
    "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual",
    "Not", "And", "Or", "Xor", "IsNaN", "IsInf",
    "ArgMax", "ArgMin", "OneHot", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot",
    "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli",
    reason="output is integer, boolean, a shape or random",
)
no_gradient("Floor", "Ceil", "Round", "Sign", reason="piecewise constant: the gradient is zero almost everywhere")
