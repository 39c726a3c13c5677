"""``lower(model)``: the pipeline that turns a training-spec model into plain ONNX."""
from __future__ import annotations

import gc
import hashlib
from collections import OrderedDict
from contextlib import contextmanager

import onnx

from ..engine.registry import load_rules, non_differentiable_ops, registered_rules
from ..errors import OpsetTooOldError
from ..graph import finalize, name_nodes
from ..model.light_model import LightModel, model_parts
from ..model.weights import attach_weights, check_model, split_model
from . import LoweringContext, check_no_training_ops, lower_gradients, lower_optimizers, lower_training_info
from .loss_forms import split_cross_entropy
from .opset import convert_opset, default_opset, warn_upgrade
from .remat import rematerialize
from .static_shapes import shape_hints
from .targets import get_target, rewrite_for_target

# The passes lower() runs, in order; each is ``run(model, ctx) -> bool`` (see passes/__init__.py).
PIPELINE = (
    name_nodes,             # unique node names: rules scope the nodes they emit under them
    lower_gradients,        # each Gradient -> its backward (function bodies, Dropout masks, clean-up)
    lower_optimizers,       # Adagrad / Adam / Momentum -> standard ops
    lower_training_info,    # every TrainingInfoProto: GraphCall inlined, then Gradient and optimizers
    check_no_training_ops,  # nothing of a training domain is left
    rematerialize,          # under a recorded memory budget, the backward recomputes cheap activations
    split_cross_entropy,    # SoftmaxCrossEntropyLoss on [N, C] as LogSoftmax + NLL (2 [N, C] fewer in onnxruntime)
)


def lower(model: onnx.ModelProto | LightModel, *, check: bool = True, target_opset: int | None = None,
          target: str | None = None) -> onnx.ModelProto | LightModel:
    """Rewrite every Gradient node into standard ONNX ops; returns a new model.

    Also lowers every graph of every TrainingInfoProto (GraphCall, Gradient on the concatenation of
    the inference graph and ``algorithm``, Adagrad/Adam/Momentum); ``training_info`` stays, now plain.
    The input is not modified. Graph inputs and outputs stay as they are; forward outputs are unchanged.
    With ``check`` the result goes through ``onnx.checker.check_model(..., full_check=True)``.
    A light model (large tensors detached, see ``weights.py``) gives a light model, a ``LightModel`` a
    ``LightModel`` with the same arrays.

    ``target_opset``: convert the model to this default-domain opset first (onnx.version_converter).
    Without it the model keeps its opset, unless a gradient cannot be written there (say a MaxPool
    gradient of a model with symbolic spatial dims below opset 16): then the model is converted to the
    opset that gradient needs, with a warning.

    ``target``: the runtime the result is for (``passes/targets.py``; default ``onnxruntime``, every op):
    nodes of ops that runtime lacks (SoftmaxCrossEntropyLoss on tract, MaxUnpool on OpenVINO, ...) are
    replaced by standard-op forms, in every graph. ``"portable"`` avoids what any tested runtime lacks.
    """
    parts = model_parts(model)
    if parts is not None:  # make_training_model's LightModel: lowered light, its arrays where they are
        return LightModel(lower(parts[0], check=check, target_opset=target_opset, target=target), parts[1])
    if not isinstance(model, onnx.ModelProto):
        raise TypeError(f"lower() takes an onnx.ModelProto, got {type(model).__name__}")
    tgt = get_target(target)
    light, weights = split_model(model)  # no pass reads large float values: copies and checks stay cheap
    have = default_opset(light)
    if target_opset is not None and target_opset != have:
        light = convert_opset(light, target_opset, "target_opset")
    try:
        out = _lower(light, check, tgt.name)
    except OpsetTooOldError as e:
        if target_opset is not None:
            raise
        out = _upgraded(light, have, e, check, tgt.name)
    attach_weights(out, weights)
    return out


@contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for the duration: the passes allocate hundreds of thousands
    of small objects that live until the pass ends, and the collector's full passes over them took about
    a fifth of a 10,000-node chain's lowering (6.1 -> 5.0 CPU s); nothing they make needs it (the
    collector runs again afterwards and frees whatever cycles there were)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _upgraded(light: onnx.ModelProto, have: int, first: OpsetTooOldError, check: bool,
              target: str) -> onnx.ModelProto:
    """Lowered at the lowest newer opset where every gradient can be written (said once, as a warning)."""
    tried = have
    while True:
        tried = max(first.needs, tried + 1)
        if tried > onnx.defs.onnx_opset_version():
            raise first
        converted = convert_opset(light, tried, f"{first}")
        try:
            out = _lower(converted, check, target)
        except OpsetTooOldError as e:
            first = e
            continue
        warn_upgrade(have, tried, str(first).split(". lower()")[0])
        return out


def _lower(light: onnx.ModelProto, check: bool, target: str) -> onnx.ModelProto:
    """The pipeline on a light model (remembered by its bytes, the target and the registered rules)."""
    key = _cache_key(light, check, target)
    if key in _LOWERED:  # the same light model lowered before (make_training_model, then the session)
        _LOWERED.move_to_end(key)
        return onnx.ModelProto.FromString(_LOWERED[key])
    out = onnx.ModelProto()
    out.CopyFrom(light)
    ctx = LoweringContext(out, target=target)
    with collector_paused(), shape_hints(out):  # shape_hints: what shape arithmetic tells the rules; not kept
        for run in PIPELINE:
            run(out, ctx)
    rewrite_for_target(out, ctx.target, ctx.taken)  # standard forms of the ops the target lacks
    finalize(out)
    if check:
        check_model(out)
    _LOWERED[key] = out.SerializeToString()
    while len(_LOWERED) > _CACHED:
        _LOWERED.popitem(last=False)
    return out


_CACHED = 2  # lowered light models kept (each the size of a graph without its weights)
_LOWERED: OrderedDict[bytes, bytes] = OrderedDict()


def clear_cache() -> None:
    """Forget the remembered lowerings (a benchmark timing lower() from scratch calls it first)."""
    _LOWERED.clear()


def _cache_key(light: onnx.ModelProto, check: bool, target: str) -> bytes:
    """What a lowering depends on: the light model's bytes and the rules registered at the time."""
    load_rules()
    rules = sorted((k, tuple(id(r) for r in v)) for k, v in registered_rules().items())
    plain = sorted(non_differentiable_ops().items())
    digest = hashlib.sha256(light.SerializeToString(deterministic=True))
    digest.update(repr((check, target, rules, plain)).encode())
    return digest.digest()


__all__ = ["lower"]
