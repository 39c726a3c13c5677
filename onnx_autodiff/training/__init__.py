"""Training vocabulary: one table of losses, one of optimizers, and ``make_training_model``.

``make_training_model`` (``builder.py``) and ``ForwardBackwardTrainer`` (``onnx_autodiff.partial.trainer``) take
their losses from ``losses.py`` and their optimizers from ``optimizers.py``; both emit through
``nodes.GraphBuilder``, the node builder of the gradient rules (``g.Add(a, b)``) over a graph of its own.
"""
from .builder import LEARNING_RATE, build_training_model, builder_record, make_training_model
from .losses import LOSSES
from .optimizers import OPTIMIZERS, PREVIEW
from .options import LossSpec, MemoryBudget, OptimizerSpec, Precision
from .trainable import default_frozen, select_trainable

__all__ = ["make_training_model", "build_training_model", "LossSpec", "OptimizerSpec", "MemoryBudget", "Precision",
           "select_trainable", "default_frozen", "builder_record", "LOSSES", "OPTIMIZERS", "LEARNING_RATE", "PREVIEW"]
