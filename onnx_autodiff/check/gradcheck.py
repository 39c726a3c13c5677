"""Gradient checking: lowered gradients against central finite differences.

The check is the dot-product test <J u, v> = <u, J^T v> for random directions u (inputs) and v
(outputs): one backward run gives J^T v, two forward runs per direction give J u. Both run in float64 on
onnxruntime (or onnx's reference evaluator); on another runtime (OpenVINO, tract, onnxruntime-node, ...) the
backward, lowered for that runtime's target record and step fixes as a bundle would be, runs there in float32,
and is held against the float64 central differences. ``jvp_check`` holds the forward mode against the reverse
mode the same way, with J u from the ``jvp`` model: no finite differences, so the two sides agree to rounding.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import GradcheckError
from ..forward.jvp import jvp
from ..graph import FLOAT_TYPES, finalize, float_parameters, infer_tensor_info, lift_initializers, walk_graphs
from ..model.carrier import open_model
from ..passes.context import LoweringContext
from ..passes.pipeline import lower, run_pipeline
from ..passes.step_quirks import step_fixes
from ..runtimes.loop import load_float64, load_runner
from ..runtimes.targets import FLOAT64_RUNTIMES, RUNTIMES, Target
from .llm_files import check_feeds

_V = "gradcheck/v"
_S = "gradcheck/s"

_PROMOTED = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}
_F32 = TensorProto.FLOAT
_F64 = TensorProto.DOUBLE
_DTYPE_ATTRS = {"to", "dtype", "output_dtype"}


def _convert_tensor(t: onnx.TensorProto, src: set, dst: int) -> None:
    if t.data_type in src:
        arr = numpy_helper.to_array(t).astype(helper.tensor_dtype_to_np_dtype(dst))
        t.CopyFrom(numpy_helper.from_array(arr, t.name))


def _convert_graph(g: onnx.GraphProto, src: set, dst: int) -> None:
    for t in g.initializer:
        _convert_tensor(t, src, dst)
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type in src:
            vi.type.tensor_type.elem_type = dst
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                _convert_tensor(a.t, src, dst)
            elif a.type == onnx.AttributeProto.INT and a.name in _DTYPE_ATTRS and a.i in src:
                a.i = dst


def _converted(model: onnx.ModelProto, src: set, dst: int) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for g in walk_graphs(out):
        _convert_graph(g, src, dst)
    return out


def to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` computing in float64 wherever it computed in float32, float16 or bfloat16."""
    return _converted(model, _PROMOTED, _F64)


