"""``lower(model)``: the pipeline that turns a training-spec model into plain ONNX."""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import onnx
from onnx import helper

from .passes import TRAINING_DOMAINS, lower_gradients, name_nodes
from .passes.naming import _graphs, _walk, used_names
from .passes.optimizers import lower_optimizers
from .passes.static_shapes import static_value_info
from .passes.training import check_no_training_ops, lower_training_info
from .registry import load_rules, non_differentiable_ops, registered_rules
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


def lower(model: onnx.ModelProto, *, check: bool = True) -> onnx.ModelProto:
    """Rewrite every Gradient node into standard ONNX ops; returns a new model.

    Also lowers every graph of every TrainingInfoProto (GraphCall, Gradient on the concatenation of
    the inference graph and ``algorithm``, Adagrad/Adam/Momentum); ``training_info`` stays, now plain.
    The input is not modified. Graph inputs and outputs stay as they are; forward outputs are unchanged.
    With ``check`` the result goes through ``onnx.checker.check_model(..., full_check=True)``.
    A light model (large tensors detached, see ``weights.py``) gives a light model.
    """
    if not isinstance(model, onnx.ModelProto):
        raise TypeError(f"lower() takes an onnx.ModelProto, got {type(model).__name__}")
    out, weights = split_model(model)  # no pass reads large float values: copies and checks stay cheap
    key = _cache_key(out, check)
    if key in _LOWERED:  # the same light model lowered before (make_training_model, then the session)
        _LOWERED.move_to_end(key)
        done = onnx.ModelProto.FromString(_LOWERED[key])
        attach_weights(done, weights)
        return done
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
    attach_weights(out, weights)
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
