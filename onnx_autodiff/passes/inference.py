"""The inference-export pipeline: a trained model's graph as an inference model (``TrainingSession.
export_inference`` / ``inference_model``, ``onnx-autodiff export``).

``INFERENCE`` runs on a light copy of the lowered training model whose ``ctx.arrays`` hold the trained
values: mixed precision's float32 masters back into weights of the model's type (``passes/master_weights.py``),
LoRA adapters merged into their weights or kept as zero-default inputs (``training/lora/merge.py``),
the training graphs and our metadata dropped, training-mode layers switched to inference
(``passes/eval_mode.py``), and the result made portable and checked. ``ctx.adapters`` ("merged" or "inputs")
and ``ctx.eval_mode`` choose.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import onnx

from ..engine.peephole_cnn import drop_unread_max_pool_indices
from ..graph import finalize
from ..model import metadata
from ..model.weights import check_model
from ..training.lora.merge import lora_inference, lora_record
from .eval_mode import to_eval_mode
from .master_weights import masters_to_weights


@dataclass
class ExportContext:
    arrays: Mapping  # name -> value of each detached tensor; a pass that changes values replaces it
    adapters: str = "merged"
    eval_mode: bool = True


def lora_for_inference(model: onnx.ModelProto, ctx: ExportContext) -> bool:
    """LoRA adapters merged (W + B A alpha/rank) or kept as graph inputs that default to zero."""
    record = lora_record(model)
    if record is None:
        return False
    ctx.arrays = lora_inference(model, ctx.arrays, record, ctx.adapters)
    return True


def drop_training(model: onnx.ModelProto, ctx: ExportContext) -> bool:
    """No training_info, and none of the metadata onnx-autodiff writes; a MaxPool's Indices that only the
    training graph read are dropped."""
    had = len(model.training_info) > 0
    del model.training_info[:]
    metadata.drop_ours(model)
    return drop_unread_max_pool_indices(model.graph) or had


def eval_mode(model: onnx.ModelProto, ctx: ExportContext) -> bool:
    """Training-mode BatchNormalization / Dropout in inference behaviour (unless ``ctx.eval_mode`` is off)."""
    return ctx.eval_mode and to_eval_mode(model)


def finalize_checked(model: onnx.ModelProto, ctx: ExportContext) -> bool:
    """Portable names, sorted nodes, onnx.checker's full check."""
    finalize(model)
    check_model(model)
    return False


INFERENCE = (masters_to_weights, lora_for_inference, drop_training, eval_mode, finalize_checked)

__all__ = ["INFERENCE", "ExportContext", "masters_to_weights", "lora_for_inference", "drop_training", "eval_mode",
           "finalize_checked"]
