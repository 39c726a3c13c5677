"""LoRA adapters between onnx-autodiff, PEFT and onnxruntime.

Our adapters are initializers ``<weight>.lora_A`` [rank, in] / ``<weight>.lora_B`` [out, rank]; PEFT names
the same arrays after the module (``base_model.model.<module>.lora_A.weight`` in its files). The module
path comes from the rewrite's record (``rewrite.py``), so a dynamo export's ``val_N``
weights map too. ``prefix``: a leading part of the module paths to drop, for a model exported through a
wrapper module (``m.model.layers.0...`` -> ``model.layers.0...`` with prefix ``m.``).
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from onnx import numpy_helper

from ...errors import AdapterError, TrainingBuilderError
from ...model.io import source_of, write_atomic
from ...model.weights import is_detached
from ..precision import precision_record

PEFT_PREFIX = "base_model.model."
GENAI_CONFIG = "genai_config.json"


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
    """The module path PEFT knows: ``prefix`` dropped; the model builder's ``model.layers.N.attn.`` is
    Hugging Face's ``model.layers.N.self_attn.`` (a builder layer: its weight is ``<module>.MatMul.weight...``)."""
    module = layer["module"]
    module = module[len(prefix):] if prefix and module.startswith(prefix) else module
    if layer.get("weight", "").startswith(f"{layer['module']}.MatMul.weight"):
        module = _BUILDER_ATTN.sub(r"\1.self_attn.", module)
    return module


_BUILDER_ATTN = re.compile(r"^(model\.layers\.\d+)\.attn\.")
# Hugging Face models whose attention keeps q, k and v in one Linear, as the model builder's qkv_proj does
# (genai_config.json's model.type); in the others a builder's qkv_proj is three modules q_proj, k_proj, v_proj
HF_FUSED_QKV = {"phi3", "phi3small", "phimoe"}
# Hugging Face families whose MLP keeps gate and up in one Linear ``gate_up_proj`` (gate rows first), which the
# model builder splits into gate_proj and up_proj (Phi-3, Phi-3.5, Phi-4-mini: model.type phi3)
HF_FUSED_MLP = {"phi3"}
# a fused Hugging Face module -> the builder's modules it was split into, in the order of its output rows
FUSED_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "qkv_proj": ("q_proj", "k_proj", "v_proj")}


@dataclass
class PeftModule:
    """One adapted module as PEFT names it: ``lora_A`` / ``lora_B`` (our adapters) and the rows of B it takes
    (``rows``: a block of a fused projection's output, or None for all). A Hugging Face module that the builder
    split (``FUSED_PARTS``) is several of our layers: ``parts`` holds (lora_A, lora_B, (row start, row end)) of
    each, ``n_out`` the fused output width; its LoRA has A stacked over the parts (rank: parts x rank) and B
    block-diagonal, each part's B in its rows and its own rank columns."""

    module: str
    lora_A: str
    lora_B: str
    rows: tuple[int, int] | None = None
    parts: list | None = None
    n_out: int = 0


def _qkv_heads(model, output: str) -> tuple[int, int] | None:
    """(num_heads, kv_num_heads) of the GroupQueryAttention that reads ``output`` (through a bias Add) as packed
    q/k/v, else None."""
    readers: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    seen = [output] + [n.output[0] for n in readers.get(output, []) if n.op_type == "Add"]
    for name in seen:
        for n in readers.get(name, []):
            if n.op_type == "GroupQueryAttention" and n.input[0] == name and (len(n.input) < 2 or not n.input[1]):
                attrs = {a.name: a.i for a in n.attribute if a.name in ("num_heads", "kv_num_heads")}
                return attrs.get("num_heads", 0), attrs.get("kv_num_heads", 0)
    return None


