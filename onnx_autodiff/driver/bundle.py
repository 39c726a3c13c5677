"""The portable step bundle: one training step any ONNX runtime can run, and a driver contract any
language can follow without a protobuf reader (docs/runtimes.md).

``export_step(training_model, out_dir, target="portable")`` writes ``step.onnx`` (every input a plain
graph input with no initializer default: the batch feeds, the state, the hyper-parameters, the host
scalars; outputs: the loss and the new state), ``init.onnx`` (no inputs; its outputs are the initial state,
named like the state inputs of ``step.onnx``) and ``bundle.json`` (format ``onnx-autodiff-step/2``: the
files, the feeds with their dtype and shape, the loss, the state map ``{input: output}``, the
hyper-parameters with defaults, and the host scalars, which a driver computes from the step counter in the
state, ``{input: {"counter", "offset", "dtype", "factors"?}}``: with ``t = state[counter] + offset``, ``t`` itself
(the counter's next value) or, with ``factors``, the product over ``[beta, power]`` of ``(1 - beta^t)^power`` in
float64 (Adam's bias corrections), fed in ``dtype``; ``driver/step_model.host_scalar_value``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import BundleError
from ..graph import FLOAT_TYPES, finalize, model_shell
from ..model import metadata
from ..model.carrier import LightModel, open_model
from ..model.io import check_external_data, write_atomic
from ..model.weights import check_model, inside
from ..passes.context import LoweringContext
from ..passes.pipeline import lower_light, run_pipeline
from ..passes.static_shapes import fix_dims
from ..passes.targets import get_target
from .step_model import build_init_model, build_step_model, feed_host_scalars

FORMAT = "onnx-autodiff-step/2"  # /2 added host_scalars, which a driver must feed
READS = (FORMAT, "onnx-autodiff-step/1")  # bundles written before stay readable (no host scalars: nothing to feed)
STEP, INIT, MANIFEST = "step.onnx", "init.onnx", "bundle.json"
SINGLE_FILE_LIMIT = (1 << 31) - (1 << 26)  # past this many bytes of tensors a model keeps them in a data file


def _dims(vi: onnx.ValueInfoProto) -> list | None:
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]


def _dtype(elem_type: int) -> str:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name


def _hyper_value(t: onnx.TensorProto):
    arr = numpy_helper.to_array(t).reshape(-1)
    if arr.dtype.kind == "f":  # the shortest decimal that reads back as the same value in its own type
        return float(str(arr[0]))
    return arr[0].item()


def _loss_name(step: onnx.ModelProto, training: onnx.ModelProto, index: int, state_outputs: set[str]) -> str:
    """The first scalar float output of the algorithm that is not state (as TrainingSession picks it)."""
    alg_outputs = [o.name for o in training.training_info[index].algorithm.output]
    outs = {o.name: o for o in step.graph.output}
    for name in alg_outputs + list(outs):
        o = outs.get(name)
        if o is None or name in state_outputs or o.type.tensor_type.elem_type not in FLOAT_TYPES:
            continue
        dims = _dims(o)
        if dims is not None and all(d == 1 for d in dims):
            return name
    raise BundleError(f"the step of training_info[{index}] has no scalar float output that is not state: no loss "
                      "to report; add one to the algorithm's outputs")


def _plain_step(step: onnx.ModelProto, state: list[str]) -> tuple[onnx.ModelProto, dict]:
    """The step with no initializer default on any input: state inputs lose theirs, other inputs with a
    scalar default become hyper-parameters (default recorded), non-scalar ones become constants."""
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
    return step, hyper


def _state_map(step: onnx.ModelProto, state: list[str]) -> dict[str, str]:
    """``{state input: output with its new value}``; a state tensor no update_binding assigns is passed
    through an Identity, so a driver carries every state input the same way."""
    binding = metadata.read_json(step, metadata.UPDATE_BINDING, {})
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


def _init_model(training: onnx.ModelProto, lowered: onnx.ModelProto, step: onnx.ModelProto,
                state: list[str], index: int, arrays) -> LightModel:
    """No inputs; outputs named like the state inputs: the stored initializers, replaced by what the
    initialization graph computes for the keys its binding names."""
    stored = {t.name: t for g in [lowered.graph] + [ti.algorithm for ti in lowered.training_info]
              for t in g.initializer}
    init = build_init_model(lowered, index)
    binding = {}
    g = onnx.GraphProto()
    if init is not None:
        g.CopyFrom(init.graph)
        binding = metadata.read_json(init, metadata.INITIALIZATION_BINDING, {})
        del g.output[:]
    defined = {t.name for t in g.initializer} | {o for n in g.node for o in n.output}
    types = {i.name: i for i in step.graph.input}
    initial = {}
    for name in state:
        if name in defined:
            raise BundleError(f"the initialization graph of training_info[{index}] defines {name!r}, the name of "
                              "a state tensor: init.onnx could not output the state under its own name")
        if name in binding:
            source = binding[name]
        else:
            t = onnx.TensorProto()
            t.CopyFrom(stored[name])
            source = t.name = f"{name}/initial"
            g.initializer.append(t)
            if name in arrays:
                initial[source] = arrays[name]
        g.node.append(helper.make_node("Identity", [source], [name], name=f"{name}/init"))
        vi = onnx.ValueInfoProto()
        vi.CopyFrom(types[name])
        g.output.append(vi)
    g.name = f"{training.graph.name or 'model'}_init"
    m = model_shell(lowered)
    m.graph.CopyFrom(g)
    finalize(m)
    check_model(m)
    return LightModel(m, {**{k: v for k, v in arrays.items() if k in defined}, **initial})


def _port_order(step: onnx.ModelProto, init: onnx.ModelProto) -> dict[str, list[str]]:
    """The models' inputs and outputs in their graph order, for a driver whose runtime does not hand out the
    ONNX names (tract's API names an output by the node that computes it): it matches them by position."""
    return {"step_inputs": [i.name for i in step.graph.input], "step_outputs": [o.name for o in step.graph.output],
            "init_outputs": [o.name for o in init.graph.output]}


def build_bundle(training, target: str = "portable", index: int = 0,
                 dims: dict[str, int] | None = None) -> tuple[LightModel, LightModel, dict]:
    """``(step, init, manifest)`` of the bundle, in memory, light (``export_step`` writes them)."""
    light = open_model(training, what="training model")
    if not len(light.proto.training_info):
        raise BundleError("the model has no training_info: there is no step to export",
                          hint="add a loss and an optimizer first (make_training_model / make-training)")
    if dims:
        light = light.with_proto(fix_dims(light.proto, dims))
    lowered = lower_light(light, target=target)
    step = build_step_model(lowered.proto, index)
    host = feed_host_scalars(step)
    state = metadata.read_json(step, metadata.STEP_STATE, [])
    step, hyper = _plain_step(step, state)
    state_map = _state_map(step, state)
    tgt = get_target(target)
    run_pipeline(tgt.step_fixes, step, LoweringContext(step, target=tgt, arrays=lowered.arrays))
    host = metadata.read_json(step, metadata.HOST_SCALARS, {}) if host else host  # as the step fixes left them
    finalize(step)
    check_model(step)
    loss = _loss_name(step, lowered.proto, index, set(state_map.values()))
    feeds = [{"name": i.name, "dtype": _dtype(i.type.tensor_type.elem_type), "shape": _dims(i)}
             for i in step.graph.input if i.name not in state_map and i.name not in hyper and i.name not in host]
    init = _init_model(light.proto, lowered.proto, step, list(state_map), index, lowered.arrays)
    manifest = {"format": FORMAT, "step": STEP, "init": INIT, "feeds": feeds, "loss": loss,
                "state": state_map, "hyper": hyper, "host_scalars": host, **_port_order(step, init.proto)}
    return LightModel(step, lowered.arrays), init, manifest


def export_step(training_model_or_path, out_dir, target: str = "portable", index: int = 0,
                dims: dict[str, int] | None = None) -> Path:
    """Write the step bundle of ``training_info[index]`` for ``target`` into ``out_dir`` (created if
    needed): ``step.onnx``, ``init.onnx``, ``bundle.json``. Returns the path of ``bundle.json``. Each file
    is replaced atomically; bundle.json is written last, so it names complete models. The weights are
    streamed from where they are, never copied into a protobuf message. ``dims``: sizes for symbolic dims
    (``{"N": 32}``): the step then takes batches of that size only, and computes no shapes at run time
    (on WebGPU, no node is left to the CPU)."""
    return write_bundle(*build_bundle(training_model_or_path, target, index, dims), out_dir)


def write_bundle(step: LightModel, init: LightModel, manifest: dict, out_dir) -> Path:
    """Write a bundle ``build_bundle`` made into ``out_dir`` (created if needed); returns the path of bundle.json."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BundleError(f"cannot create the bundle directory {str(out)!r}: {e.strerror or e}",
                          hint="choose a writable OUT_DIR") from None
    step.save(out / STEP, SINGLE_FILE_LIMIT)
    init.save(out / INIT, SINGLE_FILE_LIMIT)
    write_atomic(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return out / MANIFEST


def read_manifest(bundle_dir) -> dict:
    """``bundle.json`` of a bundle directory, checked for the format this library writes."""
    path = Path(bundle_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise BundleError(f"{str(path)!r} does not exist: not a step bundle directory",
                          hint="write one with onnx-autodiff export-step TRAINING.onnx OUT_DIR") from None
    except (OSError, ValueError) as e:
        raise BundleError(f"cannot read {str(path)!r}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in READS:
        raise BundleError(f"{str(path)!r} is not a bundle of format {' or '.join(map(repr, READS))} "
                          f"(format: {manifest.get('format') if isinstance(manifest, dict) else None!r})")
    for key in ("step", "init"):  # a bundle from a stranger names files in its folder only
        if not isinstance(manifest.get(key), str):
            raise BundleError(f"{str(path)!r}: {key!r} is {manifest.get(key)!r}, not the name of a model file")
        model = inside(os.fspath(bundle_dir), manifest[key], f"{MANIFEST} {key!r}")
        if os.path.isfile(model):
            check_external_data(model)
    return manifest


__all__ = ["export_step", "build_bundle", "write_bundle", "read_manifest", "FORMAT"]
