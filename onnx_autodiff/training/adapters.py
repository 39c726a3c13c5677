"""LoRA adapters between onnx-autodiff, PEFT and onnxruntime.

Our adapters are initializers ``<weight>.lora_A`` [rank, in] / ``<weight>.lora_B`` [out, rank]; PEFT names
the same arrays after the module (``base_model.model.<module>.lora_A.weight`` in its files). The module
path comes from the rewrite's record (``onnx_autodiff.training.lora``), so a dynamo export's ``val_N``
weights map too. ``prefix``: a leading part of the module paths to drop, for a model exported through a
wrapper module (``m.model.layers.0...`` -> ``model.layers.0...`` with prefix ``m.``).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping

import numpy as np
from onnx import numpy_helper

from ..errors import TrainingBuilderError
from ..model.io import write_atomic
from ..model.weights import is_detached
from .precision import precision_record

PEFT_PREFIX = "base_model.model."


def tensor_values(model, weights: Mapping, names: list[str]) -> dict[str, np.ndarray]:
    """The arrays of initializers ``names`` of a (light) model: from ``weights`` when detached, else inline; a
    tensor that mixed precision trains through a float32 master is read from the master (float32)."""
    inits = {t.name: t for t in model.graph.initializer}
    masters = (precision_record(model) or {}).get("masters", {})  # mixed precision: W is Cast(W.fp32)
    missing = [n for n in names if n not in inits and masters.get(n) not in inits]
    if missing:
        raise TrainingBuilderError("model", f"the adapters {missing[:4]} are not initializers of the model")

    def value(n: str) -> np.ndarray:
        t = inits.get(n) or inits[masters[n]]
        return np.asarray(weights[t.name]) if is_detached(t) else numpy_helper.to_array(t)

    return {n: value(n) for n in names}


def _module(layer: dict, prefix: str) -> str:
    module = layer["module"]
    return module[len(prefix):] if prefix and module.startswith(prefix) else module


def peft_names(record: dict, prefix: str = "", adapter: str = "") -> dict[str, str]:
    """Our adapter name -> PEFT's key: ``base_model.model.<module>.lora_A.weight`` as PEFT saves it, or with
    ``adapter`` (``default``) ``...lora_A.<adapter>.weight`` as a live PeftModel names its parameters."""
    tail = f".{adapter}.weight" if adapter else ".weight"
    out = {}
    for layer in record["layers"]:
        module = _module(layer, prefix)
        out[layer["lora_A"]] = f"{PEFT_PREFIX}{module}.lora_A{tail}"
        out[layer["lora_B"]] = f"{PEFT_PREFIX}{module}.lora_B{tail}"
    return out


def peft_config(record: dict, prefix: str = "", base_model: str | None = None) -> dict:
    """The ``adapter_config.json`` PEFT reads for these adapters (plain LoRA, no bias, fan_in_fan_out off:
    PEFT's Linear layers hold [out, in] weights, which is what lora_A / lora_B are shaped for)."""
    modules = sorted({_module(layer, prefix).rsplit(".", 1)[-1] for layer in record["layers"]})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": record["rank"], "lora_alpha": record["alpha"],
            "lora_dropout": record["dropout"], "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "inference_mode": True, "base_model_name_or_path": base_model,
            "modules_to_save": None, "init_lora_weights": True}


def _check_prefix(record: dict, prefix: str) -> None:
    if prefix and not all(layer["module"].startswith(prefix) for layer in record["layers"]):
        bad = next(layer["module"] for layer in record["layers"] if not layer["module"].startswith(prefix))
        raise TrainingBuilderError("prefix", f"module {bad!r} does not start with {prefix!r}")


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray]) -> None:
    """``tensors`` as a safetensors file (the ``safetensors`` package when installed, else the format's
    header + little-endian bytes written here), atomically."""
    try:
        from safetensors.numpy import save
    except ImportError:
        save = safetensors_bytes
    write_atomic(path, save({k: np.ascontiguousarray(v) for k, v in tensors.items()}))


_ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32"}


def safetensors_bytes(tensors: Mapping[str, np.ndarray]) -> bytes:
    header, chunks, offset = {}, [], 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name]).astype(tensors[name].dtype.newbyteorder("<"), copy=False)
        data = arr.tobytes()
        header[name] = {"dtype": _ST_DTYPES[arr.dtype.name], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(chunks)


def export_peft(record: dict, arrays: Mapping[str, np.ndarray], out_dir: str, prefix: str = "",
                base_model: str | None = None) -> list[str]:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` into ``out_dir``; returns the paths."""
    _check_prefix(record, prefix)
    os.makedirs(out_dir, exist_ok=True)
    names = peft_names(record, prefix)
    weights = os.path.join(out_dir, "adapter_model.safetensors")
    config = os.path.join(out_dir, "adapter_config.json")
    write_safetensors(weights, {names[k]: np.asarray(arrays[k]) for k in names})
    write_atomic(config, json.dumps(peft_config(record, prefix, base_model), indent=2) + "\n")
    return [weights, config]


def export_onnxruntime(record: dict, arrays: Mapping[str, np.ndarray], path: str) -> str:
    """Write an onnxruntime adapter file (``.onnx_adapter``) holding the adapters under our names, the names
    the unmerged inference model (``export --keep-adapters``) reads them by."""
    import onnxruntime as ort

    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(1)
    fmt.set_model_version(1)
    params = {}
    for layer in record["layers"]:
        for key in ("lora_A", "lora_B"):
            params[layer[key]] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arrays[layer[key]]))
    fmt.set_parameters(params)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        fmt.export_adapter(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def export_adapter(model_or_path, out_dir: str, format: str = "peft", prefix: str = "") -> list[str]:
    """The LoRA adapters of a training model or checkpoint (a path or a ModelProto) written to ``out_dir``:
    ``format="peft"``: ``adapter_model.safetensors`` + ``adapter_config.json`` (``peft.PeftModel.from_pretrained``
    loads them onto the original model); ``"onnxruntime"``: ``adapter.onnx_adapter`` (``onnxruntime.LoraAdapter``,
    for the model ``export_inference(..., adapters="inputs")`` writes). Returns the paths written."""
    from ..model.carrier import open_model
    from .lora import lora_record

    if format not in ("peft", "onnxruntime"):
        raise TrainingBuilderError("format", f"'peft' or 'onnxruntime', got {format!r}")
    light = open_model(model_or_path)
    model, weights = light.proto, light.arrays
    record = lora_record(model)
    if record is None:
        raise TrainingBuilderError("model", "the model has no LoRA adapters (no onnx_autodiff.lora metadata): "
                                            "build it with make_training_model(..., lora={...})")
    arrays = tensor_values(model, weights, [layer[k] for layer in record["layers"] for k in ("lora_A", "lora_B")])
    if format == "peft":
        return export_peft(record, arrays, out_dir, prefix=prefix)
    os.makedirs(out_dir, exist_ok=True)
    return [export_onnxruntime(record, arrays, os.path.join(out_dir, "adapter.onnx_adapter"))]


__all__ = ["export_adapter", "safetensors_bytes", "tensor_values", "peft_names", "peft_config", "export_peft",
           "export_onnxruntime", "write_safetensors"]
