"""A random graph (``FuzzGraph``) and its check: ``check_graph`` holds it against float64 central differences,
and says ``Uncheckable`` where only onnx's reference evaluator could run it in float64 and that evaluator is
not to be trusted with it (it fails, or computes it otherwise than onnxruntime does in float32)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..check.gradcheck import GradcheckReport, gradcheck
from ..errors import GradientRuleError, OpsetTooOldError, UnsupportedOperatorError
from ..graph import walk_graphs
from ..ort_options import session_options

D = TensorProto.DOUBLE
DECLINED = (GradientRuleError, UnsupportedOperatorError, OpsetTooOldError)  # a rule saying no, in our words


@dataclass
class FuzzGraph:
    """A random graph: the model, values for its inputs, what to differentiate and the tolerances of its cases."""

    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]
    wrt: list[str]
    of: list[str]
    rtol: float = 1e-5
    atol: float = 1e-8
    eps: float = 1e-6
    placed: list[str] = field(default_factory=list)  # the rule cases placed (names), control flow as "If[...]"
    onnxruntime_only: str = ""  # why the graph is checked on onnxruntime only (its Loops always are)

    def __str__(self) -> str:
        lines = [f"graph of {', '.join(self.placed)} at opset {self.model.opset_import[0].version}"]
        lines += [f"  {n.op_type}({', '.join(n.input)}) -> {', '.join(n.output)}"
                  + "".join(f" {a.name}={helper.get_attribute_value(a)!r}" for a in n.attribute
                            if a.type != onnx.AttributeProto.GRAPH)
                  for n in self.model.graph.node]
        return "\n".join(lines)


class Uncheckable(Exception):
    """The float64 check of a graph needs onnx's reference evaluator (onnxruntime has no float64 kernel for
    one of its ops), which cannot run the lowered graph while onnxruntime runs it in float32, or computes its
    forward or backward otherwise than onnxruntime does in float32: a limit of the reference evaluator of
    onnx 1.23 (negative Pad widths, a Scan output in reverse, a Loop's scan outputs, MaxPool's indices,
    LpNormalization with p=1), not of the gradient. A mismatch on which both runtimes agree is reported."""


def check_graph(graph: FuzzGraph, runtime: str = "auto") -> GradcheckReport:
    """gradcheck of ``graph`` with its cases' tolerances (float64, every input and weight; atol no smaller
    than what central differences resolve, ``rounding_floor``); the report, not an error, on a mismatch.
    Raises ``Uncheckable`` where the float64 check needs onnx's reference evaluator and that cannot run the
    graph or computes it otherwise than onnxruntime does in float32 (see there)."""
    why = graph.onnxruntime_only or ("onnx 1.23's reference evaluator runs no iteration of a Loop without a "
                                     "condition input and concatenates its scan outputs instead of stacking them"
                                     if has_loop(graph.model) else "")
    only = runtime == "auto" and bool(why)
    atol = max(graph.atol, rounding_floor(graph))
    try:
        report = gradcheck(graph.model, graph.feeds, wrt=graph.wrt, of=graph.of, rtol=graph.rtol, atol=atol,
                           eps=graph.eps, raise_on_failure=False, runtime="onnxruntime" if only else runtime)
    except DECLINED:
        raise
    except Exception as e:
        if runtime != "auto" or not (only or _raised_by_reference(e)) or _float32(graph) is None:
            raise
        if only:
            raise Uncheckable(f"onnxruntime cannot run the graph in float64 ({type(e).__name__}: {e}) and the "
                              f"reference evaluator cannot be trusted with it ({why}); it runs in float32") from e
        raise Uncheckable(f"onnx's reference evaluator cannot run the lowered graph ({type(e).__name__}: {e}); "
                          "onnxruntime runs it in float32") from e
    if not report.ok and runtime == "auto" and report.runtime == "onnx.reference":
        differs = _reference_differs(graph)
        if differs:
            raise Uncheckable(f"the float64 check ran on onnx's reference evaluator, which computes {differs} "
                              f"otherwise than onnxruntime in float32:\n{report}")
    return report


ROUNDING = 1.0  # the float64 rounding of sum(y * v) over eps (what was seen: a tenth of it, a normalization's too)


def rounding_floor(graph: FuzzGraph) -> float:
    """The smallest directional derivative central differences in float64 resolve for this graph:
    ``ROUNDING * eps_machine * sum|y| / eps`` (3e-7 for outputs summing to 1360). Where the exact one is 0
    (a shift a normalization takes away: InstanceNormalization of a scalar expanded and offset) the
    difference quotient is that rounding (2.7e-8 there), which gradcheck's fixed atol of 1e-8 took for a
    mismatch."""
    import onnxruntime as ort

    try:
        sess = ort.InferenceSession(graph.model.SerializeToString(), session_options(log_severity_level=4),
                                    providers=["CPUExecutionProvider"])
        ys = sess.run(list(graph.of), graph.feeds)
    except Exception:  # no float64 kernel for one of its ops
        from onnx.reference import ReferenceEvaluator

        ys = ReferenceEvaluator(graph.model).run(list(graph.of), graph.feeds)
    total = sum(float(np.sum(np.abs(y))) for y in ys)
    return ROUNDING * float(np.finfo(np.float64).eps) * total / graph.eps


def _reference_differs(graph: FuzzGraph) -> str:
    """What onnx's reference evaluator (float64) computes otherwise than onnxruntime (float32) for this graph:
    "the forward" (its outputs), "the backward" (the gradients of the report, <u, J^T v>), or ""."""
    from onnx.reference import ReferenceEvaluator

    ours = _float32(graph)
    if ours is None:
        return ""
    model32, report32, outputs32 = ours
    ref = ReferenceEvaluator(graph.model).run(list(graph.of), graph.feeds)
    if any(np.shape(a) != np.shape(b) or not np.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in zip(ref, outputs32)):
        return "the forward"
    one = gradcheck(graph.model, graph.feeds, wrt=graph.wrt, of=graph.of, directions=1, raise_on_failure=False,
                    runtime="reference")  # one direction each: the same u as the float32 report's
    for c64, c32 in zip(one.checks, report32.checks):
        if abs(c64.analytic - c32.analytic) > 1e-3 * max(1.0, abs(c64.analytic), abs(c32.analytic)):
            return f"the backward (the gradient of {c64.name!r})"
    return ""


def _float32(graph: FuzzGraph):
    """(the graph in float32, its gradcheck report on onnxruntime, its outputs there), or None where
    onnxruntime cannot run its forward or lowered backward in float32."""
    import onnxruntime as ort

    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    for g in walk_graphs(model):
        graph_to_float32(g)
    feeds = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in graph.feeds.items()}
    try:
        report = gradcheck(model, feeds, wrt=graph.wrt, of=graph.of, float64=False, directions=1,
                           raise_on_failure=False, runtime="onnxruntime")
        sess = ort.InferenceSession(model.SerializeToString(), session_options(log_severity_level=4),
                                    providers=["CPUExecutionProvider"])
        outputs = sess.run(list(graph.of), feeds)
    except Exception:
        return None
    return model, report, outputs


def has_loop(model: onnx.ModelProto) -> bool:
    return any(n.op_type == "Loop" for g in walk_graphs(model) for n in g.node)


def _raised_by_reference(e: BaseException) -> bool:
    tb = e.__traceback__
    while tb is not None:
        if "onnx/reference/" in tb.tb_frame.f_code.co_filename.replace("\\", "/"):
            return True
        tb = tb.tb_next
    return False


def graph_to_float32(g: onnx.GraphProto) -> None:
    """``g`` computing in float32 where it computed in float64 (initializers, types, Cast targets), in place."""
    def tensor(t):
        if t.data_type == D:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))

    for t in g.initializer:
        tensor(t)
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.tensor_type.elem_type == D:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                tensor(a.t)
            elif a.type == onnx.AttributeProto.INT and a.name in ("to", "dtype") and a.i == D:
                a.i = TensorProto.FLOAT


__all__ = ["FuzzGraph", "check_graph", "rounding_floor", "Uncheckable", "DECLINED", "has_loop", "graph_to_float32"]
