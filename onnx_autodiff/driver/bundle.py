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
from onnx import helper

from ..errors import BundleError
from ..graph import finalize, model_shell
from ..model import metadata
from ..model.carrier import LightModel, open_model
from ..model.io import check_external_data, write_atomic
from ..model.weights import check_model, inside
from .kv_cache import made_inputs
from .step import Step, assemble, value_dims

FORMAT = "onnx-autodiff-step/2"  # /2 added host_scalars, which a driver must feed
READS = (FORMAT, "onnx-autodiff-step/1")  # bundles written before stay readable (no host scalars: nothing to feed)
STEP, INIT, MANIFEST = "step.onnx", "init.onnx", "bundle.json"
SINGLE_FILE_LIMIT = (1 << 31) - (1 << 26)  # past this many bytes of tensors a model keeps them in a data file


def _dtype(elem_type: int) -> str:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name


def _init_model(step: Step) -> LightModel:
    """No inputs; outputs named like the state inputs: the stored initializers, replaced by what the
    initialization graph computes for the keys its binding names."""
    lowered, index, arrays, state = step.light.proto, step.index, step.light.arrays, list(step.binding)
    stored = {t.name: t for g in [lowered.graph] + [ti.algorithm for ti in lowered.training_info]
              for t in g.initializer}
    init = step.init_models[index]
    binding = {}
    g = onnx.GraphProto()
    if init is not None:
        g.CopyFrom(init.graph)
        binding = metadata.read_json(init, metadata.INITIALIZATION_BINDING, {})
        del g.output[:]
    defined = {t.name for t in g.initializer} | {o for n in g.node for o in n.output}
    types = {i.name: i for i in step.model.graph.input}
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
    g.name = f"{lowered.graph.name or 'model'}_init"
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


def bundle_step(training, target: str = "portable", index: int = 0, dims: dict[str, int] | None = None) -> Step:
    """The plain ``Step`` of a bundle of ``training`` for ``target`` (``step.assemble``), refused with our error
    where it has no step or no loss to report."""
    light = open_model(training, what="training model")
    if not len(light.proto.training_info):
        raise BundleError("the model has no training_info: there is no step to export",
                          hint="add a loss and an optimizer first (make_training_model / make-training)")
    step = assemble(light, target, index, dims, plain=True)
    if step.loss is None:
        raise BundleError(f"the step of training_info[{index}] has no scalar float output that is not state: no "
                          "loss to report; add one to the algorithm's outputs")
    return step


def bundle_parts(step: Step) -> tuple[LightModel, LightModel, dict]:
    """``(step, init, manifest)`` of the bundle of a plain ``Step``, in memory, light."""
    model, state_map = step.model, step.binding
    feeds = [{"name": i.name, "dtype": _dtype(i.type.tensor_type.elem_type), "shape": value_dims(i)}
             for i in model.graph.input
             if i.name not in state_map and i.name not in step.hyper and i.name not in step.host_scalars]
    init = _init_model(step)
    manifest = {"format": FORMAT, "step": STEP, "init": INIT, "feeds": feeds, "loss": step.loss,
                "state": state_map, "hyper": step.hyper, "host_scalars": step.host_scalars,
                **_port_order(model, init.proto)}
    made = made_inputs(step.light.proto, [f["name"] for f in feeds])
    if made.names:  # a decoder's empty KV cache, positions and cache switches, for a loop with bundle.json alone
        manifest["made"] = made.spec()
    return LightModel(model, step.light.arrays), init, manifest


def build_bundle(training, target: str = "portable", index: int = 0,
                 dims: dict[str, int] | None = None) -> tuple[LightModel, LightModel, dict]:
    """``(step, init, manifest)`` of the bundle, in memory, light (``export_step`` writes them)."""
    return bundle_parts(bundle_step(training, target, index, dims))


def export_step(training_model_or_path, out_dir, target: str = "portable", index: int = 0,
                dims: dict[str, int] | None = None) -> Path:
    """Write the step bundle of ``training_info[index]`` for ``target`` into ``out_dir`` (created if
    needed): ``step.onnx``, ``init.onnx``, ``bundle.json``. Returns the path of ``bundle.json``. Each file
    is replaced atomically; bundle.json is written last, so it names complete models. The weights are
    streamed from where they are, never copied into a protobuf message. ``dims``: sizes for symbolic dims
    (``{"N": 32}``): the step then takes batches of that size only, and computes no shapes at run time
    (on WebGPU, no node is left to the CPU)."""
    return write_bundle(bundle_step(training_model_or_path, target, index, dims), out_dir)


def write_bundle(step: Step | LightModel, *rest) -> Path:
    """Write the bundle of a plain ``Step`` (``bundle_step``) into ``out_dir`` (created if needed):
    ``write_bundle(step, out_dir)``; returns the path of bundle.json. ``write_bundle(step, init, manifest,
    out_dir)`` writes the parts ``build_bundle`` made."""
    step, init, manifest = bundle_parts(step) if isinstance(step, Step) else (step, *rest[:2])
    out = Path(rest[-1])
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


__all__ = ["export_step", "bundle_step", "bundle_parts", "build_bundle", "write_bundle", "read_manifest", "FORMAT"]
