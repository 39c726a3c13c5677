"""Serving a fine-tune in onnxruntime-genai: a copy of the model builder's folder made adapter-ready, and the
trained adapters as an ``.onnx_adapter`` file.

onnxruntime-genai serves LoRA as onnxruntime does (``og.Adapters(model).load(file, name)``, then
``generator.set_active_adapter(adapters, name)``): the adapter file's tensors are fed, by name, to inputs of
the model. The builder's ``model.onnx`` has none, so ``export_genai`` writes a copy of the folder whose model
is the builder's graph with the LoRA branches of the training run (``training/lora/rewrite.py``, the same rewrite on
the same nodes, so the same adapter names) and the adapters as graph inputs that default to zero
(``training/lora/merge.py``, ``adapters="inputs"``): without an active adapter it computes what the original
computes; ``genai_config.json``, the tokenizer and every other file are copied as they are (genai needs
nothing more). The ``.onnx_adapter`` holds the trained A and B under those names; another fine-tune of the same
layout (rank, targets) is one more such file (``export-adapter --format onnxruntime``) for the same folder.
"""
from __future__ import annotations

import json
import os
import shutil

import onnx

from ..errors import ModelFileError, TrainingBuilderError
from ..model.carrier import open_model
from ..model.io import external_data_files, save_model_atomic
from ..model.weights import inside
from ..passes.inference import INFERENCE, ExportContext
from ..passes.pipeline import run_pipeline
from .lora.adapters import GENAI_CONFIG, builder_folder, export_onnxruntime, tensor_values
from .lora.merge import lora_record
from .lora.rewrite import add_lora

ADAPTER_FILE = "adapter.onnx_adapter"
_FOLDER_HINT = "name the onnxruntime-genai folder the training model was made from: --genai-folder FOLDER"


def _decoder_file(folder: str) -> str:
    """The decoder model a genai folder names (``model.decoder.filename``), which must be in the folder."""
    try:
        with open(os.path.join(folder, GENAI_CONFIG), encoding="utf-8") as f:
            config = json.load(f)
        name = config["model"]["decoder"]["filename"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelFileError(f"{folder!r} holds no readable {GENAI_CONFIG} naming its decoder "
                             "(model.decoder.filename): not an onnxruntime-genai folder",
                             hint="name the folder the model builder wrote (--genai-folder)") from e
    return inside(folder, name, f"{os.path.join(folder, GENAI_CONFIG)!r} (model.decoder.filename)")


def _named_files(config) -> set[str]:
    """Every ``filename`` genai_config.json names (the decoder, a vision or speech model, ...)."""
    if isinstance(config, dict):
        found = {v for k, v in config.items() if k == "filename" and isinstance(v, str)}
        return found.union(*(_named_files(v) for v in config.values()))
    if isinstance(config, list):
        return set().union(*(_named_files(v) for v in config))
    return set()


def _folder_files(folder: str, decoder: str) -> list[str]:
    """The files of a genai folder to copy: all but the decoder and its external data, and but the .onnx models
    genai_config.json does not name (a training model or checkpoint saved there) and their data."""
    with open(os.path.join(folder, GENAI_CONFIG), encoding="utf-8") as f:
        named = _named_files(json.load(f))
    files = [f for f in sorted(os.listdir(folder)) if os.path.isfile(os.path.join(folder, f))]
    skip = {decoder}
    for f in files:
        if f.endswith(".onnx") and (f == decoder or f not in named):
            skip.add(f)
            skip.update(external_data_files(onnx.load(os.path.join(folder, f), load_external_data=False)))
    return [f for f in files if f not in skip]


def adapter_ready(decoder: str, record: dict) -> tuple[onnx.ModelProto, dict]:
    """The builder's model at ``decoder`` (a .onnx path) with the LoRA branches of ``record``, adapters as
    zero-default graph inputs; (light model, arrays). ModelFileError unless the rewrite gives the
    record's layers (the same nodes, weights and adapter names): it is not the model the adapters were
    trained on."""
    base = decoder
    light = open_model(decoder, what="genai model")
    model = onnx.ModelProto()
    model.CopyFrom(light.proto)
    arrays = dict(light.arrays)
    spec = {k: record[k] for k in ("rank", "alpha", "dropout", "targets")}
    try:
        add_lora(model, spec, arrays, arrays)
    except TrainingBuilderError as e:
        raise ModelFileError(f"{base!r} does not take the adapters' layers: {e}",
                             hint=_FOLDER_HINT) from e
    made = lora_record(model)["layers"]
    keys = ("node", "weight", "lora_A", "lora_B", "n_in", "n_out")
    if [[m[k] for k in keys] for m in made] != [[t[k] for k in keys] for t in record["layers"]]:
        raise ModelFileError(f"{base!r} is not the model the adapters were trained on: its LoRA layers (nodes, "
                             "weights, sizes) differ", hint=_FOLDER_HINT)
    ctx = ExportContext(arrays, adapters="inputs", eval_mode=True)
    run_pipeline(INFERENCE, model, ctx)
    return model, ctx.arrays


def export_genai(model_or_path, out_dir: str, folder: str | None = None, *, base=None, trusted=()) -> list[str]:
    """Write ``out_dir``: the onnxruntime-genai ``folder`` (default: the folder of the model the training model was
    made from, when it lies in the folder of ``model_or_path`` or of one of ``trusted``, ``io.source_of``) with
    its decoder adapter-ready, and ``adapter.onnx_adapter`` with the adapters of ``model_or_path`` (a training
    model or checkpoint; ``base``: the model its frozen weights are in, as ``open_model`` takes it). Returns the
    paths written (the model, the adapter file)."""
    light = open_model(model_or_path, base=base)
    if base is not None:
        trusted = [*trusted, os.path.dirname(os.path.abspath(os.fspath(base)))]
    record = lora_record(light.proto)
    if record is None:
        raise TrainingBuilderError("model", "the model has no LoRA adapters (no onnx_autodiff.lora metadata): "
                                            "build it with make_training_model(..., lora={...})")
    folder = folder or builder_folder(light, trusted)
    if folder is None:
        raise ModelFileError("the training model records no onnxruntime-genai folder it was made from in its own "
                             "folder or in one you named (a recorded path elsewhere is not read)", hint=_FOLDER_HINT)
    if os.path.isfile(folder):
        folder = os.path.dirname(os.path.abspath(folder))
    decoder = _decoder_file(folder)
    os.makedirs(out_dir, exist_ok=True)
    if os.path.samefile(folder, out_dir):
        raise ModelFileError(f"{out_dir!r} is the genai folder itself", hint="write the adapter-ready copy to "
                                                                               "another folder")
    for name in _folder_files(folder, os.path.basename(decoder)):
        shutil.copy2(os.path.join(folder, name), os.path.join(out_dir, name))
    model, arrays = adapter_ready(decoder, record)
    target = os.path.join(out_dir, os.path.basename(decoder))
    save_model_atomic(model, target, weights=arrays)
    values = tensor_values(light.proto, light.arrays,
                           [layer[k] for layer in record["layers"] for k in ("lora_A", "lora_B")])
    return [target, export_onnxruntime(record, values, os.path.join(out_dir, ADAPTER_FILE))]


__all__ = ["export_genai", "adapter_ready", "ADAPTER_FILE"]
