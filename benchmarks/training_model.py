"""The benchmarks' training model: the library's ``make_training_model`` with cross entropy on the logits.

The trainable tensors are the float initializers other than BatchNorm running statistics (named, so the
set does not depend on the library's default selection); ``check=False``: the benchmark times ``lower``
itself.
"""
from __future__ import annotations

import onnx

from onnx_autodiff import LossSpec
from onnx_autodiff import make_training_model as _library_make_training_model
from onnx_autodiff.graph import FLOAT_TYPES


def trainable_names(model: onnx.ModelProto) -> list[str]:
    return [t.name for t in model.graph.initializer
            if t.data_type in FLOAT_TYPES and not t.name.endswith(("running_mean", "running_var"))]


def make_training_model(model: onnx.ModelProto, logits: str, optimizer: str = "sgd", lr: float = 0.01,
                        trainable: list[str] | None = None) -> onnx.ModelProto:
    """Cross entropy on ``logits`` (labels: the int64 input ``labels``), one Gradient node and the optimizer
    (``sgd`` as plain ops, ``adam`` as the spec's Adam op, torch's defaults) with learning rate ``lr``."""
    return _library_make_training_model(model, LossSpec("cross_entropy", outputs=logits), optimizer, lr=lr,
                                        trainable=trainable if trainable is not None else trainable_names(model),
                                        check=False, untie=False)


def inference_only(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.training_info[:]
    return out
