"""What a ``TrainingSession`` writes out: checkpoints and inference models, from a light copy.

Every writer starts from a light copy of the step's lowered model (``light_copy``: every mutable tensor
detached) and reads the state (``state.StateBuffers``) one tensor at a time while the tensors are written,
so saving a model never holds a second copy of its weights. Each takes the ``Step`` (``step.py``) and the
state, not the session.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import TrainingSpecError
from ..model import metadata as md
from ..model.io import EXTERNAL_DATA_THRESHOLD, load_split, reference_base, save_model_atomic
from ..model.weights import attach_weights, detach_tensor, is_detached, top_graphs
from ..passes.inference import INFERENCE, ExportContext
from ..passes.pipeline import run_pipeline
from .checkpoint import TrainState
from .state import LazyTensors, StateBuffers
from .step import Step, gradients_record


def light_copy(step: Step, state: StateBuffers) -> tuple[onnx.ModelProto, Mapping]:
    """A light copy of the model (every mutable tensor detached) and the arrays its detached
    tensors need, read from the state one at a time while they are written."""
    m = onnx.ModelProto()
    m.CopyFrom(step.light.proto)  # light: only graphs and small tensors
    names = []
    for g in top_graphs(m):
        for t in g.initializer:
            if t.name in state.values and not is_detached(t):
                detach_tensor(t)
            if is_detached(t):
                names.append(t.name)
    return m, LazyTensors(state.tensor, names)


def checkpoint_light(step: Step, state: StateBuffers, steps: int,
                     metadata: Mapping[str, str] | None) -> tuple[onnx.ModelProto, Mapping]:
    """The light copy with the gradients' names (a lowered model has no Gradient node left to say them), the
    step count ``steps`` and ``metadata`` recorded: a checkpoint."""
    m, tensors = light_copy(step, state)
    md.write(m, {**gradients_record(step), md.STEPS: str(steps), **(metadata or {})})
    return m, tensors


def checkpoint_model(step: Step, state: StateBuffers, steps: int, metadata: Mapping[str, str] | None
                     ) -> onnx.ModelProto:
    m, tensors = checkpoint_light(step, state, steps, metadata)
    attach_weights(m, tensors)
    return m


def save_checkpoint(step: Step, state: StateBuffers, steps: int, path,
                    external_data_threshold: int = EXTERNAL_DATA_THRESHOLD,
                    metadata: Mapping[str, str] | None = None) -> None:
    m, tensors = checkpoint_light(step, state, steps, metadata)
    base = step.base_path
    referenced = md.read(step.light.proto).get(md.FROZEN) == "reference"  # the builder's choice (LoRA: a large base)
    if referenced and base is not None and os.path.abspath(path) != base:
        reference_base(m, base, _frozen_in_base(base, state, m), path)
    save_model_atomic(m, path, external_data_threshold, weights=tensors)


def _frozen_in_base(base_path: str, state: StateBuffers, m: onnx.ModelProto) -> set[str]:
    """The frozen tensors of ``m`` that are still the base file's own bytes (memory maps of the very bytes the
    base model maps for that name): a checkpoint references them instead of copying them (a LoRA run's base)."""
    mapped = {n: a for n, a in state.weights.items() if isinstance(a, np.memmap) and n not in state.values}
    if not mapped:
        return set()
    _, base = load_split(base_path)
    return {t.name for t in m.graph.initializer if is_detached(t) and t.name in mapped
            and _same_bytes(mapped[t.name], base.get(t.name))}


def _same_bytes(a: np.memmap, b) -> bool:
    return (isinstance(b, np.memmap) and a.offset == b.offset and a.shape == b.shape and a.dtype == b.dtype
            and os.path.samefile(a.filename, b.filename))


def inference_light(step: Step, state: StateBuffers, eval_mode: bool, adapters: str = "merged"
                    ) -> tuple[onnx.ModelProto, Mapping]:
    """A light inference model and its trained arrays: the inference-export pipeline (``passes/inference.py``)
    on a light copy of the step's model."""
    m, tensors = light_copy(step, state)
    ctx = ExportContext(tensors, adapters, eval_mode)
    run_pipeline(INFERENCE, m, ctx)
    return m, ctx.arrays


def load_checkpoint_state(state: StateBuffers, model: onnx.ModelProto, weights: Mapping | None = None
                          ) -> tuple[int, TrainState | None]:
    """Set every mutable tensor of ``state`` from a checkpoint of its model; returns the checkpoint's step count
    and training state (``fit``'s, or None)."""
    stored = {t.name: t for g in top_graphs(model) for t in g.initializer if t.name in state.values}
    missing = [n for n in state.names if n not in stored]
    if missing:
        raise TrainingSpecError(f"the checkpoint has no value for the mutable tensor(s) {missing[:5]}; it is "
                                "not a checkpoint of this model")
    for name in state.names:
        t = stored[name]
        state.set(name, weights[name] if weights is not None and name in weights else numpy_helper.to_array(t))
    meta = {p.key: p.value for p in model.metadata_props}
    return int(meta.get(md.STEPS, 0)), TrainState.from_metadata(meta)


__all__ = ["light_copy", "checkpoint_model", "save_checkpoint", "inference_light",
           "load_checkpoint_state"]