def peft_modules(record: dict, prefix: str = "", model=None, family: str | None = None) -> list[PeftModule]:
    """The modules PEFT knows for our adapters. A packed ``qkv_proj`` of the model builder (read by a
    GroupQueryAttention of ``model``'s graph) becomes ``q_proj``, ``k_proj`` and ``v_proj``, each with the same
    A and its row block of B (x A^T B^T = [x A^T B_q^T, x A^T B_k^T, x A^T B_v^T]), unless the Hugging Face
    ``family`` (genai_config.json's model.type) keeps them fused (``HF_FUSED_QKV``)."""
    out, split = [], {}
    for layer in record["layers"]:
        module = _module(layer, prefix)
        fused = _fused_name(layer, module, family)
        if fused is not None:
            split.setdefault(fused, []).append((module.rsplit(".", 1)[1], layer))
            continue
        heads = _qkv_heads(model, layer["output"]) if model is not None and module.endswith(".qkv_proj") else None
        if heads is None or family in HF_FUSED_QKV or not all(heads):
            out.append(PeftModule(module, layer["lora_A"], layer["lora_B"]))
            continue
        n, nkv = heads
        head = layer["n_out"] // (n + 2 * nkv)
        stem = module[:-len("qkv_proj")]
        bounds = [0, n * head, (n + nkv) * head, (n + 2 * nkv) * head]
        out += [PeftModule(f"{stem}{part}", layer["lora_A"], layer["lora_B"], (bounds[k], bounds[k + 1]))
                for k, part in enumerate(("q_proj", "k_proj", "v_proj"))]
    return out + [_fused_module(fused, dict(layers), model) for fused, layers in split.items()]


def _fused_name(layer: dict, module: str, family: str | None) -> str | None:
    """The fused Hugging Face module a builder layer was split from (``model.layers.0.mlp.gate_proj`` ->
    ``model.layers.0.mlp.gate_up_proj`` in a phi3 folder), else None."""
    if not layer.get("weight", "").startswith(f"{layer['module']}.MatMul.weight"):
        return None
    stem, _, last = module.rpartition(".")
    for fused, parts in FUSED_PARTS.items():
        if last in parts and family in (HF_FUSED_MLP if fused == "gate_up_proj" else HF_FUSED_QKV):
            return f"{stem}.{fused}"
    return None


def _fused_module(fused: str, layers: dict, model) -> PeftModule:
    """The PeftModule of ``fused`` from the builder's layers of its parts (part name -> layer): the output rows of
    each part, from the parts' widths (gate and up: equal halves; q, k, v: the heads of the GroupQueryAttention
    that reads them). AdapterError naming the modules where a part's width is not known."""
    names = FUSED_PARTS[fused.rsplit(".", 1)[1]]
    widths = {p: layers[p]["n_out"] for p in names if p in layers}
    if len(names) == 2:
        width = next(iter(widths.values()))
        widths = {p: width for p in names}
    elif len(widths) < 3:
        heads = _split_qkv_heads(model, [layer["output"] for layer in layers.values()])
        part, layer = next(iter(layers.items()))
        if heads is None:
            raise AdapterError(
                f"PEFT's {fused!r} is one Linear of q, k and v, and the adapters cover {sorted(layers)} only: the "
                "widths of the others are not known from the model",
                hint="adapt all of q_proj, k_proj and v_proj (or the target qkv_proj), or export --format onnxruntime")
        n, nkv = heads
        head = layer["n_out"] // (n if part == "q_proj" else nkv)
        widths = {"q_proj": n * head, "k_proj": nkv * head, "v_proj": nkv * head}
    parts, start = [], 0
    for p in names:
        if p in layers:
            parts.append((layers[p]["lora_A"], layers[p]["lora_B"], (start, start + widths[p])))
        start += widths[p]
    first = parts[0]
    return PeftModule(fused, first[0], first[1], parts=parts, n_out=start)


