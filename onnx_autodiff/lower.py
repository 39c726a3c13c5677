"""``lower(model)``: the pipeline that turns a training-spec model into plain ONNX."""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import onnx
from onnx import helper

from .errors import OpsetTooOldError
from .passes import TRAINING_DOMAINS, lower_gradients, name_nodes
from .passes.naming import _graphs, _walk, used_names
from .passes.optimizers import lower_optimizers
from .passes.static_shapes import static_value_info
from .passes.training import check_no_training_ops, lower_training_info
from .registry import load_rules, non_differentiable_ops, registered_rules
from .upgrade import convert_opset, default_opset, warn_upgrade
from .weights import attach_weights, check_model, split_model

MAX_IR_VERSION = 13  # the newest IR version stock onnxruntime (1.31) loads


def runtime_ir_version(model: onnx.ModelProto) -> int:
    """An IR version the runtime reads that is still new enough for the model's opsets."""
    need = helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    return max(need, min(model.ir_version or MAX_IR_VERSION, MAX_IR_VERSION))


def used_domains(model: onnx.ModelProto) -> set[str]:
    return {n.domain or "" for top in _graphs(model) for g in _walk(top) for n in g.node}


def finalize(model: onnx.ModelProto) -> None:
    """Drop opset imports no node uses any more and pick an IR version the runtime reads."""
    domains = used_domains(model)
    keep = [o for o in model.opset_import if o.domain in ("", "ai.onnx") or o.domain in domains]
    if not any(o.domain in ("", "ai.onnx") for o in keep):
        keep.append(helper.make_opsetid("", 13))
    del model.opset_import[:]
    model.opset_import.extend(keep)
    model.ir_version = runtime_ir_version(model)


def lower(model: onnx.ModelProto, *, check: bool = True, target_opset: int | None = None) -> onnx.ModelProto:
    """Rewrite every Gradient node into standard ONNX ops; returns a new model.

    Also lowers every graph of every TrainingInfoProto (GraphCall, Gradient on the concatenation of
    the inference graph and ``algorithm``, Adagrad/Adam/Momentum); ``training_info`` stays, now plain.
    The input is not modified. Graph inputs and outputs stay as they are; forward outputs are unchanged.
    With ``check`` the result goes through ``onnx.checker.check_model(..., full_check=True)``.
    A light model (large tensors detached, see ``weights.py``) gives a light model.

    ``target_opset``: convert the model to this default-domain opset first (onnx.version_converter).
    Without it the model keeps its opset, unless a gradient cannot be written there (say a MaxPool
    gradient of a model with symbolic spatial dims below opset 16): then the model is converted to the
    opset that gradient needs, with a warning.
    """
    if not isinstance(model, onnx.ModelProto):
        raise TypeError(f"lower() takes an onnx.ModelProto, got {type(model).__name__}")
    light, weights = split_model(model)  # no pass reads large float values: copies and checks stay cheap
    have = default_opset(light)
    if target_opset is not None and target_opset != have:
        light = convert_opset(light, target_opset, "target_opset")
    try:
        out = _lower(light, check)
    except OpsetTooOldError as e:
        if target_opset is not None:
            raise
        out = _upgraded(light, have, e, check)
    attach_weights(out, weights)
    return out


def _upgraded(light: onnx.ModelProto, have: int, first: OpsetTooOldError, check: bool) -> onnx.ModelProto:
    """Lowered at the lowest newer opset where every gradient can be written (said once, as a warning)."""
    tried = have
    while True:
        tried = max(first.needs, tried + 1)
        if tried > onnx.defs.onnx_opset_version():
            raise first
        converted = convert_opset(light, tried, f"{first}")
        try:
            out = _lower(converted, check)
        except OpsetTooOldError as e:
            first = e
            continue
        warn_upgrade(have, tried, str(first).split(". lower()")[0])
        return out


def _lower(light: onnx.ModelProto, check: bool) -> onnx.ModelProto:
    """The pipeline on a light model (remembered by its bytes and the registered rules)."""
    key = _cache_key(light, check)
    if key in _LOWERED:  # the same light model lowered before (make_training_model, then the session)
        _LOWERED.move_to_end(key)
        return onnx.ModelProto.FromString(_LOWERED[key])
    out = onnx.ModelProto()
    out.CopyFrom(light)
    name_nodes(out)
    taken = used_names(out)
    hints = static_value_info(out)  # shapes the shape arithmetic tells; removed again below
    out.graph.value_info.extend(hints)
    lower_gradients(out, taken)  # each Gradient's nodes are cleaned up (CSE, DCE) as they are emitted
    lower_optimizers(out, taken)
    lower_training_info(out, taken)
    check_no_training_ops(out)
    if hints:
        hinted = {vi.name for vi in hints}
        kept = [vi for vi in out.graph.value_info if vi.name not in hinted]
        del out.graph.value_info[:]
        out.graph.value_info.extend(kept)
    finalize(out)
    if check:
        check_model(out)
    _LOWERED[key] = out.SerializeToString()
    while len(_LOWERED) > _CACHED:
        _LOWERED.popitem(last=False)
    return out


_CACHED = 2  # lowered light models kept (each the size of a graph without its weights)
_LOWERED: OrderedDict[bytes, bytes] = OrderedDict()


def _cache_key(light: onnx.ModelProto, check: bool) -> bytes:
    """What a lowering depends on: the light model's bytes and the rules registered at the time."""
    load_rules()
    rules = sorted((k, tuple(id(r) for r in v)) for k, v in registered_rules().items())
    plain = sorted(non_differentiable_ops().items())
    digest = hashlib.sha256(light.SerializeToString(deterministic=True))
    digest.update(repr((check, rules, plain)).encode())
    return digest.digest()


__all__ = ["lower", "finalize", "runtime_ir_version", "TRAINING_DOMAINS"]
