"""Targets: one record per runtime, read by everything that needs a fact about one.

A ``Target`` names the default-domain ops the runtime lacks (generated: the ``lacks`` of its conformance table,
``onnx_autodiff/data/conformance/<table>.json``, which ``onnx-autodiff conformance --runtime R --write`` measures;
docs/runtimes.md), the fixes its bundle step needs (named: passes of ``passes/step_quirks.py``, run by
``driver/step.py``), the module of ``onnx_autodiff.runtimes`` that trains a step bundle on it (``train
--runtime``), and the extra that installs it. The lowering carries the record in its context; rules ask
their builder (``g.has_op(op)``); ``passes/standard_forms.py`` rewrites what the rules did not avoid; the
CLI's ``--runtime`` and ``--target`` choices, the runners (beside this module), ``gradcheck(runtime=...)``,
``conformance`` and ``check --target`` (``check.py``: ``missing_ops``, ``target_report``) read this table. It
imports no pass: the lowering reads it, so it names its step fixes and its runner module rather than importing them.
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
from ..graph import normalize_domain

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
    # the names of the passes (model, ctx) -> bool a bundle's step model needs on it (``passes/step_quirks.py``
    # ``STEP_FIXES``; ``step_fixes(target)`` there gives the passes)
    step_fixes: tuple = ()
    runner: str | None = None  # the module of onnx_autodiff.runtimes with load(path) -> run, if there is one
    extra: str | None = None  # pip install 'onnx-autodiff[extra]' installs the runtime
    ep: str | None = None  # the onnxruntime execution provider TrainingSession trains on for this runtime
    int64: bool = True  # computes on int64 tensors (compares, reshapes of them); False: their nodes go to the CPU
    table: str | None = None  # the conformance table its lacks come from (TABLES / f"{table}.json")
    # its runner module also has load_float64(model, providers) -> .run(names, feeds): gradcheck runs the whole
    # check there in float64, in memory (the others run the backward from a file, in float32)
    float64: bool = False
    session: bool = False  # trains through onnxruntime's TrainingSession (as does a record with ``ep``), no bundle
    # the op domains besides the default one that the runtime has no kernel for at all (a node of one is lacked as
    # "domain.Op"); OpenVINO converts some com.microsoft ops and not others, so its probe run decides there
    foreign: frozenset = frozenset()

    @property
    def in_session(self) -> bool:
        """``train --runtime`` trains through ``TrainingSession`` (on ``ep`` if set), not a step bundle's runner."""
        return self.session or self.ep is not None

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
        """The entry of ``lacks`` that ``node`` meets (``meets``), or ``domain.Op`` for a node of a domain the
        runtime has no kernels for (``foreign``); None when the runtime takes it."""
        if normalize_domain(node.domain) in self.foreign:
            return f"{node.domain}.{node.op_type}"
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
CONTRIB = frozenset({"com.microsoft"})  # onnxruntime's contrib ops (GroupQueryAttention, MatMulNBits, ...)

RUNTIMES = {t.name: t for t in (
    Target("onnxruntime", "stock onnxruntime (Python, C/C++): every op, fastest forms", measured("onnxruntime"),
           runner="ort", table="onnxruntime", float64=True, session=True),
    Target("reference", "onnx.reference.ReferenceEvaluator", measured("reference"), runner="reference",
           table="reference", float64=True, foreign=CONTRIB),
    Target("openvino", "OpenVINO (CPU plugin, f32)", measured("openvino") | HAND_WRITTEN["openvino"],
           ("constant_weight_on_the_left",), runner="openvino", extra="openvino", table="openvino"),
    Target("tract", "tract (sonos/tract, the Python package)", measured("tract"),
           ("drop_symbolic_value_info", "counter_fed_as_int64"),
           runner="tract", extra="tract", table="tract", foreign=CONTRIB),
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
           ("fold_static_shape_arithmetic",), runner="webgpu", extra="webgpu", ep="WebGpuExecutionProvider",
           int64=False),
)}
# gradcheck's runtimes that run the whole check in float64: "auto" (onnxruntime, else onnx.reference) and each
# record with ``float64``
FLOAT64_RUNTIMES = ("auto", *(n for n, t in RUNTIMES.items() if t.float64))

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


__all__ = ["Target", "FLOAT64_RUNTIMES", "TARGETS", "RUNTIMES", "RUNNERS", "DEFAULT_TARGET", "TABLES", "HAND_WRITTEN",
           "RUN_TIME_AXES", "get_target", "table_of", "measured", "run_time_length", "meets", "attribute_text"]
