"""One step assembly: a training model made into the step a runtime runs, once, for every caller.

``assemble(light, target, index, dims)`` lowers the training model for ``target`` (``runtimes/targets.py``), builds
the one-graph step of ``training_info[index]`` and the initialization models (``step_model.py``), lets the driver
compute the host scalars (``feed_host_scalars``), runs the target's step fixes and names the loss. The result, a
``Step``, is what ``TrainingSession`` runs, what the bundle writer writes (``bundle.py``, ``plain=True``: no input
keeps an initializer default) and what device placement asks onnxruntime about (``devices.fallback_nodes``).
Everything the callers read is handed over as it was made: nothing is written into a model to be read back.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import TrainingSpecError
from ..graph import FLOAT_TYPES, finalize
from ..model import metadata as md
from ..model.carrier import LightModel, open_model
from ..model.io import base_path_of
from ..model.weights import check_model
from ..passes.context import LoweringContext
from ..passes.pipeline import lower_light, run_pipeline
from ..passes.static_shapes import fix_dims
from ..passes.step_quirks import bfloat16_in_float32, step_fixes
from ..passes.training import training_nodes_left
from ..runtimes.targets import get_target
from .prefold import fold_weight_arithmetic
from .progress import stage
from .spec_checks import check_step_bindings
from .step_model import (
    checked_plain,
    feed_host_scalars,
    gradient_names,
    plain_init_model,
    plain_step_parts,
    validate_training_info,
)


@dataclass
class Step:
    """One training step of ``training_info[index]``, assembled for ``target``.

    ``light``: the lowered training model (``training_info`` kept, plain) and its arrays: what a checkpoint is
    written from. ``model``: the step model (inference graph + algorithm, one graph). ``init_models``: the
    initialization model of every ``training_info`` (None where it has none). ``binding``: ``{state input: output
    holding its new value}`` (the update binding; in the plain form every state input has one). ``state``: the
    mutable inputs. ``host_scalars``: ``{input: spec}`` the driver computes from the step counter
    (``step_model.host_scalar_value``). ``gradients``: ``{"gradients": [...], "parameters": [...]}``, the outputs
    and ``xs`` of the Gradient nodes. ``loss``: the first scalar float output that is not state, the algorithm's
    outputs first (None if there is none). ``plain``: the bundle's form (``assemble``), whose ``hyper`` are the
    scalar input defaults taken out (the learning rate's). ``base_path``: the model file whose weights a
    checkpoint may reference (LoRA's base); ``reload()``: the stored arrays again, from where they came (for
    ``TrainingSession.reset``)."""

    light: LightModel
    model: onnx.ModelProto
    init_models: list
    binding: dict[str, str]
    state: list[str]
    host_scalars: dict[str, dict]
    gradients: dict[str, list[str]]
    loss: str | None
    index: int = 0
    target: str | None = None
    plain: bool = False
    hyper: dict = field(default_factory=dict)
    base_path: str | None = None
    reload: Callable[[], Mapping] | None = None

    def keep_outputs(self, wanted: list[str], loss: str | None = None) -> None:
        """In place: only ``wanted``, the ``loss`` and the new state stay outputs of the step model, so onnxruntime
        frees the others as soon as the step has read them (a language model's logits)."""
        state_values = set(self.binding.values())
        known = [o.name for o in self.model.graph.output if o.name not in state_values]
        unknown = [n for n in wanted if n not in known]
        if unknown:
            raise TrainingSpecError(f"outputs={unknown} are not outputs of the step; it has {known}")
        g = self.model.graph
        kept = [o for o in g.output if o.name in set(wanted) | {loss} | state_values]
        del g.output[:]
        g.output.extend(kept)


def lowered(light: LightModel, target: str | None, dims: Mapping[str, int] | None = None) -> LightModel:
    """``light`` with ``dims`` fixed, lowered for ``target`` (an inference model as placed on a device, too)."""
    if dims:
        light = light.with_proto(fix_dims(light.proto, dict(dims)))
    return lower_light(light, target=target)


def assemble(light: LightModel, target: str | None = None, index: int = 0, dims: Mapping[str, int] | None = None,
             *, plain: bool = False) -> Step:
    """The step of ``training_info[index]`` of ``light`` for ``target`` (None: onnxruntime), symbolic ``dims``
    fixed. A model with training ops left is lowered; ``plain`` (a bundle's step, written for a runtime that
    knows no initializer defaults) is lowered for its target even when it already is (a checkpoint lowered for
    onnxruntime gets tract's forms), and no input keeps an initializer default: state inputs lose theirs,
    scalar ones become ``hyper``-parameters, other ones constants, and a state tensor no binding assigns is
    passed through an Identity."""
    if dims:
        light = light.with_proto(fix_dims(light.proto, dict(dims)))
    validate_training_info(light.proto)
    gradients = gradient_names(light.proto, index)
    if plain or training_nodes_left(light.proto):
        light = lowered(light, target)
    plain_model = checked_plain(light.proto, index)  # checked once for the step and the initialization models
    model, binding, state = plain_step_parts(plain_model, index)
    host = feed_host_scalars(model)
    check_step_bindings(model, binding)
    hyper: dict = {}
    if plain:
        hyper = _plain_step(model, state)
        binding = _state_map(model, state, binding)
    tgt = get_target(target)
    fixes = step_fixes(tgt)
    if fixes:  # onnxruntime's step has none: its context (every name of the step collected) would go unused
        run_pipeline(fixes, model, LoweringContext(model, target=tgt, arrays=light.arrays))
    if host:  # as the step fixes left them (tract's counter is fed as int64)
        host = md.read_json(model, md.HOST_SCALARS, {})
    if plain:
        finalize(model)
        check_model(model)
    inits = [plain_init_model(plain_model, k) for k in range(len(plain_model.training_info))]
    loss = loss_output(model, light.proto, index, set(binding.values()))
    return Step(light, model, inits, binding, state, host, gradients, loss, index, target, plain, hyper)


def open_step(model_or_path, target: str | None = None, index: int = 0, *, weights: Mapping | None = None,
              base_path=None, dims: Mapping[str, int] | None = None, cpu: bool = True, progress: bool = False) -> Step:
    """The step ``TrainingSession`` runs: ``model_or_path`` opened (``model/carrier.open_model``: ``weights`` the
    arrays of a light model's detached tensors, ``base_path`` where its files are) and assembled for ``target``;
    on onnxruntime's CPU provider (``cpu``) a bfloat16 step computes in float32 (it has no bfloat16 arithmetic).
    Integer arithmetic on frozen weights (a quantized base's codes unpacked) is done once here, in numpy
    (``prefold.py``), not by onnxruntime's constant folding at every session it makes.
    ``progress``: loading and lowering say so on stderr when they take over a second."""
    with stage("loading the model", enabled=progress):
        light = open_model(model_or_path, weights=weights, base=base_path)
    if not len(light.proto.training_info):
        raise TrainingSpecError("the model has no training_info: there is no training step to run")
    base = os.path.abspath(base_path) if base_path is not None else (base_path_of(light.proto) or light.source)
    with stage("lowering the training step", enabled=progress):
        step = assemble(light, target, index, dims)
        if cpu and (md.read_json(step.light.proto, md.PRECISION) or {}).get("dtype") == "bf16":
            bfloat16_in_float32(step.model)
        folded = fold_weight_arithmetic(step.model, step.light.arrays, step.light.private)  # int4 codes (prefold.py)
        if folded:
            step.light = replace(step.light, arrays={**step.light.arrays, **folded})
    step.base_path = base  # a LoRA checkpoint references its frozen weights there
    step.reload = lambda: open_model(model_or_path, weights=weights, base=base_path).arrays
    return step


def loss_output(step: onnx.ModelProto, training: onnx.ModelProto, index: int, state_outputs: set[str]) -> str | None:
    """The first scalar float output of the step that is not state, the algorithm's outputs first; None if none."""
    alg_outputs = [o.name for o in training.training_info[index].algorithm.output]
    outs = {o.name: o for o in step.graph.output}
    for name in alg_outputs + list(outs):
        o = outs.get(name)
        if o is None or name in state_outputs or o.type.tensor_type.elem_type not in FLOAT_TYPES:
            continue
        dims = value_dims(o)
        if dims is not None and all(d == 1 for d in dims):
            return name
    return None


def value_dims(vi: onnx.ValueInfoProto) -> list | None:
    """The dims of a tensor's type: sizes, the names of symbolic dims (None where unnamed), or None without a shape."""
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]


def _hyper_value(t: onnx.TensorProto):
    arr = numpy_helper.to_array(t).reshape(-1)
    if arr.dtype.kind == "f":  # the shortest decimal that reads back as the same value in its own type
        return float(str(arr[0]))
    return arr[0].item()


def _plain_step(step: onnx.ModelProto, state: list[str]) -> dict:
    """In place: no initializer default on any input; state inputs lose theirs, other inputs with a scalar
    default become hyper-parameters (returned: name -> default), non-scalar ones become constants."""
    g = step.graph
    inits = {t.name: t for t in g.initializer}
    hyper = {}
    keep_inputs = []
    for i in g.input:
        t = inits.get(i.name)
        if t is None or i.name in state:
            keep_inputs.append(i)
        elif int(np.prod(t.dims)) == 1:
            hyper[i.name] = _hyper_value(t)
            keep_inputs.append(i)
    dropped = set(state) | set(hyper)
    kept_inits = [t for t in g.initializer if t.name not in dropped]
    del g.input[:]
    g.input.extend(keep_inputs)
    del g.initializer[:]
    g.initializer.extend(kept_inits)
    return hyper


def _state_map(step: onnx.ModelProto, state: list[str], binding: dict[str, str]) -> dict[str, str]:
    """``{state input: output with its new value}``; a state tensor no update_binding assigns is passed
    through an Identity (in place), so a driver carries every state input the same way."""
    types = {i.name: i for i in step.graph.input}
    out = {}
    for name in state:
        if name in binding:
            out[name] = binding[name]
            continue
        kept = f"{name}/kept"
        step.graph.node.append(helper.make_node("Identity", [name], [kept], name=f"{name}/keep"))
        vi = onnx.ValueInfoProto()
        vi.CopyFrom(types[name])
        vi.name = kept
        step.graph.output.append(vi)
        out[name] = kept
    return out


def gradients_record(step: Step) -> dict[str, str]:
    """The metadata a checkpoint of ``step`` carries so that a later session knows its gradients (the Gradient
    nodes are gone from a lowered model); empty when it has none."""
    return {md.GRADIENTS: json.dumps(step.gradients)} if step.gradients.get("gradients") else {}


__all__ = ["Step", "assemble", "open_step", "lowered", "loss_output", "value_dims", "gradients_record"]
