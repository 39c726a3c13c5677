"""Old home of ``make_training_model``; it lives in ``onnx_autodiff.training`` now (kept so imports keep working)."""
from .errors import TrainingBuilderError
from .training import (
    BUILDER_KEY,
    LEARNING_RATE,
    LOSSES,
    OPTIMIZERS,
    PREVIEW,
    builder_record,
    default_frozen,
    make_training_model,
    select_trainable,
)

__all__ = ["make_training_model", "select_trainable", "default_frozen", "builder_record", "TrainingBuilderError",
           "LOSSES", "OPTIMIZERS", "LEARNING_RATE", "BUILDER_KEY", "PREVIEW"]
