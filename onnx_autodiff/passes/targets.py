"""Targets: one record per runtime, read by everything that needs a fact about one.

A ``Target`` names the default-domain ops the runtime lacks (found by running our models on it,
docs/runtimes.md), the fixes its bundle step needs (passes of ``passes/step_quirks.py``, run by
``driver/bundle.py``), the module of ``onnx_autodiff.runners`` that trains a step bundle on it (``train
--runtime``), and the extra that installs it. The lowering carries the record in its context; rules ask
their builder (``g.has_op(op)``); ``passes/standard_forms.py`` rewrites what the rules did not avoid; the
CLI's ``--runtime`` and ``--target`` choices, the runners and ``check --target`` read this table.
``onnxruntime`` lacks nothing (today's fastest forms); ``portable`` lacks what any runtime here lacks.
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx

from ..errors import TargetError
from ..graph import normalize_domain, opset_map, top_graphs, walk_graph
from .standard_forms import FORM_SINCE
from .step_quirks import constant_weight_on_the_left, drop_symbolic_value_info


@dataclass(frozen=True)
class Target:
    name: str
    about: str
    lacks: frozenset = frozenset()  # default-domain op types the runtime has no kernel or converter for
    step_fixes: tuple = ()  # passes (model, ctx) -> bool a bundle's step model needs on it
    runner: str | None = None  # the module of onnx_autodiff.runners with load(path) -> run, if there is one
    extra: str | None = None  # pip install 'onnx-autodiff[extra]' installs the runtime

    def has_op(self, op_type: str) -> bool:
        return op_type not in self.lacks


_LOSSES = frozenset({"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})
RUNTIMES = {t.name: t for t in (
    Target("onnxruntime", "stock onnxruntime (Python, C/C++): every op, fastest forms", runner="ort"),
    Target("reference", "onnx.reference.ReferenceEvaluator", runner="reference"),
    # OpenVINO 2026.4: no converter for MaxUnpool or Det; Dropout converts only outside training mode
    Target("openvino", "OpenVINO (CPU plugin, f32)", frozenset({"MaxUnpool", "Dropout", "Det"}),
           (constant_weight_on_the_left,), runner="openvino", extra="openvino"),
    # tract 0.23.9: Unimplemented(...) for these
    Target("tract", "tract (sonos/tract, the Python package)", frozenset({"MaxUnpool", "Det", "Unique", "Col2Im"})
           | _LOSSES, (drop_symbolic_value_info,), runner="tract", extra="tract"),
    Target("onnxruntime-web", "onnxruntime-web (wasm) and onnxruntime-node (the JavaScript driver, web/train.js)"),
)}
TARGETS = {**RUNTIMES, "portable": Target(
    "portable", "the ops every runtime above implements", frozenset().union(*(t.lacks for t in RUNTIMES.values())),
    tuple(dict.fromkeys(f for t in RUNTIMES.values() for f in t.step_fixes)))}
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


def missing_ops(model: onnx.ModelProto, target: str | Target | None) -> list[tuple[str, str, bool]]:
    """``(op, node name, rewritten)`` for every node of every graph whose op ``target`` lacks; rewritten:
    whether lowering for the target replaces it by standard ops (then nothing is missing in the result)."""
    t = get_target(target)
    opset = opset_map(model).get("", 0)
    out = []
    for top in top_graphs(model):
        for graph in walk_graph(top):
            for n in graph.node:
                if normalize_domain(n.domain) == "" and n.op_type in t.lacks:
                    since = FORM_SINCE.get(n.op_type)
                    out.append((n.op_type, n.name, since is not None and opset >= since))
    return out


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
        lines.append(f"{t.name} lacks {op}: needed by node {names} ({what})")
    if not lines:
        lines.append(f"{t.name}: every op of the model is implemented")
    return lines, missing


__all__ = ["Target", "TARGETS", "RUNTIMES", "RUNNERS", "DEFAULT_TARGET", "get_target", "missing_ops",
           "target_report"]
