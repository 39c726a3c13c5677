"""``lower(model)``: the pipeline that turns a training-spec model into plain ONNX."""
from __future__ import annotations

import gc
from contextlib import contextmanager

import onnx

from ..engine.registry import load_rules
from ..errors import OpsetTooOldError
from ..graph import finalize, name_nodes
from ..model.carrier import LightModel, hand_back, open_model
from ..model.weights import check_model
from ..runtimes.targets import get_target
from . import LoweringContext, check_no_training_ops, lower_gradients, lower_optimizers, lower_training_info
from .loss_forms import split_cross_entropy
from .opset import convert_opset, default_opset, warn_upgrade
from .remat import note_gradients, rematerialize
from .standard_forms import rewrite_for_target
from .static_shapes import shape_hints

# The passes lower() runs, in order; each is ``run(model, ctx) -> bool`` (see passes/__init__.py).
PIPELINE = (
    name_nodes,             # unique node names: rules scope the nodes they emit under them
    note_gradients,         # under a memory budget, the gradients' names join its record (the plan holds them)
    lower_gradients,        # each Gradient -> its backward (function bodies, Dropout masks, clean-up)
    lower_optimizers,       # Adagrad / Adam / Momentum -> standard ops
    lower_training_info,    # every TrainingInfoProto: GraphCall inlined, then Gradient and optimizers
    split_cross_entropy,    # SoftmaxCrossEntropyLoss on [N, C] as LogSoftmax + NLL (2 [N, C] fewer in onnxruntime)
    rematerialize,          # under a recorded memory budget, the backward recomputes cheap activations (after the
                            # loss split: what it plans is what runs; a pass reading shapes after it would run
                            # onnx's data propagation over its copies: 430 MB of heap on a 4-layer BERT, kept)
    rewrite_for_target,     # standard-op forms of the ops the target lacks (runtimes/targets.py)
)
ENSURES = (check_no_training_ops,)  # the pipeline's postcondition: nothing of a training domain is left


def run_pipeline(passes, model: onnx.ModelProto, ctx, ensures=()) -> bool:
    """Run ``passes`` in order on ``model`` (in place), then check each of ``ensures``; whether it changed."""
    changed = False
    for run in passes:
        changed |= bool(run(model, ctx))
    for check in ensures:
        check(model, ctx)
    return changed


def lower(model, *, check: bool = True, target_opset: int | None = None, target: str | None = None
          ) -> onnx.ModelProto:
    """Rewrite every Gradient node into standard ONNX ops; returns a new ``onnx.ModelProto``.

    ``model``: a path, an ``onnx.ModelProto`` or what onnx-autodiff returned (``model/carrier.py``); its
    weights stay where they are (a weight of a file stays a reference into it). Also lowers every graph of
    every TrainingInfoProto (GraphCall, Gradient on the concatenation of the inference graph and
    ``algorithm``, Adagrad/Adam/Momentum); ``training_info`` stays, now plain. The input is not modified.
    Graph inputs and outputs stay as they are; forward outputs are unchanged. With ``check`` the result goes
    through ``onnx.checker.check_model(..., full_check=True)``.

    ``target_opset``: convert the model to this default-domain opset first (onnx.version_converter).
    Without it the model keeps its opset, unless a gradient cannot be written there (say a MaxPool
    gradient of a model with symbolic spatial dims below opset 16): then the model is converted to the
    opset that gradient needs, with a warning.

    ``target``: the runtime the result is for (``runtimes/targets.py``; default ``onnxruntime``, every op):
    nodes of ops that runtime lacks (SoftmaxCrossEntropyLoss on tract, MaxUnpool on OpenVINO, ...) are
    replaced by standard-op forms, in every graph. ``"portable"`` avoids what any tested runtime lacks.
    """
    return hand_back(lower_light(open_model(model), check=check, target_opset=target_opset, target=target))


def lower_light(light: LightModel, *, check: bool = True, target_opset: int | None = None,
                target: str | None = None) -> LightModel:
    """``lower`` on the carrier: the pipeline runs on the light graph; the arrays stay as they are."""
    tgt = get_target(target)
    proto = light.proto
    have = default_opset(proto)
    if target_opset is not None and target_opset != have:
        proto = convert_opset(proto, target_opset, "target_opset")
    try:
        out = _lower(proto, check, tgt.name)
    except OpsetTooOldError as e:
        if target_opset is not None:
            raise
        out = _upgraded(proto, have, e, check, tgt.name)
    return light.with_proto(out)


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
    """The pipeline on a light model."""
    load_rules()
    out = onnx.ModelProto()
    out.CopyFrom(light)
    ctx = LoweringContext(out, target=get_target(target))
    with collector_paused(), shape_hints(out):  # shape_hints: what shape arithmetic tells the rules; not kept
        run_pipeline(PIPELINE, out, ctx, ENSURES)
    finalize(out)
    if check:
        check_model(out)
    return out


__all__ = ["lower", "lower_light", "PIPELINE", "ENSURES", "run_pipeline"]