def _split_qkv_heads(model, outputs: list[str]) -> tuple[int, int] | None:
    """(num_heads, kv_num_heads) of the GroupQueryAttention that reads one of ``outputs`` (through a bias Add) as
    its query, key or value, else None."""
    if model is None:
        return None
    readers: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    names = list(outputs) + [n.output[0] for o in outputs for n in readers.get(o, []) if n.op_type == "Add"]
    for name in names:
        for n in readers.get(name, []):
            if n.op_type == "GroupQueryAttention" and name in n.input[:3]:
                attrs = {a.name: a.i for a in n.attribute if a.name in ("num_heads", "kv_num_heads")}
                return attrs.get("num_heads", 0), attrs.get("kv_num_heads", 0)
    return None


def conv1d_layers(record: dict) -> list[bool]:
    """For each layer, whether its module is a GPT-2 style Conv1D (a [in, out] parameter ``<module>.weight``
    read as it is stored, where a Linear's [out, in] weight is read transposed or folded into a new
    ``val_N`` initializer by the exporter): PEFT's ``fan_in_fan_out``."""
    return [layer.get("layout") == "in_out" and layer.get("weight") == f"{layer['module']}.weight"
            for layer in record["layers"]]


def peft_names(record: dict, prefix: str = "", adapter: str = "", model=None, family: str | None = None
               ) -> dict[str, str]:
    """Our adapter name -> PEFT's key: ``base_model.model.<module>.lora_A.weight`` as PEFT saves it, or with
    ``adapter`` (``default``) ``...lora_A.<adapter>.weight`` as a live PeftModel names its parameters. A layer
    that ``peft_modules`` splits maps to its first module only, and a layer that it fuses with others (Phi-3's
    gate_up_proj) to none: ``peft_tensors`` gives every value."""
    tail = f".{adapter}.weight" if adapter else ".weight"
    out = {}
    for m in peft_modules(record, prefix, model, family):
        if m.parts is not None:  # a slice of a fused module's A and B: peft_tensors gives its values
            continue
        out.setdefault(m.lora_A, f"{PEFT_PREFIX}{m.module}.lora_A{tail}")
        out.setdefault(m.lora_B, f"{PEFT_PREFIX}{m.module}.lora_B{tail}")
    return out


def peft_tensors(record: dict, arrays: Mapping[str, np.ndarray], prefix: str = "", adapter: str = "", model=None,
                 family: str | None = None) -> dict[str, np.ndarray]:
    """PEFT's key -> value of every adapter (a split layer's B cut into its row blocks)."""
    tail = f".{adapter}.weight" if adapter else ".weight"
    out = {}
    for m in peft_modules(record, prefix, model, family):
        a, b = np.asarray(arrays[m.lora_A]), np.asarray(arrays[m.lora_B])
        if m.parts is not None:
            a = np.concatenate([np.asarray(arrays[pa]) for pa, _, _ in m.parts], axis=0)
            b = np.zeros((m.n_out, a.shape[0]), a.dtype)
            for k, (_, pb, (start, end)) in enumerate(m.parts):
                part = np.asarray(arrays[pb])
                b[start:end, k * part.shape[1]:(k + 1) * part.shape[1]] = part
        out[f"{PEFT_PREFIX}{m.module}.lora_A{tail}"] = a
        out[f"{PEFT_PREFIX}{m.module}.lora_B{tail}"] = b if m.rows is None else b[m.rows[0]:m.rows[1]]
    return out


