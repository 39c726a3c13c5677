"""Where a target's onnxruntime execution provider runs the nodes of a step (``check --target webgpu``).

The bundle's step (or an inference model, lowered for the target) goes to the EP with the options the bundle's
runtimes open it with: the EP's defaults where the target computes no int64 (``Target.int64`` False: onnxruntime-web
cannot pass the WebGPU EP's ``enableInt64``, and a plain plugin session does not), and onnxruntime itself says where
each node goes (``Device.placement``). Where the EP is not installed, or finds no device, the list is predicted from
what the record says: onnxruntime keeps ``Shape`` and ``Size`` on the CPU for a GPU EP, and without int64 kernels
the int64 arithmetic computed from them stays there too (its graph optimizations may move a few more).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import onnx

from ..driver.bundle import build_bundle
from ..driver.devices import resolve_device
from ..errors import DeviceError, MissingRuntimeError
from ..graph import attr_value
from ..model.carrier import open_model
from ..passes.pipeline import lower_light
from ..passes.static_shapes import fix_dims
from .targets import Target, get_target

SHAPE_OPS = ("Shape", "Size")  # onnxruntime computes these on the CPU for every GPU execution provider
INT64_OPTION = "enableInt64"  # the WebGPU EP's option for int64 kernels (TrainingSession sets it)
_INT_KEEPING = {"Gather", "Slice", "Concat", "Squeeze", "Unsqueeze", "Add", "Sub", "Mul", "Div", "Reshape", "Identity",
                "ReduceProd", "Neg", "Abs", "Max", "Min"}  # an int64 input gives an int64 output
_SHAPE_INPUTS = {"Reshape": 1, "Expand": 1, "Tile": 1, "ConstantOfShape": 0, "Slice": 1, "Range": 0}


@dataclass
class Placement:
    nodes: list[tuple[str, str]]  # (op, node name) onnxruntime runs on the CPU
    asked: bool  # the EP said so (else predicted from the record)
    why_not_asked: str = ""
    with_int64: list[tuple[str, str]] | None = None  # the same with enableInt64=1, where that changes it
    symbolic: list[str] = field(default_factory=list)  # the symbolic dims of the inputs
    made: set[str] = field(default_factory=set)  # node names onnxruntime made (not nodes of the step)
    what: str = "the step"  # or "the model" (an inference model)


def _step(model, target: Target, dims) -> onnx.ModelProto:
    """The model the target's runtime runs: the bundle's step of a training model, or the lowered inference model."""
    light = open_model(model)
    if len(light.proto.training_info):
        return build_bundle(light, target.name, dims=dims)[0].whole()
    return lower_light(light.with_proto(fix_dims(light.proto, dims)) if dims else light, target=target.name).whole()


def cpu_placement(model, target: str | Target, dims: dict[str, int] | None = None) -> Placement:
    """Which nodes of ``model``'s step (or of the model) onnxruntime runs on the CPU instead of ``target``'s
    execution provider: asked of the EP where it is here, else predicted (module docstring)."""
    t = get_target(target)
    if t.ep is None:
        raise DeviceError(f"target {t.name!r} is no onnxruntime execution provider: nothing to place")
    light = open_model(model)
    what = "the step" if len(light.proto.training_info) else "the model"
    proto = _step(light, t, dims)
    symbolic = sorted({d.dim_param for i in proto.graph.input for d in i.type.tensor_type.shape.dim if d.dim_param})
    names = {n.name for n in proto.graph.node}
    try:
        device = resolve_device([t.ep])
    except (MissingRuntimeError, DeviceError) as e:
        return Placement(predicted_cpu_nodes(proto, t), False, " ".join(str(e).split()), symbolic=symbolic, what=what)
    data = proto.SerializeToString()
    with_int64 = _on_cpu(device, data)
    if t.int64:
        return Placement(with_int64, True, symbolic=symbolic, made={n for _, n in with_int64} - names, what=what)
    plain = _on_cpu(dataclasses.replace(device, ep_options={k: v for k, v in device.ep_options.items()
                                                            if k != INT64_OPTION}), data)
    made = {n for _, n in plain + with_int64} - names
    return Placement(plain, True, with_int64=with_int64 if with_int64 != plain else None, symbolic=symbolic, made=made,
                     what=what)


def _on_cpu(device, data: bytes) -> list[tuple[str, str]]:
    return [(op, name) for ep, op, name in device.placement(data) if ep == "CPUExecutionProvider"]


def predicted_cpu_nodes(model: onnx.ModelProto, target: Target) -> list[tuple[str, str]]:
    """The record's prediction: the shape ops, and (without int64 kernels) the nodes that compute on their int64
    results as data (not as the shape input of a Reshape, Expand, ...), and on those nodes' int64 results."""
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*model.graph.input, *model.graph.value_info]}
    on_cpu = [n for n in model.graph.node if n.op_type in SHAPE_OPS]
    int64 = {n.output[0] for n in on_cpu}
    if target.int64:
        return [(n.op_type, n.name) for n in on_cpu]
    for n in model.graph.node:
        if n.op_type in SHAPE_OPS or not any(x in int64 and _SHAPE_INPUTS.get(n.op_type) != k
                                             for k, x in enumerate(n.input)):
            continue
        on_cpu.append(n)
        to = attr_value(n, "to") if n.op_type == "Cast" else None
        int64 |= {o for o in n.output if types.get(o) == onnx.TensorProto.INT64 or to == onnx.TensorProto.INT64
                  or (n.op_type in _INT_KEEPING and to is None)}
    return [(n.op_type, n.name) for n in on_cpu]


def placement_lines(model, target: str, dims: dict[str, int] | None = None) -> list[str]:
    """What ``check --target`` says of the placement: the nodes on the CPU, how that is known, and the fix."""
    p = cpu_placement(model, target, dims)
    how = (f"asked of its {target} execution provider" + (" with its default options, as onnxruntime-web runs the "
                                                          "bundle" if not get_target(target).int64 else "")
           if p.asked else f"predicted from the {target} record, as {p.why_not_asked}; where it is there, check asks "
                           "onnxruntime itself")
    if not p.nodes:
        return [f"{target}: onnxruntime runs every node of {p.what} on its {target} execution provider ({how})"]
    lines = [f"{target}: onnxruntime runs {len(p.nodes)} node(s) of {p.what} on the CPU "
             f"(session.disable_cpu_ep_fallback would refuse it; {how}):"]
    lines += [f"  {op} {name!r}" + (" (made by onnxruntime's graph optimizations)" if name in p.made else "")
              for op, name in p.nodes]
    if p.with_int64 is not None:
        kept = ", ".join(f"{op} {name!r}" for op, name in p.with_int64) or "none"
        lines.append(f"  with the plugin's {INT64_OPTION}=1 (TrainingSession, train --runtime {target}): {kept}")
    if p.symbolic and any(op in SHAPE_OPS for op, _ in p.nodes):
        dims_text = " ".join(f"--dim {d}=SIZE" for d in p.symbolic)
        lines.append(f"  (shape arithmetic of the symbolic dim(s) {', '.join(p.symbolic)}: export-step --target "
                     f"{target} {dims_text} (the batch size you train with) makes them static, and the step computes "
                     f"no shapes; check --target {target} {dims_text} shows it)")
    return lines


__all__ = ["Placement", "cpu_placement", "predicted_cpu_nodes", "placement_lines"]
