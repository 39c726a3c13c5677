"""Targets: one record per runtime, read by everything that needs a fact about one.

A ``Target`` names the default-domain ops the runtime lacks (generated: the ``lacks`` of its conformance table,
``onnx_autodiff/data/conformance/<table>.json``, which ``onnx-autodiff conformance --runtime R --write`` measures;
docs/runtimes.md), the fixes its bundle step needs (passes of ``passes/step_quirks.py``, run by
``driver/bundle.py``), the module of ``onnx_autodiff.runners`` that trains a step bundle on it (``train
--runtime``), and the extra that installs it. The lowering carries the record in its context; rules ask
their builder (``g.has_op(op)``); ``passes/standard_forms.py`` rewrites what the rules did not avoid; the
CLI's ``--runtime`` and ``--target`` choices, the runners and ``check --target`` read this table.
``onnxruntime`` (today's fastest forms) lacks only what its table found (``LSTM[layout=1]``: its CPU LSTM is
sequence-first only); ``portable`` lacks what any runtime here lacks. A record is extensible: a field added later
(a WebGPU record's, say) needs a default, as ``table`` has. An entry ``Op[Output]`` of ``lacks`` names an output the
runtime does not compute (WebGPU's ``MaxPool[Indices]``: it runs MaxPool, without that output); ``int64``, whether
it computes on int64 tensors; ``ep``, the onnxruntime execution provider that is the runtime, where
``TrainingSession`` itself trains on it (state on the device, ``driver/devices.py``) and ``check --target`` asks it
where each node runs. The ``webgpu`` record's lacks are written by hand (no conformance table: its runner needs a
GPU or the plugin's software adapter).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import onnx

from ..errors import TargetError
from ..graph import normalize_domain, opset_map, top_graphs, walk_graph
from .standard_forms import FORM_SINCE, float32_text
from .step_quirks import (
    constant_weight_on_the_left,
    counter_fed_as_int64,
    drop_symbolic_value_info,
    fold_static_shape_arithmetic,
)

TABLES = Path(__file__).resolve().parents[1] / "data" / "conformance"  # the checked-in conformance tables
RUN_TIME_AXES = "axes of run-time length"  # the feature of a Reduce/Squeeze/Unsqueeze whose axes come from NonZero
_AXES_OPS = {"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
             "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "Squeeze", "Unsqueeze"}
_LENGTH_KEEPING = {"Reshape", "Flatten", "Cast", "Squeeze", "Unsqueeze", "Identity", "Concat", "Add", "Sub", "Mul",
                   "Where", "Neg"}


@dataclass(frozen=True)
class Target:
    name: str
    about: str
    # what the runtime refuses: an op type ("Det"), an op with an attribute set
    # ("NegativeLogLikelihoodLoss[ignore_index]") or an op with a feature (f"ReduceSum[{RUN_TIME_AXES}]")
    lacks: frozenset = frozenset()
    step_fixes: tuple = ()  # passes (model, ctx) -> bool a bundle's step model needs on it
    runner: str | None = None  # the module of onnx_autodiff.runners with load(path) -> run, if there is one
    extra: str | None = None  # pip install 'onnx-autodiff[extra]' installs the runtime
    ep: str | None = None  # the onnxruntime execution provider TrainingSession trains on for this runtime
    int64: bool = True  # computes on int64 tensors (compares, reshapes of them); False: their nodes go to the CPU
    table: str | None = None  # the conformance table its lacks come from (TABLES / f"{table}.json")

    def has_op(self, op_type: str) -> bool:
        """Whether the runtime runs ``op_type`` (with any attribute: see ``lacked`` for a node)."""
        return op_type not in self.lacks

    def has_output(self, op_type: str, index: int) -> bool:
        """Whether the runtime computes output ``index`` of default-domain ``op_type`` (and has the op): no
        ``Op[Output]`` entry in ``lacks`` names it (by the name onnx's schema gives it)."""
        if not self.has_op(op_type):
            return False
        outputs = onnx.defs.get_schema(op_type).outputs
        return index >= len(outputs) or f"{op_type}[{outputs[index].name}]" not in self.lacks

    def lacked(self, node: onnx.NodeProto, run_time_length: set | frozenset = frozenset(),
               opset: int | None = None) -> str | None:
        """The entry of ``lacks`` that ``node`` meets (``meets``); None when the runtime takes it."""
        return meets(self.lacks, node, run_time_length, opset)


def attribute_text(value) -> str | None:
    """An attribute value as lacks entries write it (``LSTM[layout=1]``): ints, floats, strings and lists of them;
    None for a value no entry names (a tensor, a graph)."""
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if isinstance(value, bool | int | float | str):
        return json.dumps(value) if isinstance(value, str) and not value.isidentifier() else str(value)
    if isinstance(value, list | tuple) and all(isinstance(v, int | float) for v in value):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return None


def meets(entries, node: onnx.NodeProto, run_time_length: set | frozenset = frozenset(),
          opset: int | None = None) -> str | None:
    """The first of ``entries`` (a target's ``lacks``, or a table's failing ops) that a default-domain ``node``
    meets: ``Op``; ``Op[attribute]``, the node sets it; ``Op[attribute=value]``, to that value; ``Op[Output]``, it
    writes that output (by its schema's name); ``Op[opset<K]``, the model's opset is below K; ``Op[axes of run-time
    length]``, its axes input is in ``run_time_length``."""
    if normalize_domain(node.domain) != "":
        return None
    op = node.op_type
    if op in entries:
        return op
    for k, name in enumerate(_output_names(op)):
        if k < len(node.output) and node.output[k] and f"{op}[{name}]" in entries:
            return f"{op}[{name}]"
    for a in node.attribute:
        if f"{op}[{a.name}]" in entries:
            return f"{op}[{a.name}]"
        text = attribute_text(onnx.helper.get_attribute_value(a))
        if text is not None and f"{op}[{a.name}={text}]" in entries:
            return f"{op}[{a.name}={text}]"
    for entry in entries:
        name, _, cond = entry.partition("[")
        if name != op or not cond.startswith("opset<"):
            continue
        if opset is not None and opset < int(cond[len("opset<"):-1]):
            return entry
    if (op in _AXES_OPS and len(node.input) > 1 and node.input[1] in run_time_length
            and f"{op}[{RUN_TIME_AXES}]" in entries):
        return f"{op}[{RUN_TIME_AXES}]"
    return None


def _output_names(op: str) -> list[str]:
    try:
        return [o.name for o in onnx.defs.get_schema(op).outputs]
    except onnx.defs.SchemaError:
        return []


def table_of(name: str) -> dict | None:
    """The checked-in conformance table of a runtime (None if there is none)."""
    path = TABLES / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def measured(name: str) -> frozenset:
    """The ``lacks`` of a runtime's conformance table."""
    table = table_of(name)
    return frozenset(table["lacks"]) if table else frozenset()


# What a runtime computes wrong where its conformance table cannot see it, beside what the table measured.
# OpenVINO: it shifts the uint8 codes of a constant weight that feeds a product in float and rounds (207 >> 4 gave
# 13; the same BitShift on a fed tensor gives 12), so the MatMulNBits gradient unpacks its codes in float there.
HAND_WRITTEN = {"openvino": frozenset({"BitShift"})}

RUNTIMES = {t.name: t for t in (
    Target("onnxruntime", "stock onnxruntime (Python, C/C++): every op, fastest forms", measured("onnxruntime"),
           runner="ort", table="onnxruntime"),
    Target("reference", "onnx.reference.ReferenceEvaluator", measured("reference"), runner="reference",
           table="reference"),
    Target("openvino", "OpenVINO (CPU plugin, f32)", measured("openvino") | HAND_WRITTEN["openvino"],
           (constant_weight_on_the_left,), runner="openvino", extra="openvino", table="openvino"),
    Target("tract", "tract (sonos/tract, the Python package)", measured("tract"),
           (drop_symbolic_value_info, counter_fed_as_int64),
           runner="tract", extra="tract", table="tract"),
    Target("onnxruntime-node", "onnxruntime-node (Node.js; the JavaScript driver web/train.js)",
           measured("onnxruntime-node"), runner="node", table="onnxruntime-node"),
    Target("onnxruntime-web", "onnxruntime-web (wasm; the JavaScript driver web/train.js in a page)"),
    # onnxruntime's WebGPU EP (the onnxruntime-ep-webgpu 0.4.0 plugin; onnxruntime-web 1.30's webgpu): no
    # LogSoftmax, Sum, Dropout, ConstantOfShape or loss kernels (their nodes fall back to the CPU), MaxPool
    # without Indices; onnxruntime-web has no int64 kernels at all (the plugin's enableInt64 is not passed on by
    # its JavaScript API): class labels are one-hot by a Gather of an identity matrix, not compared
    # ("not supported yet", at run time); the shape arithmetic of static shapes folded, so that no small
    # integer node falls back to the CPU either
    Target("webgpu", "onnxruntime's WebGPU execution provider (the onnxruntime-ep-webgpu plugin; onnxruntime-web's "
           "webgpu)", frozenset({"LogSoftmax", "Sum", "Dropout", "ConstantOfShape", "MaxPool[Indices]",
                                 "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"}),
           (fold_static_shape_arithmetic,), runner="webgpu", extra="webgpu", ep="WebGpuExecutionProvider", int64=False),
)}
TARGETS = {**RUNTIMES, "portable": Target(
    "portable", "the ops every runtime above implements", frozenset().union(*(t.lacks for t in RUNTIMES.values())),
    tuple(dict.fromkeys(f for t in RUNTIMES.values() for f in t.step_fixes)),
    int64=all(t.int64 for t in RUNTIMES.values()))}
DEFAULT_TARGET = "onnxruntime"
RUNNERS = [name for name, t in RUNTIMES.items() if t.runner]  # train --runtime's choices


def get_target(name: str | Target | None) -> Target:
    if isinstance(name, Target):
        return name
    if name is None:
        return TARGETS[DEFAULT_TARGET]
    if name not in TARGETS:
        raise TargetError(f"unknown target {name!r}; choose one of {', '.join(sorted(TARGETS))}")
    return TARGETS[name]


def run_time_length(graph: onnx.GraphProto) -> set[str]:
    """The tensors of ``graph`` whose length is known only at run time: NonZero's and Unique's outputs and what
    reshapes, casts or joins them."""
    out: set[str] = set()
    for n in graph.node:
        if n.op_type in ("NonZero", "Unique", "Compress") or (
                n.op_type in _LENGTH_KEEPING and any(i in out for i in n.input)):
            out.update(o for o in n.output if o)
    return out


def missing_ops(model: onnx.ModelProto, target: str | Target | None) -> list[tuple[str, str, bool]]:
    """``(what, node name, rewritten)`` for every node of every graph that ``target`` lacks (``what``: the entry of
    its ``lacks``); rewritten: whether lowering for the target replaces it by standard ops (then nothing is
    missing in the result)."""
    t = get_target(target)
    opset = opset_map(model).get("", 0)
    out = []
    for top in top_graphs(model):
        for graph in walk_graph(top):
            dynamic = run_time_length(graph)
            for n in graph.node:
                what = t.lacked(n, dynamic, opset)
                if what is not None:
                    since = FORM_SINCE.get(n.op_type) if what.partition("[")[2] != f"{RUN_TIME_AXES}]" else None
                    formed = since is not None and opset >= since and dropout_ratio(graph, n) is None
                    out.append((what, n.name, formed))
    return out


def dropout_ratio(graph: onnx.GraphProto, node: onnx.NodeProto) -> str | None:
    """The ratio of a Dropout that drops (training mode, ratio not 0), as written; "not a constant" when its ratio
    or mode is computed; None for a node that passes its input through (Identity is its standard form) or another
    op. A dropping Dropout has no standard form: its random mask is the runtime's."""
    if node.op_type != "Dropout":
        return None
    consts = {t.name: t for t in graph.initializer}
    consts.update({n.output[0]: n.attribute[0].t for n in graph.node if n.op_type == "Constant"
                   and n.attribute and n.attribute[0].name == "value"})

    def value(i: int, default: float):
        if len(node.input) <= i or not node.input[i]:
            return default
        t = consts.get(node.input[i])
        return None if t is None or t.data_location == onnx.TensorProto.EXTERNAL else onnx.numpy_helper.to_array(t)

    ratio, training = value(1, 0.5), value(2, False)
    if ratio is None or training is None:
        return "not a constant"
    return float32_text(ratio) if bool(training) and float(ratio) != 0.0 else None


def _ratios(model: onnx.ModelProto, names: set[str]) -> str:
    found = {dropout_ratio(g, n) for top in top_graphs(model) for g in walk_graph(top) for n in g.node
             if n.name in names} - {None}
    return ", ".join(sorted(found))


def target_report(model: onnx.ModelProto, target: str) -> tuple[list[str], bool]:
    """One line per op ``target`` lacks that the model uses (the nodes that need it, and whether lowering
    for the target writes it in standard ops); whether any of them has no standard form."""
    t = get_target(target)
    by_op: dict[str, list] = {}
    for op, node, rewritten in missing_ops(model, t):
        by_op.setdefault(op, []).append((node, rewritten))
    lines, missing = [], False
    for op, nodes in by_op.items():
        names = ", ".join(repr(n) for n, _ in nodes[:5]) + (f" and {len(nodes) - 5} more" if len(nodes) > 5 else "")
        fixed = all(r for _, r in nodes)
        missing |= not fixed
        what = "lowered to standard ops for this target" if fixed else "MISSING: no standard form"
        if op == "Dropout" and not fixed:
            what += f" for a training-mode Dropout (ratio {_ratios(model, {n for n, _ in nodes})}): its random mask " \
                    "is the runtime's own"
        lines.append(f"{t.name} lacks {op}: needed by node {names} ({what})")
    if not lines:
        lines.append(f"{t.name} lacks none of the model's ops")
    return lines, missing


__all__ = ["Target", "TARGETS", "RUNTIMES", "RUNNERS", "DEFAULT_TARGET", "TABLES", "HAND_WRITTEN", "RUN_TIME_AXES",
           "get_target",
           "missing_ops", "target_report", "table_of", "measured", "run_time_length", "meets", "attribute_text"]