def peft_config(record: dict, prefix: str = "", base_model: str | None = None, model=None,
                family: str | None = None) -> dict:
    """The ``adapter_config.json`` PEFT reads for these adapters (plain LoRA, no bias). ``fan_in_fan_out``: the
    modules are GPT-2 style Conv1D layers (``conv1d_layers``; lora_A / lora_B keep PEFT's [r, in] / [out, r]
    either way); a mix of Conv1D and Linear modules has no single config and is refused."""
    conv = conv1d_layers(record)
    if any(conv) and not all(conv):
        mixed = [layer["module"] for layer, c in zip(record["layers"], conv) if c]
        raise TrainingBuilderError("lora", f"PEFT's config has one fan_in_fan_out for all modules, and these adapt "
                                           f"Conv1D layers ({mixed[:3]}) beside Linear ones: export them apart")
    found = peft_modules(record, prefix, model, family)
    modules = sorted({m.module.rsplit(".", 1)[-1] for m in found})
    # a fused module of k parts has rank k r: alpha k alpha keeps its scaling alpha / r
    fused = {m.module: len(m.parts) for m in found if m.parts is not None and len(m.parts) > 1}
    patterns = {"rank_pattern": {m: k * record["rank"] for m, k in fused.items()},
                "alpha_pattern": {m: k * record["alpha"] for m, k in fused.items()}} if fused else {}
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": record["rank"], "lora_alpha": record["alpha"],
            "lora_dropout": record["dropout"], "target_modules": modules, "bias": "none",
            "fan_in_fan_out": bool(conv) and all(conv), "use_rslora": False, "inference_mode": True,
            "base_model_name_or_path": base_model, "modules_to_save": None, "init_lora_weights": True, **patterns}