def to_float32(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` computing in float32 wherever it computed in float64 (what a runtime under test runs)."""
    return _converted(model, {_F64}, _F32)



@dataclass
class TensorCheck:
    name: str
    analytic: float  # <u, J^T v>
    numeric: float  # <J u, v> by central differences
    abs_err: float
    rel_err: float
    ok: bool

    @property
    def both_zero(self) -> bool:
        """Both sides zero, up to the absolute tolerance the check passed with: a relative error means nothing
        there (0 against 1e-18 is 1.0)."""
        return self.ok and max(abs(self.analytic), abs(self.numeric)) <= self.abs_err

    def error_text(self) -> str:
        return "gradient zero, finite differences zero" if self.both_zero else f"rel err {self.rel_err:.2e}"


@dataclass
class GradcheckReport:
    outputs: list[str]
    checks: list[TensorCheck] = field(default_factory=list)
    # what evaluated the models: "onnxruntime" or "onnx.reference"; for a backward run elsewhere, that runtime
    # (in float32) and what computed the float64 central differences
    runtime: str = "onnxruntime"

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def worst(self) -> TensorCheck | None:
        """The failed check with the largest relative error, else the largest one not zero on both sides."""
        ranked = sorted(self.checks, key=lambda c: (not c.ok, not c.both_zero, c.rel_err))
        return ranked[-1] if ranked else None

    def summary(self) -> str:
        """One line: ``ok`` or ``not ok``, how many tensors, and the worst error."""
        bad, worst = [c for c in self.checks if not c.ok], self.worst
        if worst is None:
            return "ok: no tensor to check"
        if bad:
            return (f"not ok: {len(bad)} of {len(self.checks)} tensor(s) disagree with finite differences; worst "
                    f"{worst.name!r}: analytic {worst.analytic:.6g}, numeric {worst.numeric:.6g}, "
                    f"{worst.error_text()}")
        if worst.both_zero:
            return f"ok: {len(self.checks)} tensor(s), each gradient zero, finite differences zero"
        return (f"ok: {len(self.checks)} tensor(s) agree with finite differences; worst {worst.name!r}: "
                f"{worst.error_text()}")

    def __str__(self) -> str:
        lines = [f"gradcheck of {', '.join(self.outputs)} (run by {self.runtime})",
                 f"{'tensor':40s} {'analytic':>14s} {'numeric':>14s} {'rel err':>9s}"]
        for c in self.checks:
            err = "  gradient zero, finite differences zero" if c.both_zero else f" {c.rel_err:9.2e}"
            flag = "" if c.ok else "  MISMATCH"
            lines.append(f"{c.name[:40]:40s} {c.analytic:14.6g} {c.numeric:14.6g}{err}{flag}")
        return "\n".join(lines + [self.summary()])


def _runners(forward_model, feeds, runtime: str, providers):
    """(forward runner, runtime name, factory for further models) by ``runtime``, from the float64 loaders of the
    runtimes' records (``runtimes/``); "auto" takes onnxruntime and falls back to the reference evaluator when
    onnxruntime cannot run the model."""
    if runtime != "auto":
        load = load_float64(runtime)
        return load(forward_model, providers), _RAN_BY.get(runtime, runtime), lambda m: load(m, providers)
    ort_load, ref_load = load_float64("onnxruntime"), load_float64("reference")
    try:
        sess = ort_load(forward_model, providers)
        sess.run(None, feeds)  # some kernels fail only when run (LSTM in double)
        return sess, "onnxruntime", lambda m: ort_load(m, providers)
    except Exception as ort_error:
        try:
            return ref_load(forward_model), _RAN_BY["reference"], ref_load
        except Exception as e:  # an op neither runs (onnxruntime's contrib ops in float64, ...)
            raise GradcheckError(
                f"onnxruntime could not run the model ({str(ort_error).splitlines()[0]}) and onnx's reference "
                f"evaluator cannot either ({str(e).splitlines()[0]}). onnxruntime's contrib ops run in float32 "
                "only: check with float64=False (--float32), inputs of the sizes the model expects") from e


def evaluate(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], providers=None) -> tuple[dict, str]:
    """``({output: value}, what ran it)``: ``model`` run as gradcheck's "auto" runs it (onnxruntime, or onnx's
    reference evaluator where onnxruntime has no kernel at the element type)."""
    runner, used, _ = _runners(model, feeds, "auto", providers)
    names = [o.name for o in model.graph.output]
    return dict(zip(names, runner.run(None, feeds))), used


def default_inputs(model: onnx.ModelProto, seed: int = 0,
                   dims: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """Values for every graph input that is not an initializer: random floats, and integers that satisfy the
    model (symbolic dims as ``dims`` gives them, else as the graph allows (a Conv's channels and the spatial sizes it
    runs on, ``input_dims.fitted_dims``), else by name and sum; token ids in the vocabulary, masks without a fully
    masked row, position ids from them; ``llm_files.check_feeds``)."""
    from .input_dims import fitted_dims

    return check_feeds(model, seed, dims=fitted_dims(model, dims, seed))


def _float_names(model: onnx.ModelProto) -> list[str]:
    inputs, inits = float_parameters(model)
    return inputs + inits


def gradient_model(model: onnx.ModelProto, outputs: Sequence[str], wrt: Sequence[str], shapes) -> onnx.ModelProto:
    """``model`` plus s = sum_k <outputs[k], v_k> (the new inputs ``gradcheck/v<k>``) and a Gradient node of s w.r.t.
    ``wrt`` (outputs ``<x>__gradcheck_grad``): the model gradcheck lowers, for tests that check a gradient their
    own way. ``shapes``: output / x name -> dims, declared on the new inputs and outputs."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    terms = []
    for k, out in enumerate(outputs):
        v = f"{_V}{k}"
        dt = _output_dtype(model, out)
        g.input.append(helper.make_tensor_value_info(v, dt, shapes[out]))
        prod = f"{_S}/prod{k}"
        g.node.append(helper.make_node("Mul", [out, v], [prod], name=f"{_S}/mul{k}"))
        term = f"{_S}/term{k}"
        g.node.append(helper.make_node("ReduceSum", [prod], [term], name=f"{_S}/sum{k}", keepdims=0))
        terms.append(term)
    g.node.append(helper.make_node("Sum", terms, [_S], name=f"{_S}/total"))
    grads = [f"{w}__gradcheck_grad" for w in wrt]
    g.node.append(helper.make_node("Gradient", list(wrt), grads, name="gradcheck/Gradient",
                                   domain="ai.onnx.preview.training", xs=list(wrt), y=_S))
    dt = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.input)}
    dt.update({t.name: t.data_type for t in g.initializer})
    for w, gname in zip(wrt, grads):
        g.output.append(helper.make_tensor_value_info(gname, dt.get(w, onnx.TensorProto.DOUBLE), shapes[w]))
    if not any(o.domain == "ai.onnx.preview.training" for o in m.opset_import):
        m.opset_import.append(helper.make_opsetid("ai.onnx.preview.training", 1))
    return m


def _output_dtype(model: onnx.ModelProto, name: str) -> int:
    for vi in list(model.graph.output) + list(model.graph.value_info) + list(model.graph.input):
        if vi.name == name and vi.type.tensor_type.elem_type:
            return vi.type.tensor_type.elem_type
    return onnx.TensorProto.DOUBLE


_RAN_BY = {"reference": "onnx.reference"}  # the report's name of what ran the check
RUNTIME_RTOL = 1e-3  # the default tolerances of a float32 backward on another runtime (float32 rounding of
RUNTIME_ATOL = 1e-5  # sums of a few hundred terms, against float64 central differences)


def gradcheck(
    model,
    inputs: Mapping[str, np.ndarray] | None = None,
    *,
    wrt: Sequence[str] | None = None,
    of: str | Sequence[str] | None = None,
    eps: float = 1e-6,
    rtol: float | None = None,
    atol: float | None = None,
    directions: int = 2,
    seed: int = 0,
    float64: bool = True,
    raise_on_failure: bool = True,
    providers=None,
    runtime: str | Target | Callable = "auto",
    expand: Callable[[onnx.ModelProto], onnx.ModelProto] | None = None,
) -> GradcheckReport:
    """Check the gradients our lowering gives ``model`` against central finite differences.

    ``of``: the output(s) differentiated (default: every float graph output); ``wrt``: the float graph
    inputs and initializers to differentiate by (default: all of them). With ``float64`` the model is
    promoted to float64 first, so tight tolerances hold. Raises :class:`GradcheckError` naming the
    worst tensor on a mismatch (unless ``raise_on_failure=False``); returns the report.
    ``runtime``: "onnxruntime", "reference" (onnx's reference evaluator) or "auto" (onnxruntime, and the
    reference evaluator where onnxruntime has no kernel for an op at this element type): the whole check runs
    there in float64 (``rtol`` 1e-5, ``atol`` 1e-8 by default). Any other runtime of ``runtimes/targets.py``
    with a runner ("openvino", "tract", "onnxruntime-node", or a ``Target`` record, which runs its runner even
    for onnxruntime), or a ``load(path) -> run(feeds) -> {output: array}`` of your own: the backward is lowered
    for that target (its standard forms and step fixes, as ``export_step`` would) and runs there in float32,
    the central differences in float64 as with "auto" (``rtol`` 1e-3, ``atol`` 1e-5 by default). A runtime that
    cannot convert or run the backward raises ``RuntimeRefusedError`` naming the op.
    ``model``: a path, an ``onnx.ModelProto`` or what onnx-autodiff returned; a training model's inference
    graph is checked (its training_info is left out).
    ``expand``: applied to the lowered forward and gradient models before they run (then promoted to float64
    again when ``float64``): a standard-ONNX form of an op the runtime has no float64 kernel for (onnxruntime's
    contrib ops) stands in for it, while the backward stays the one its rule built (not on another runtime:
    that runs the op itself).
    """
    elsewhere = not (isinstance(runtime, str) and runtime in FLOAT64_RUNTIMES)
    if isinstance(runtime, str) and elsewhere and runtime not in RUNTIMES:
        raise GradcheckError(f"unknown runtime {runtime!r}: choose one of {', '.join(FLOAT64_RUNTIMES)}, "
                             f"{', '.join(n for n, t in RUNTIMES.items() if t.runner)}")
    rtol = rtol if rtol is not None else (RUNTIME_RTOL if elsewhere else 1e-5)
    atol = atol if atol is not None else (RUNTIME_ATOL if elsewhere else 1e-8)
    model = open_model(model).whole()
    del model.training_info[:]
    base = to_float64(model) if float64 else _copy(model)
    outputs, wrt = _request(base, of, wrt)
    lift_initializers(base, set(wrt))
    feeds = _feeds(base, inputs, wrt, seed, float64)
    rng = np.random.default_rng(seed)

    forward_model = _expanded(lower(base, check=False), expand, float64)
    fwd, used, make_runner = _runners(forward_model, feeds, "auto" if elsewhere else runtime, providers)
    fwd_out = [o.name for o in forward_model.graph.output]
    ys = dict(zip(fwd_out, fwd.run(None, feeds)))
    vs = [rng.standard_normal(np.shape(ys[o])).astype(ys[o].dtype) for o in outputs]
    vfeeds = {f"{_V}{k}": v for k, v in enumerate(vs)}
    shapes = declared_shapes(base, outputs, wrt, ys, feeds)
    grad_names = [f"{w}__gradcheck_grad" for w in wrt]

    if elsewhere:
        jtv, label = backward_on(runtime, base, outputs, wrt, shapes, {**feeds, **vfeeds})
        used = f"{label} (float32), central differences by {used} (float64)"
    else:
        # with ``expand`` the lowered model may hold ops not valid at float64 until expanded (quantized ones)
        grad_model = _expanded(lower(gradient_model(base, outputs, wrt, shapes), check=expand is None), expand,
                               float64)
        try:
            bwd = make_runner(grad_model)
        except GradcheckError:
            if runtime != "auto" or used != "onnxruntime":
                raise
            # the backward needs a kernel onnxruntime lacks at this type (Conv in float64): both by reference
            ref = load_float64("reference")
            fwd, used, bwd = ref(forward_model), _RAN_BY["reference"], ref(grad_model)
        jtv = dict(zip(wrt, bwd.run(grad_names, {**feeds, **vfeeds})))

    def f(fd):
        vals = fwd.run(outputs, fd)
        return sum(float(np.sum(y.astype(np.float64) * v)) for y, v in zip(vals, vs))

    report = GradcheckReport(outputs, runtime=used)
    report.checks += [_check_one(w, feeds, jtv[w], f, rng, directions, eps, rtol, atol) for w in wrt]
    if raise_on_failure and not report.ok:
        raise _mismatch(report, rtol)
    return report


def _runtime_load(runtime) -> tuple[Target, Callable, str]:
    """(the target the backward is lowered for, its ``load(path) -> run``, a label) of a runtime argument."""
    if callable(runtime) and not isinstance(runtime, Target):
        return RUNTIMES["onnxruntime"], runtime, getattr(runtime, "__name__", "custom runtime")
    target = runtime if isinstance(runtime, Target) else RUNTIMES[runtime]
    return target, load_runner(target), target.name


def runtime_model(model: onnx.ModelProto, target: Target, lowered: bool = True) -> onnx.ModelProto:
    """``model`` as it runs on ``target``: in float32, lowered for the target (unless ``lowered`` is False: a
    model without Gradient nodes, run as it is), its step fixes applied as ``export_step`` applies them, and no
    initializer default on a graph input (runtimes fold those)."""
    out = to_float32(model)
    if lowered:
        out = lower(out, target=target)
    run_pipeline(step_fixes(target), out, LoweringContext(out, target=target))
    fed = {i.name for i in out.graph.input}
    kept = [t for t in out.graph.initializer if t.name not in fed]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    finalize(out)
    return out


def run_on(load: Callable, model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], name: str = "model"):
    """Outputs of ``model`` run by a runtime's ``load(path) -> run``, fed ``feeds`` (those the model takes) in the
    element types of its inputs."""
    import tempfile

    types = {i.name: helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in model.graph.input}
    fed = {k: np.asarray(v).astype(types[k], copy=False) for k, v in feeds.items() if k in types}
    with tempfile.TemporaryDirectory(prefix="onnx-autodiff-") as tmp:
        path = f"{tmp}/{name}.onnx"
        onnx.save(model, path)
        return load(path)(fed)


def backward_on(runtime, base: onnx.ModelProto, outputs, wrt, shapes, feeds) -> tuple[dict, str]:
    """J^T v of ``base`` (the float64 model of the check) computed by ``runtime`` in float32: ``({wrt name:
    gradient as float64}, label)``."""
    target, load, label = _runtime_load(runtime)
    out = run_on(load, runtime_model(gradient_model(base, outputs, wrt, shapes), target), feeds, "backward")
    return {w: np.asarray(out[f"{w}__gradcheck_grad"], np.float64) for w in wrt}, label


def _expanded(model: onnx.ModelProto, expand, float64: bool) -> onnx.ModelProto:
    if expand is None:
        return model
    out = expand(model)
    return to_float64(out) if float64 else out


def _mismatch(report: GradcheckReport, rtol: float) -> GradcheckError:
    bad = report.worst
    return GradcheckError(
        f"gradient of {', '.join(report.outputs)} w.r.t. {bad.name!r} disagrees with finite differences: "
        f"analytic {bad.analytic:.6g}, numeric {bad.numeric:.6g} (relative error {bad.rel_err:.2e}, "
        f"rtol {rtol:g})\n{report}",
        report,
    )


def _request(base: onnx.ModelProto, of, wrt) -> tuple[list[str], list[str]]:
    """The outputs and the tensors to differentiate by, defaults filled in; GradcheckError if unknown."""
    outputs = [of] if isinstance(of, str) else list(of or [])
    if not outputs:
        outputs = [o.name for o in base.graph.output if o.type.tensor_type.elem_type in FLOAT_TYPES]
    if not outputs:
        raise GradcheckError("the model has no floating-point output to differentiate; pass of=...")
    names = _float_names(base)
    known = set(names)
    wrt = list(wrt) if wrt is not None else sorted(known, key=names.index)
    for w in wrt:
        if w not in known:
            raise GradcheckError(f"wrt names {w!r}, which is not a floating-point graph input or initializer")
    return outputs, wrt


def _feeds(base: onnx.ModelProto, inputs, wrt: list[str], seed: int, float64: bool) -> dict[str, np.ndarray]:
    """The inputs given (random ones where none are), in float64 when asked, and the wrt initializers' values."""
    feeds = default_inputs(base, seed) if inputs is None else {}
    for k, v in (inputs or {}).items():
        feeds[k] = np.asarray(v)
    if float64:
        feeds = {k: (v.astype(np.float64) if v.dtype.kind == "f" or v.dtype.name == "bfloat16" else v)
                 for k, v in feeds.items()}
    init_values = {t.name: t for t in base.graph.initializer}
    for w in wrt:
        if w not in feeds:
            feeds[w] = numpy_helper.to_array(init_values[w]).copy()
    return feeds


def _check_one(w: str, feeds: dict, jtv: np.ndarray, f, rng, directions: int, eps: float, rtol: float,
               atol: float) -> TensorCheck:
    """<J^T v, u> against the central difference of <f, v> along ``directions`` random u."""
    x0 = feeds[w]
    if jtv.shape != x0.shape:
        raise GradcheckError(f"the gradient of {w!r} has shape {jtv.shape}, expected {x0.shape}")
    an_all, nu_all = [], []
    for _ in range(directions):
        u = rng.standard_normal(x0.shape).astype(x0.dtype)
        plus = f({**feeds, w: np.asarray(x0 + eps * u, dtype=x0.dtype)})
        minus = f({**feeds, w: np.asarray(x0 - eps * u, dtype=x0.dtype)})
        nu_all.append((plus - minus) / (2 * eps))
        an_all.append(float(np.sum(jtv.astype(np.float64) * u)))
    errs = [abs(a - n) for a, n in zip(an_all, nu_all)]
    k = int(np.argmax(errs))
    scale = max(abs(an_all[k]), abs(nu_all[k]))
    ok = all(e <= atol + rtol * max(abs(a), abs(n)) for e, a, n in zip(errs, an_all, nu_all))
    return TensorCheck(w, an_all[k], nu_all[k], errs[k], errs[k] / scale if scale else errs[k], ok)


def declared_shapes(model, outputs, wrt, ys, feeds):
    """The declared (possibly symbolic) shapes of outputs and wrt tensors, so the cotangent inputs
    broadcast exactly like the outputs; the run-time shape where nothing is declared."""
    info = infer_tensor_info(model)
    out = {}
    for name, runtime in [(o, np.shape(ys[o])) for o in outputs] + [(w, feeds[w].shape) for w in wrt]:
        i = info.get(name)
        shape = i.shape if i is not None and i.shape is not None and len(i.shape) == len(runtime) else None
        out[name] = [d if d is not None else r for d, r in zip(shape, runtime)] if shape else list(runtime)
    return out


def _copy(model):
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _with_outputs(model: onnx.ModelProto, outputs: Sequence[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph outputs are ``outputs``; GradcheckError for a name that is no graph output."""
    keep = onnx.ModelProto()
    keep.CopyFrom(model)
    by_name = {o.name: o for o in keep.graph.output}
    missing = [o for o in outputs if o not in by_name]
    if missing:
        raise GradcheckError(f"jvp_check differentiates graph outputs only; {missing} are not graph outputs")
    kept = [by_name[o] for o in outputs]
    del keep.graph.output[:]
    keep.graph.output.extend(kept)
    return keep


def _dot_check(w: str, u: np.ndarray, ju: list, vs: list, jtv: np.ndarray, rtol: float, atol: float) -> TensorCheck:
    """<J u, v> (``ju``: the tangents of the outputs, ``vs``: their cotangents) against <u, J^T v> for tensor ``w``."""
    terms = [j.astype(np.float64) * v for j, v in zip(ju, vs)]
    forward_side = sum(float(np.sum(t)) for t in terms)
    reverse_side = float(np.sum(jtv.astype(np.float64) * u))
    err = abs(forward_side - reverse_side)
    # the size of what was summed: a dot product near zero by cancellation is exact only that far
    scale = max(sum(float(np.sum(np.abs(t))) for t in terms), float(np.sum(np.abs(jtv * u))))
    return TensorCheck(w, reverse_side, forward_side, err, err / scale if scale else err, err <= atol + rtol * scale)


def jvp_check(
    model,
    inputs: Mapping[str, np.ndarray] | None = None,
    *,
    wrt: Sequence[str] | None = None,
    of: str | Sequence[str] | None = None,
    rtol: float = 1e-7,
    atol: float = 1e-10,
    seed: int = 0,
    float64: bool = True,
    raise_on_failure: bool = True,
    providers=None,
    runtime: str = "auto",
    expand=None,
) -> GradcheckReport:
    """Check the forward mode against the reverse mode: <J u, v> from the ``jvp`` model against
    <u, J^T v> from the lowered gradient, for random u (one tensor of ``wrt`` at a time, the others' tangents
    zero) and random v over the outputs ``of``. Both sides are exact up to rounding (no finite differences),
    hence the tight default tolerances in float64. Arguments and result as for ``gradcheck`` (the report's
    "numeric" column holds <J u, v>; ``expand`` as for ``gradcheck``: a standard-ONNX form stands in for an op
    the runtime has no float64 kernel for, in both models, while each keeps the nodes its rules built)."""
    model = open_model(model).whole()
    del model.training_info[:]
    base = to_float64(model) if float64 else _copy(model)
    outputs, wrt = _request(base, of, wrt)
    lift_initializers(base, set(wrt))
    feeds = _feeds(base, inputs, wrt, seed, float64)
    rng = np.random.default_rng(seed)

    names = {w: f"{w}__jvp_check_tangent" for w in wrt}
    tangent_model = _expanded(jvp(_with_outputs(base, outputs), wrt, names), expand, float64)
    zeros = {names[w]: np.zeros_like(feeds[w]) for w in wrt}
    tan, used, make_runner = _runners(tangent_model, {**feeds, **zeros}, runtime, providers)
    ys = dict(zip(outputs, tan.run(outputs, {**feeds, **zeros})))
    vs = [rng.standard_normal(np.shape(ys[o])).astype(ys[o].dtype) for o in outputs]
    grad_model = _expanded(lower(gradient_model(base, outputs, wrt, declared_shapes(base, outputs, wrt, ys, feeds))),
                           expand, float64)
    vfeeds = {f"{_V}{k}": v for k, v in enumerate(vs)}
    grads = [f"{w}__gradcheck_grad" for w in wrt]
    try:
        jtv = dict(zip(wrt, make_runner(grad_model).run(grads, {**feeds, **vfeeds})))
    except Exception:  # the gradient may hold a kernel the tangent model does not (LSTM in double)
        if runtime != "auto" or used != "onnxruntime":
            raise
        ref = load_float64("reference")
        used, bwd, tan = _RAN_BY["reference"], ref(grad_model), ref(tangent_model)
        jtv = dict(zip(wrt, bwd.run(grads, {**feeds, **vfeeds})))
    tangent_outputs = [o.name for o in tangent_model.graph.output[len(outputs):]]
    report = GradcheckReport(outputs, runtime=used)
    for w in wrt:
        u = rng.standard_normal(feeds[w].shape).astype(feeds[w].dtype)
        ju = tan.run(tangent_outputs, {**feeds, **zeros, names[w]: u})
        report.checks.append(_dot_check(w, u, ju, vs, jtv[w], rtol, atol))
    if raise_on_failure and not report.ok:
        bad = report.worst
        raise GradcheckError(
            f"the forward mode (jvp) of {', '.join(outputs)} w.r.t. {bad.name!r} disagrees with the reverse mode: "
            f"<J u, v> = {bad.numeric:.10g}, <u, J^T v> = {bad.analytic:.10g} (relative error {bad.rel_err:.2e}, "
            f"rtol {rtol:g})\n{report}", report)
    return report
