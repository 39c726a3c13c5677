"""Targets: the ops a runtime lacks, so lowering emits forms that runtime has.

``TARGETS`` maps a target name to the default-domain ops that runtime lacks, found by running our models
on it (docs/runtimes.md). ``onnxruntime`` lacks nothing (today's fastest forms); ``portable`` lacks what
any runtime we test lacks. Lowering carries the target in its context (``LoweringContext.target``); rules
ask their builder (``g.has_op(op)``); ``passes/targets.py`` rewrites what the rules did not avoid.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import TargetError


@dataclass(frozen=True)
class Target:
    name: str
    lacks: frozenset  # default-domain op types the runtime has no kernel or converter for
    about: str
    quirks: frozenset = frozenset()  # fixes a step model needs there (passes/step_quirks.py)

    def has_op(self, op_type: str) -> bool:
        return op_type not in self.lacks


_LOSSES = frozenset({"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})
_RUNTIMES = {
    "onnxruntime": Target("onnxruntime", frozenset(), "stock onnxruntime (Python, C/C++): every op, fastest forms"),
    "reference": Target("reference", frozenset(), "onnx.reference.ReferenceEvaluator"),
    # OpenVINO 2026.4: no converter for MaxUnpool or Det; Dropout converts only outside training mode
    "openvino": Target("openvino", frozenset({"MaxUnpool", "Dropout", "Det"}), "OpenVINO (CPU plugin, f32)",
                       frozenset({"transposed-shared-weight"})),
    # tract 0.23.9: Unimplemented(...) for these
    "tract": Target("tract", frozenset({"MaxUnpool", "Det", "Unique", "Col2Im"}) | _LOSSES,
                    "tract (sonos/tract, the Python package)", frozenset({"symbolic-value-info"})),
    "onnxruntime-web": Target("onnxruntime-web", frozenset(), "onnxruntime-web (wasm) and onnxruntime-node"),
}
TARGETS = dict(_RUNTIMES)
TARGETS["portable"] = Target("portable", frozenset().union(*(t.lacks for t in _RUNTIMES.values())),
                             "the ops every runtime above implements",
                             frozenset().union(*(t.quirks for t in _RUNTIMES.values())))
DEFAULT_TARGET = "onnxruntime"


def get_target(name: str | Target | None) -> Target:
    if isinstance(name, Target):
        return name
    if name is None:
        return TARGETS[DEFAULT_TARGET]
    if name not in TARGETS:
        raise TargetError(f"unknown target {name!r}; choose one of {', '.join(sorted(TARGETS))}")
    return TARGETS[name]


__all__ = ["TARGETS", "Target", "get_target", "DEFAULT_TARGET"]
