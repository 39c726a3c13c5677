"""What a ``TrainingSession`` writes out: checkpoints and inference models, from a light copy.

Every writer starts from a light copy of the session's lowered model (``light_copy``: every mutable
tensor detached) and reads the state one tensor at a time while the tensors are written, so saving a
model never holds a second copy of its weights. ``sess`` is a ``TrainingSession`` throughout.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import onnx
from onnx import numpy_helper

from ..errors import TrainingSpecError
from ..graph import finalize
from ..model import metadata as md
from ..model.io import EXTERNAL_DATA_THRESHOLD, reference_base, save_model_atomic
from ..model.weights import attach_weights, check_model, detach_tensor, is_detached, top_graphs
from ..passes.eval_mode import to_eval_mode
from ..passes.lora_merge import lora_inference, lora_record
from .checkpoint import TrainState
from .state import LazyTensors


def light_copy(sess, metadata: Mapping[str, str] | None,
               inference: bool) -> tuple[onnx.ModelProto, Mapping]:
    """A light copy of the model (every mutable tensor detached) and the arrays its detached
    tensors need, read from the state one at a time while they are written."""
    m = onnx.ModelProto()
    m.CopyFrom(sess.model)  # light: only graphs and small tensors
    if inference:
        del m.training_info[:]
        md.drop_ours(m)
    else:
        md.write(m, {md.STEPS: str(sess.steps), **(metadata or {})})
    state = sess._buffers
    names = []
    for g in top_graphs(m):
        for t in g.initializer:
            if t.name in state.values and not is_detached(t):
                detach_tensor(t)
            if is_detached(t):
                names.append(t.name)
    return m, LazyTensors(state.tensor, names)


def checkpoint_model(sess, metadata: Mapping[str, str] | None) -> onnx.ModelProto:
    m, tensors = light_copy(sess, metadata, inference=False)
    attach_weights(m, tensors)
    return m


def save_checkpoint(sess, path, external_data_threshold: int = EXTERNAL_DATA_THRESHOLD,
                    metadata: Mapping[str, str] | None = None) -> None:
    m, tensors = light_copy(sess, metadata, inference=False)
    base = sess._base_path
    if lora_record(sess.model) is not None and base is not None and os.path.abspath(path) != base:
        reference_base(m, base, _frozen_in_base(sess, m), path)
    save_model_atomic(m, path, external_data_threshold, weights=tensors)


def _frozen_in_base(sess, m: onnx.ModelProto) -> set[str]:
    """The detached frozen tensors of ``m`` that the base file holds with the same type and shape."""
    base = {t.name: (t.data_type, list(t.dims))
            for t in onnx.load(sess._base_path, load_external_data=False).graph.initializer}
    return {t.name for t in m.graph.initializer if is_detached(t) and t.name not in sess._buffers.values
            and base.get(t.name) == (t.data_type, list(t.dims))}


def inference_light(sess, eval_mode: bool, adapters: str = "merged") -> tuple[onnx.ModelProto, Mapping]:
    """A light inference model (no training_info; with ``eval_mode`` BatchNormalization/Dropout in
    inference behaviour; LoRA adapters merged or as inputs) and its trained arrays."""
    record = lora_record(sess.model)
    m, tensors = light_copy(sess, None, inference=True)
    if record is not None:
        tensors = lora_inference(m, tensors, record, adapters)
    if eval_mode:
        to_eval_mode(m)
    finalize(m)
    check_model(m)
    return m, tensors


def load_checkpoint_state(sess, model: onnx.ModelProto, weights: Mapping | None = None) -> None:
    """Set every mutable tensor and the step count of ``sess`` from a checkpoint of its model."""
    state = sess._buffers
    stored = {t.name: t for g in top_graphs(model) for t in g.initializer if t.name in state.values}
    missing = [n for n in state.names if n not in stored]
    if missing:
        raise TrainingSpecError(f"the checkpoint has no value for the mutable tensor(s) {missing[:5]}; it is "
                                "not a checkpoint of this model")
    for name in state.names:
        t = stored[name]
        state.set(name, weights[name] if weights is not None and name in weights else numpy_helper.to_array(t))
    meta = {p.key: p.value for p in model.metadata_props}
    sess.steps = int(meta.get(md.STEPS, 0))
    sess.train_state = TrainState.from_metadata(meta)


__all__ = ["light_copy", "checkpoint_model", "save_checkpoint", "inference_light",
           "load_checkpoint_state"]