def _check_prefix(record: dict, prefix: str) -> None:
    if prefix and not all(layer["module"].startswith(prefix) for layer in record["layers"]):
        bad = next(layer["module"] for layer in record["layers"] if not layer["module"].startswith(prefix))
        first = bad.split(".", 1)[0] + "." if "." in bad else ""
        raise AdapterError(f"export_adapter(prefix={prefix!r}): the module path {bad!r} does not start with it",
                           hint=f"pass a leading part of the module paths (such as {first!r}), or none"
                           if first else "leave --prefix out")


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
                base_model: str | None = None, model=None, family: str | None = None) -> list[str]:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` into ``out_dir``; returns the paths.
    ``model``: the graph the adapters were trained in (a packed q/k/v projection splits, ``peft_modules``);
    ``family``: the Hugging Face family of a model builder's model (``check_family``)."""
    _check_prefix(record, prefix)
    family = family.strip().lower() if family else None  # genai_config.json's spelling: --family Phi3 is phi3
    check_family(record, prefix, family)
    config = peft_config(record, prefix, base_model, model, family)
    os.makedirs(out_dir, exist_ok=True)
    weights = os.path.join(out_dir, "adapter_model.safetensors")
    path = os.path.join(out_dir, "adapter_config.json")
    write_safetensors(weights, peft_tensors(record, arrays, prefix, model=model, family=family))
    write_atomic(path, json.dumps(config, indent=2) + "\n")
    return [weights, path]


# the builder's modules whose Hugging Face names depend on the family: fused in some (FUSED_PARTS), split in others
_FAMILY_NAMED = {"qkv_proj", *(p for parts in FUSED_PARTS.values() for p in parts)}


def check_family(record: dict, prefix: str, family: str | None) -> None:
    """AdapterError when the model builder's layers of ``record`` have a module whose Hugging Face name depends on
    the family (gate_proj / up_proj are Phi-3's one gate_up_proj, q/k/v its qkv_proj) and ``family`` is unknown:
    PEFT would load split names onto a fused model with no warning and no adapter on them."""
    if family:
        return
    named = sorted({_module(layer, prefix) for layer in record["layers"]
                    if layer.get("weight", "").startswith(f"{layer['module']}.MatMul.weight")
                    and layer["module"].rsplit(".", 1)[-1] in _FAMILY_NAMED})
    if named:
        raise AdapterError(
            f"the adapters of {named[:4]}{' ...' if len(named) > 4 else ''} are on a model builder's modules whose "
            "names in transformers depend on the model family (Phi-3 fuses gate_proj and up_proj into gate_up_proj, "
            "q/k/v into qkv_proj; Llama keeps them apart), and the family is not known: the checkpoint records none "
            f"and no {GENAI_CONFIG} of the folder it was made from is found",
            hint="pass --base TRAINING_MODEL (the training model, its builder folder in its folder) or --family NAME "
                 f"({GENAI_CONFIG}'s model.type: llama, qwen2, phi3, ...); API: export_adapter(..., family=NAME)")


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


def builder_folder(light, trusted=()) -> str | None:
    """The folder of the inference model a training model was made from (``io.source_of``: recorded in
    ``metadata.SOURCE``, and in the folder of the model or of one of ``trusted``) when it is an
    onnxruntime-genai folder (it holds genai_config.json), else None."""
    source = source_of(light.proto, ([light.folder] if light.folder else []) + list(trusted))
    folder = os.path.dirname(source) if source else None
    return folder if folder and os.path.isfile(os.path.join(folder, GENAI_CONFIG)) else None


def genai_type(light, trusted=()) -> str | None:
    """genai_config.json's ``model.type`` (llama, qwen2, phi3, ...) of the folder the model was made from."""
    folder = builder_folder(light, trusted)
    return None if folder is None else folder_family(os.path.join(folder, "model.onnx"))


def folder_family(path) -> str | None:
    """genai_config.json's ``model.type`` in the folder of the model file ``path`` (a model builder's folder: the
    family make_training_model records for export-adapter), else None."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(path)), GENAI_CONFIG), encoding="utf-8") as f:
            kind = json.load(f)["model"]["type"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return kind if isinstance(kind, str) and kind else None


def export_adapter(model_or_path, out_dir: str, format: str = "peft", prefix: str = "", base=None,
                   family: str | None = None) -> list[str]:
    """The LoRA adapters of a training model or checkpoint (a path or a ModelProto) written to ``out_dir``:
    ``format="peft"``: ``adapter_model.safetensors`` + ``adapter_config.json`` (``peft.PeftModel.from_pretrained``
    loads them onto the original model); ``"onnxruntime"``: ``adapter.onnx_adapter`` (``onnxruntime.LoraAdapter``,
    for the model ``export_inference(..., adapters="inputs")`` writes). Returns the paths written. ``base``: the
    model a checkpoint's frozen weights are in, when it is outside the checkpoint's folder. ``family``: peft, the
    Hugging Face family (genai_config.json's model.type) of a model builder's model; by default the one the LoRA
    record holds (make_training_model records it), else the one of the builder folder found (``check_family``)."""
    from ...model.carrier import open_model
    from .merge import lora_record

    if format not in ("peft", "onnxruntime"):
        raise AdapterError(f"export_adapter(format={format!r}): choose 'peft' or 'onnxruntime'")
    light = open_model(model_or_path, base=base)
    model, weights = light.proto, light.arrays
    record = lora_record(model)
    if record is None:
        raise AdapterError("the model has no LoRA adapters (no onnx_autodiff.lora metadata)",
                           hint="build it with make_training_model(..., lora={...}) or make-training --lora-rank R")
    arrays = tensor_values(model, weights, [layer[k] for layer in record["layers"] for k in ("lora_A", "lora_B")])
    if format == "peft":
        # a checkpoint beside its training model's folder: the builder folder the base was made from is trusted
        trusted = [os.path.dirname(os.path.abspath(base))] if isinstance(base, (str, os.PathLike)) else []
        family = family or record.get("family") or genai_type(light, trusted)
        return export_peft(record, arrays, out_dir, prefix=prefix, model=model, family=family)
    os.makedirs(out_dir, exist_ok=True)
    return [export_onnxruntime(record, arrays, os.path.join(out_dir, "adapter.onnx_adapter"))]


__all__ = ["export_adapter", "safetensors_bytes", "tensor_values", "peft_names", "peft_tensors", "peft_modules",
           "peft_config", "conv1d_layers", "export_peft", "export_onnxruntime", "write_safetensors", "PeftModule",
           "builder_folder", "genai_type", "folder_family", "check_family", "HF_FUSED_QKV", "HF_FUSED_MLP",
           "FUSED_PARTS", "GENAI_CONFIG"]
