"""onnx-autodiff: the ONNX training spec, lowered to plain ONNX that any runtime executes."""
from .errors import (
    GradcheckError,
    GradientShapeError,
    GradientSpecError,
    OnnxAutodiffError,
    TrainingSpecError,
    UnsupportedOperatorError,
)
from .lower import lower
from .registry import gradient_rule, no_gradient

__version__ = "0.1.0"

__all__ = [
    "lower",
    "gradient_rule",
    "no_gradient",
    "OnnxAutodiffError",
    "UnsupportedOperatorError",
    "GradientSpecError",
    "GradientShapeError",
    "TrainingSpecError",
    "GradcheckError",
]
