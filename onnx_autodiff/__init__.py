"""onnx-autodiff: the ONNX training spec, lowered to plain ONNX that any runtime executes."""
# the deprecated module path onnx_autodiff.gradcheck (a shim: each name read there warns), imported first so that
# the function below keeps the name onnx_autodiff.gradcheck
from . import gradcheck as _gradcheck_module  # noqa: F401
from .check.gradcheck import GradcheckReport, gradcheck, jvp_check
from .driver.bundle import export_step
from .driver.session import TrainingSession
from .driver.step_model import build_init_model, build_step_model
from .engine.registry import derivative, gradient_rule, jvp_rule, no_gradient
from .errors import (
    ForwardSpecError,
    GradcheckError,
    GradientRuleError,
    GradientShapeError,
    GradientSpecError,
    OnnxAutodiffError,
    TrainingBuilderError,
    TrainingDivergedError,
    TrainingSpecError,
    UnsupportedOperatorError,
)
from .forward import hvp, jacobian, jvp
from .model.carrier import LightModel, save_model
from .partial.vjp import build_vjp
from .passes.pipeline import lower
from .training import LossSpec, MemoryBudget, OptimizerSpec, Precision, make_training_model

__version__ = "0.1.0"

__all__ = [
    "lower",
    "jvp",
    "hvp",
    "jacobian",
    "gradcheck",
    "jvp_check",
    "GradcheckReport",
    "build_vjp",
    "make_training_model",
    "LightModel",
    "save_model",
    "LossSpec",
    "OptimizerSpec",
    "MemoryBudget",
    "Precision",
    "TrainingBuilderError",
    "build_step_model",
    "build_init_model",
    "export_step",
    "TrainingSession",
    "TrainingDivergedError",
    "gradient_rule",
    "jvp_rule",
    "derivative",
    "no_gradient",
    "OnnxAutodiffError",
    "UnsupportedOperatorError",
    "GradientSpecError",
    "ForwardSpecError",
    "GradientRuleError",
    "GradientShapeError",
    "TrainingSpecError",
    "GradcheckError",
]

