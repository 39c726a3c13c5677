"""The file-format contract: the ``metadata_props`` keys onnx-autodiff writes into the models it emits,
and their readers. A file written by one version is read by the next, so a key never changes its text."""
from __future__ import annotations

import json
from collections.abc import Mapping

import onnx

PREFIX = "onnx_autodiff."
UPDATE_BINDING = "onnx_autodiff.update_binding"  # step model: {state input: new-state output}, JSON
INITIALIZATION_BINDING = "onnx_autodiff.initialization_binding"  # init model: {state: output}, JSON
STEP_STATE = "onnx_autodiff.state"  # step model: the mutable inputs in order, JSON list
TRAIN_STATE = "onnx_autodiff.train_state"  # checkpoint: the epoch loop's TrainState, JSON
STEPS = "onnx_autodiff.steps"  # checkpoint: optimizer steps taken
GRADIENTS = "onnx_autodiff.gradients"  # lowered training model: its gradient tensors, JSON
BUILDER = "onnx_autodiff.training_builder"  # make_training_model's record (loss, labels, lr input...), JSON
LORA = "onnx_autodiff.lora"  # training model / checkpoint: the LoRA rewrite's record (rank, alpha, layers), JSON
BASE = "onnx_autodiff.base"  # checkpoint: the model file its referenced frozen weights are in, JSON {path, abspath}
MEMORY_BUDGET = "onnx_autodiff.memory_budget"  # training model: {"budget": bytes | "auto", "dims", "loss"}, JSON
PRECISION = "onnx_autodiff.precision"  # training model: mixed precision's record (dtype, masters, loss scale), JSON
REMAT = "onnx_autodiff.remat"  # lowered training model: the rematerialization plan's one-line summary
HOST_SCALARS = "onnx_autodiff.host_scalars"  # step model: {input: how a driver computes it from the counter}, JSON
SOURCE = "onnx_autodiff.source"  # training model: the inference model file it was made from, JSON {path, abspath}
FROZEN = "onnx_autodiff.frozen"  # training model: "reference" -> checkpoints reference the frozen base, not copy it
WEIGHTS_FOLDER = "onnx_autodiff.weights_folder"  # a model we handed back: the token of its files' folder (this process)


def read(model: onnx.ModelProto) -> dict[str, str]:
    """Every metadata entry of ``model``, as a dict."""
    return {p.key: p.value for p in model.metadata_props}


def read_json(model: onnx.ModelProto, key: str, default=None):
    """The JSON value stored under ``key``, or ``default`` where the model has none."""
    for p in model.metadata_props:
        if p.key == key:
            return json.loads(p.value)
    return default


def write(model: onnx.ModelProto, values: Mapping[str, str]) -> None:
    """Set ``values`` in ``model.metadata_props`` in place, replacing entries with the same keys."""
    kept = [p for p in model.metadata_props if p.key not in values]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.extend(onnx.StringStringEntryProto(key=k, value=str(v)) for k, v in values.items())


def drop(model: onnx.ModelProto, keys) -> None:
    """Remove the entries under ``keys``, in place."""
    keys = set(keys)
    kept = [p for p in model.metadata_props if p.key not in keys]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)


def drop_ours(model: onnx.ModelProto) -> None:
    """Remove every entry onnx-autodiff wrote (for a plain inference model), in place."""
    kept = [p for p in model.metadata_props if not p.key.startswith(PREFIX)]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
