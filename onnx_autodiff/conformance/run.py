"""One subject (a rule case, a random graph or a probe) through a runtime, forward and backward, each held against
float64.

Forward: the subject's model as it is, in float32, run by the runtime; every output held against the model run in
float64 by onnxruntime (or onnx's reference evaluator where onnxruntime has no float64 kernel; a contrib op through
the case's standard form). Backward: the gradient of <outputs, v> with respect to the subject's differentiated
tensors, lowered for the runtime's target record with its step fixes (``gradcheck.runtime_model``: what a step
bundle for that runtime runs), in float32 on the runtime, held tensor by tensor against the same gradient lowered
for onnxruntime and computed in float64 (``tests/rules/test_rules.py`` holds that one against central differences).

A result is one of ``STATUSES``: ``correct``; ``wrong values`` (ran, but a tensor is off by more than
``TOLERANCE`` of its largest reference value, or has another shape); ``refused`` (converted, then failed running);
``not converted`` (the runtime would not load, convert or plan the model); ``not lowered`` (our lowering for the
target has no form for it: a training-mode Dropout that drops, for one); ``error`` (something else raised: a fault
of this harness, shown with its message). A subject without differentiated tensors has no backward (``-``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx

from ..check.gradcheck import (
    declared_shapes,
    evaluate,
    gradient_model,
    run_on,
    runtime_model,
    to_float64,
)
from ..errors import OnnxAutodiffError, RuntimeRefusedError
from ..graph import lift_initializers
from ..passes.pipeline import lower
from ..runtimes.targets import Target

CORRECT, WRONG, REFUSED, NOT_CONVERTED, NOT_LOWERED, ERROR, NONE = (
    "correct", "wrong values", "refused", "not converted", "not lowered", "error", "-")
STATUSES = (CORRECT, WRONG, REFUSED, NOT_CONVERTED, NOT_LOWERED, ERROR)
TOLERANCE = 1e-4  # max |runtime - reference| / max |reference| of a tensor: float32 against float64
ATOL = 1e-6  # and an absolute floor: float32 rounding of a value that is zero in exact arithmetic


@dataclass
class Subject:
    """A model to run through runtimes: ``ops`` the op types it holds, ``attrs`` the attributes its node sets, name
    to value as lacks entries write it (a rule case: which attribute a runtime refuses); ``expand`` the standard
    form the float64 reference runs in place of an op without a float64 kernel (a contrib op)."""

    name: str
    kind: str  # "case", "graph" or "probe"
    ops: list[str]
    model: onnx.ModelProto
    feeds: dict
    wrt: list[str]
    of: list[str]
    attrs: dict = field(default_factory=dict)
    domain: str = ""
    expand: Callable[[onnx.ModelProto], onnx.ModelProto] | None = None
    float64: bool = True
    token: str = ""  # a probe: the entry of a target's lacks it measures
    opset: int = 0
    # how far the float64 reference's standard form may be from the op itself (a case's forward_rtol / _atol: the
    # float product standing in for a dynamically quantized one differs by its rounding)
    forward_tolerance: tuple[float, float] = (0.0, 0.0)


@dataclass
class Reference:
    """What a subject computes in float64: its outputs, the cotangents v fed to its gradient and that gradient."""

    base: onnx.ModelProto  # the subject's model in float64, the differentiated initializers lifted to inputs
    feeds: dict
    outputs: dict
    vfeeds: dict
    grads: dict
    shapes: dict


@dataclass
class Result:
    subject: str
    kind: str
    ops: list[str]
    attrs: dict
    domain: str
    forward: str
    backward: str
    forward_detail: str = ""
    backward_detail: str = ""
    token: str = ""
    opset: int = 0

    def as_json(self) -> dict:
        out = {"subject": self.subject, "ops": self.ops, "forward": self.forward, "backward": self.backward}
        if self.forward_detail:
            out["forward_detail"] = self.forward_detail
        if self.backward_detail:
            out["backward_detail"] = self.backward_detail
        return out


def _expanded(model: onnx.ModelProto, subject: Subject) -> onnx.ModelProto:
    if subject.expand is None:
        return model
    out = subject.expand(model)
    return to_float64(out) if subject.float64 else out


def reference(subject: Subject, seed: int = 0) -> Reference:
    """The float64 values a runtime's results are held against (the subject's own types when it is float32-only)."""
    base = to_float64(subject.model) if subject.float64 else _copy(subject.model)
    lift_initializers(base, set(subject.wrt))
    feeds = {k: (v.astype(np.float64) if subject.float64 and v.dtype == np.float32 else v)
             for k, v in subject.feeds.items()}
    init = {t.name: t for t in base.graph.initializer}
    for w in subject.wrt:
        if w not in feeds:
            feeds[w] = onnx.numpy_helper.to_array(init[w]).copy()
    outputs, _ = evaluate(_expanded(lower(base, check=False), subject), feeds)
    rng = np.random.default_rng(seed)
    vfeeds, grads, shapes = {}, {}, {}
    if subject.wrt and subject.of:
        vs = [rng.standard_normal(np.shape(outputs[o])).astype(outputs[o].dtype) for o in subject.of]
        vfeeds = {f"gradcheck/v{k}": v for k, v in enumerate(vs)}
        shapes = declared_shapes(base, subject.of, subject.wrt, outputs, feeds)
        gm = _expanded(lower(gradient_model(base, subject.of, subject.wrt, shapes)), subject)
        out, _ = evaluate(gm, {**feeds, **vfeeds})
        grads = {w: out[f"{w}__gradcheck_grad"] for w in subject.wrt}
    return Reference(base, feeds, outputs, vfeeds, grads, shapes)


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _compare(got: dict, want: dict, names, tolerance: tuple[float, float] = (0.0, 0.0)) -> tuple[str, str]:
    """(status, detail) of the runtime's tensors ``got`` against the reference ``want``; ``tolerance``: a larger
    (rtol, atol) the reference may be off by."""
    worst, where = 0.0, ""
    for name in names:
        if name not in got:
            return WRONG, f"no output {name!r}"
        a, b = np.asarray(got[name]), np.asarray(want[name])
        if a.shape != b.shape and a.size == b.size and a.size == 1:
            a = a.reshape(b.shape)
        if a.shape != b.shape:
            return WRONG, f"{name!r} has shape {list(a.shape)}, expected {list(b.shape)}"
        if b.dtype.kind not in "fc":
            if not np.array_equal(a, b):
                return WRONG, f"{name!r} differs ({int(np.sum(a != b))} of {a.size} elements)"
            continue
        a, b = a.astype(np.float64), b.astype(np.float64)
        if not np.array_equal(np.isfinite(a), np.isfinite(b)) or not np.array_equal(a[~np.isfinite(b)],
                                                                                      b[~np.isfinite(b)]):
            return WRONG, f"{name!r} is not finite where the reference is, or the other way"
        fin = np.isfinite(b)
        if not fin.any():
            continue
        scale = float(np.max(np.abs(b[fin])))
        diff = float(np.max(np.abs(a[fin] - b[fin])))
        allowed = max(TOLERANCE * scale + ATOL, tolerance[0] * scale + tolerance[1])
        if diff > allowed and diff / max(scale, ATOL) > worst:
            worst, where = diff / max(scale, ATOL), name
    if worst:
        return WRONG, f"{where!r} off by {worst:.0e} of its largest value"
    return CORRECT, ""


def _status(e: BaseException) -> tuple[str, str]:
    if isinstance(e, RuntimeRefusedError):
        return (NOT_CONVERTED if e.stage == "convert" else REFUSED), str(e)
    if isinstance(e, OnnxAutodiffError):
        return NOT_LOWERED, " ".join(str(e).split())[:300]
    return ERROR, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _float_outputs(model: onnx.ModelProto) -> list[str]:
    return [o.name for o in model.graph.output]


def forward_on(subject: Subject, ref: Reference, target: Target, load) -> tuple[str, str]:
    try:
        model = runtime_model(subject.model, target, lowered=False)
        got = run_on(load, model, ref.feeds, "forward")
    except Exception as e:  # noqa: BLE001 - every failure is a result
        return _status(e)
    return _compare(got, ref.outputs, _float_outputs(subject.model), subject.forward_tolerance)


def backward_on(subject: Subject, ref: Reference, target: Target, load) -> tuple[str, str]:
    if not ref.grads:
        return NONE, ""
    try:
        model = runtime_model(gradient_model(ref.base, subject.of, subject.wrt, ref.shapes), target)
    except Exception as e:  # noqa: BLE001
        status, detail = _status(e)
        return (NOT_LOWERED if status == ERROR else status), detail
    try:
        out = run_on(load, model, {**ref.feeds, **ref.vfeeds}, "backward")
    except Exception as e:  # noqa: BLE001
        return _status(e)
    got = {w: out.get(f"{w}__gradcheck_grad") for w in subject.wrt if f"{w}__gradcheck_grad" in out}
    return _compare(got, ref.grads, subject.wrt)


def run_subject(subject: Subject, ref: Reference, target: Target, load) -> Result:
    fwd, fwd_detail = forward_on(subject, ref, target, load)
    bwd, bwd_detail = backward_on(subject, ref, target, load)
    return Result(subject.name, subject.kind, subject.ops, subject.attrs, subject.domain, fwd, bwd, fwd_detail,
                  bwd_detail, subject.token, subject.opset)


__all__ = ["Subject", "Reference", "Result", "STATUSES", "CORRECT", "WRONG", "REFUSED", "NOT_CONVERTED",
           "NOT_LOWERED", "ERROR", "NONE", "TOLERANCE", "ATOL", "reference", "run_subject"]
