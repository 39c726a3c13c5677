"""``check --target``: whether a model trains (or, without training_info, runs) on a runtime, said before anything
runs, and said truthfully.

1. What the target lacks among the model's ops, and whether lowering for it writes them in standard ops
   (``target_report`` below).
2. The step bundle lowered for the target (the same lowering ``export_step`` and ``train --runtime`` do): a node the
   lowering could not avoid (a lacked op without a standard form, a feature the runtime refuses, such as axes of
   run-time length on OpenVINO) is MISSING; one whose op the runtime's conformance table shows computed wrong is a
   warning.
3. Where the runtime is installed: its runner converts the bundle, runs ``init.onnx`` and one step on random feeds,
   and the loss and the gradients (not the optimizer's update, whose Adam sign noise on zero gradients says nothing)
   are held against onnxruntime on the same feeds. A refusal is our one-line error; a disagreement names the tensor.

``ok`` only when nothing is missing and, where the conformance table warns, the run on the runtime confirmed it.
"""
from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from ..check.input_dims import conv_dims, fitted_dims, probe_feeds
from ..driver.bundle import build_bundle
from ..driver.kv_cache import cache_inputs, cache_names
from ..driver.step_model import gradient_names, host_scalar_value
from ..errors import BundleError, DeviceError, MissingRuntimeError, OnnxAutodiffError, RuntimeRefusedError, TargetError
from ..graph import normalize_domain, opset_map, top_graphs, walk_graph
from ..model.carrier import open_model
from ..passes.pipeline import lower_light
from ..passes.standard_forms import FORM_SINCE, float32_text
from .loop import load_runner, runtime_version
from .targets import RUN_TIME_AXES, RUNTIMES, Target, get_target, meets, run_time_length, table_of

RTOL = 1e-3  # a tensor of the runtime against onnxruntime's, relative to its largest value
ATOL = 1e-6


@dataclass
class TargetCheck:
    lines: list[str] = field(default_factory=list)
    ok: bool = True
    not_run: list[str] = field(default_factory=list)  # runtimes not installed here: the table's word alone

    def fail(self, line: str) -> None:
        self.lines.append(line)
        self.ok = False


def _runtimes_of(target: Target) -> list[Target]:
    """The runtimes a target stands for: itself, or every runtime the portable target covers."""
    if target.name in RUNTIMES:
        return [target]
    return [t for t in RUNTIMES.values() if t.runner]


def _warnings(model: onnx.ModelProto, runtime: Target) -> list[str]:
    """The conformance table's ``fails`` entries (cases it fails or computes wrong) that nodes of ``model`` meet."""
    table = table_of(runtime.table) if runtime.table else None
    if not table or not table.get("fails"):
        return []
    opset = opset_map(model).get("", 0)
    found: dict[str, list[str]] = {}
    for top in top_graphs(model):
        for graph in walk_graph(top):
            dynamic = run_time_length(graph)
            for n in graph.node:
                entry = meets(table["fails"], n, dynamic, opset)
                if entry:
                    found.setdefault(entry, []).append(n.name)
    lines = []
    for entry, nodes in found.items():
        cases = table.get("fails_cases", {}).get(entry, [])
        lines.append(f"WARNING: {runtime.name}'s conformance table ({table['version']}) has {entry} failing in "
                     f"{', '.join(cases[:3])}{' and more' if len(cases) > 3 else ''}; the model has it in node "
                     f"{nodes[0]!r}"
                     + (f" and {len(nodes) - 1} more" if len(nodes) > 1 else ""))
    return lines


def _feeds(light, specs: list[dict], dims: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    """The probe's feeds for ``specs`` (``[{"name", "dtype", "shape"}]``, the step's or the model's): the batch the
    training driver would give ``light``'s graph (``input_dims.probe_feeds``: token ids over the vocabulary, the KV
    cache empty or window-sized, position_ids from the mask, symbolic dims from the graph or ``dims``); a feed the
    model's graph does not have (a loss's labels) random, its symbolic dims as the graph's feeds have them: floats
    N(0, 1), integers 0 or 1 (valid class labels for any model), masks all ones."""
    made = probe_feeds(light.proto, seed, dims)
    sizes = dict(dims)
    for vi in light.proto.graph.input:
        if vi.name in made:
            shape = np.shape(made[vi.name])
            for k, d in enumerate(vi.type.tensor_type.shape.dim):
                if d.dim_param and k < len(shape):
                    sizes.setdefault(d.dim_param, int(shape[k]))
    rng = np.random.default_rng(seed)
    out = {}
    for f in specs:
        if f["name"] in made:
            out[f["name"]] = made[f["name"]]
            continue
        shape = [d if isinstance(d, int) else sizes.get(d, 2) for d in (f["shape"] or [])]
        dtype = np.dtype(f["dtype"])
        if dtype.kind == "f":
            out[f["name"]] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            out[f["name"]] = np.ones(shape, bool)
        elif "mask" in f["name"]:
            out[f["name"]] = np.ones(shape, dtype)
        else:
            out[f["name"]] = rng.integers(0, 2, shape).astype(dtype)
    return out


def _with_gradients(step: onnx.ModelProto, grads: list[str]) -> onnx.ModelProto:
    """The step with its gradients as outputs too (untyped: each runtime gives them their parameter's type)."""
    out = onnx.ModelProto()
    out.CopyFrom(step)
    have = {o.name for o in out.graph.output}
    out.graph.output.extend(helper.make_empty_tensor_value_info(g) for g in grads if g not in have)
    return out


def _largest_difference(got: dict, want: dict, names: list[str]) -> tuple[float, str]:
    """The largest difference past tolerance (relative to the tensor's largest value; inf for another shape or
    NaN where the other is finite) and the tensor it is in; (0, "") when every tensor agrees."""
    worst, where = 0.0, ""
    for name in names:
        a, b = np.asarray(got[name], np.float64), np.asarray(want[name], np.float64)
        if a.shape != b.shape and a.size == b.size:
            a = a.reshape(b.shape)
        if a.shape != b.shape or not np.array_equal(np.isfinite(a), np.isfinite(b)):
            return float("inf"), name
        fin = np.isfinite(b)
        if not fin.any():
            continue
        scale, diff = float(np.max(np.abs(b[fin]))), float(np.max(np.abs(a[fin] - b[fin])))
        if diff > RTOL * scale + ATOL and diff / max(scale, ATOL) > worst:
            worst, where = diff / max(scale, ATOL), name
    return worst, where


def _run_bundle(folder: Path, runtime: Target, feeds: dict, manifest: dict, outputs: list[str]) -> dict:
    load = load_runner(runtime)
    init = load(str(folder / "init.onnx"))({})
    state = {k: np.asarray(init[k]) for k in manifest["state"]}
    hyper = {k: np.asarray(v, np.float32) for k, v in manifest["hyper"].items()}
    host = {k: host_scalar_value(spec, int(np.asarray(state[spec["counter"]]).reshape(-1)[0]))
            for k, spec in manifest.get("host_scalars", {}).items()}  # as BundleTrainer feeds them
    out = load(str(folder / "probe.onnx"))({**feeds, **state, **hyper, **host})
    return {k: out[k] for k in outputs}


def _verify_training(light, target: Target, runtimes: list[Target], result: TargetCheck, dims: dict) -> None:
    try:
        step, init, manifest = build_bundle(light, target)
    except TargetError as e:
        result.fail(f"MISSING: {' '.join(str(e).split())}")
        return
    left = missing_ops(step.proto, target)
    for what, node, _ in left:
        result.fail(f"MISSING: the lowered step still has {what} in node {node!r}: {target.name} refuses it and "
                    "onnx-autodiff has no standard form for it")
    warned = _add_warnings(step.proto, runtimes, result)
    produced = {o for n in step.proto.graph.node for o in n.output}
    grads = [g for g in gradient_names(light.proto, 0)["gradients"] if g in produced]
    outputs = [manifest["loss"], *grads]
    feeds = _feeds(light, manifest["feeds"], dims)
    with tempfile.TemporaryDirectory(prefix="onnx-autodiff-check-") as tmp:
        folder = Path(tmp)
        init.save(folder / "init.onnx")
        dataclasses.replace(step, proto=_with_gradients(step.proto, grads)).save(folder / "probe.onnx")
        _compare_runs(folder, runtimes, feeds, manifest, outputs, result)
    _unconfirmed(warned, target, result, "step")


def _add_warnings(model: onnx.ModelProto, runtimes: list[Target], result: TargetCheck) -> set[str]:
    """The conformance tables' warnings for ``model`` added to ``result``; the runtimes that have some."""
    warned = set()
    for rt in runtimes:
        lines = _warnings(model, rt)
        result.lines += lines
        if lines:
            warned.add(rt.name)
    return warned


def _unconfirmed(warned: set[str], target: Target, result: TargetCheck, what: str) -> None:
    """Warnings of runtimes not installed here: the runtime asked about cannot be confirmed (not ok); under
    ``portable`` a runtime that is not installed is skipped, said so, and never fails the check."""
    left = [name for name in result.not_run if name in warned]
    if not left:
        return
    if target.name in RUNTIMES:
        result.fail(f"not confirmed: {target.name} is not installed here to run the {what}")
    else:
        result.lines.append(f"not confirmed on {', '.join(left)} (not installed here): the warnings above for "
                            f"{'it' if len(left) == 1 else 'them'} are the conformance tables' word alone")


def _version(rt: Target, result: TargetCheck, what: str) -> str | None:
    """The installed version of ``rt``, or None (said in ``result``) when there is no runner for it here."""
    try:
        version = runtime_version(rt)
        if rt.ep is not None:  # an execution provider: installed, and with a device here
            from ..driver.devices import resolve_device

            resolve_device([rt.ep])
        return version
    except (BundleError, ImportError, MissingRuntimeError, DeviceError) as e:
        why = "has no Python runner" if rt.runner is None else "is not installed here"
        if isinstance(e, MissingRuntimeError | DeviceError):
            why = f"is not available here: {' '.join(str(e).split())}"
        result.lines.append(f"{rt.name} {why}, so the {what} was not run on it")
        result.not_run.append(rt.name)
        return None


def _compare_runs(folder: Path, runtimes: list[Target], feeds, manifest, outputs, result: TargetCheck) -> None:
    """Runs the bundle in ``folder`` on each installed runtime and on onnxruntime."""
    want = _run_bundle(folder, RUNTIMES["onnxruntime"], feeds, manifest, outputs)
    _compare_on(runtimes, lambda rt: _run_bundle(folder, rt, feeds, manifest, outputs), want, outputs, result,
                "step", "ran the step, but {where!r} differs from onnxruntime's by {worst:.1e} of its largest "
                "value (random feeds); gradcheck --runtime narrows it down",
                f"converted the step bundle and ran one step on random feeds: the loss and {len(outputs) - 1} "
                "gradient(s) agree with onnxruntime")


def _compare_on(runtimes: list[Target], run, reference: dict, outputs, result: TargetCheck, what: str,
                differs: str, agrees: str) -> None:
    """``run(runtime)`` on each installed runtime against ``reference`` (onnxruntime's), each said in ``result``
    (``differs``: a format of ``where`` and ``worst``); one not installed here goes to ``result.not_run``."""
    for rt in runtimes:
        version = _version(rt, result, what)
        if version is None:
            continue
        try:
            got = run(rt)
        except RuntimeRefusedError as e:
            result.fail(f"{rt.name} {version}: {e}; hint: {e.hint}")
            continue
        worst, where = _largest_difference(got, reference, outputs)
        if worst:
            result.fail(f"{rt.name} {version}: " + differs.format(where=where, worst=worst))
        else:
            result.lines.append(f"{rt.name} {version}: {agrees}")


def check_target(model, target: str | Target, dims: Mapping[str, int] | None = None) -> TargetCheck:
    """Whether ``model`` (a training model, or an inference model) trains / runs on ``target`` (module docstring);
    ``dims``: sizes of symbolic input dims for the probe's batch (``--dim``), over those the graph gives."""
    t = get_target(target)
    light = open_model(model)
    lines, missing = target_report(light.proto, t)
    result = TargetCheck(lines, not missing)
    runtimes = _runtimes_of(t)
    try:
        if missing:
            pass  # the runtime would refuse what the report names
        elif len(light.proto.training_info):
            _verify_training(light, t, runtimes, result, _probe_dims(light, dims))
        else:
            _verify_inference(light, t, runtimes, result, _probe_dims(light, dims))
    except OnnxAutodiffError as e:
        result.fail(f"MISSING: {' '.join(str(e).split())}")
    does = "trains" if len(light.proto.training_info) else "runs"
    if not result.ok:
        result.lines.append("not ok: see above; docs/runtimes.md lists what each runtime lacks")
    elif result.not_run:
        result.lines.append(f"ok by the conformance tables: the model {does} on {t.name} as far as they tell "
                            f"(not run on {', '.join(result.not_run)} here)")
    else:
        result.lines.append(f"ok: the model {does} on {t.name}")
    return result


def _probe_dims(light, given: Mapping[str, int] | None) -> dict[str, int]:
    """Sizes of the symbolic input dims for the probe: ``given``, and those the graph allows (a Conv's channels
    and the spatial sizes it runs on, ``input_dims.fitted_dims``; its trial runs need the weights)."""
    if not conv_dims(light.proto)[1]:
        return fitted_dims(light.proto, given)
    whole = light.whole()
    del whole.training_info[:]
    return fitted_dims(whole, given)


def _window_presents(model: onnx.ModelProto) -> list[str]:
    """The present outputs of window-sized KV caches (``driver/kv_cache.py``): buffers of the window's capacity of
    which the op writes the rows of the tokens it saw only."""
    pairs, _ = cache_names(model.graph)
    if not pairs:
        return []
    caches = cache_inputs(model, [i.name for i in model.graph.input if i.name not in pairs])
    return [pairs[c.name] for c in caches if getattr(c, "window_node", "") and pairs.get(c.name)]


def _specs(model: onnx.ModelProto) -> list[dict]:
    """``[{"name", "dtype", "shape"}]`` of the graph inputs without an initializer, as a bundle's manifest has
    its feeds."""
    inits = {t.name for t in model.graph.initializer}
    return [{"name": i.name, "dtype": np.dtype(helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)).name,
             "shape": [d.dim_value if d.HasField("dim_value") else d.dim_param or None
                       for d in i.type.tensor_type.shape.dim]}
            for i in model.graph.input if i.name not in inits]


def _verify_inference(light, target: Target, runtimes: list[Target], result: TargetCheck, dims: dict) -> None:
    lowered = lower_light(light, target=target)
    for what, node, _ in missing_ops(lowered.proto, target):
        result.fail(f"MISSING: {what} in node {node!r}: {target.name} refuses it and onnx-autodiff has no standard "
                    "form for it")
    warned = _add_warnings(lowered.proto, runtimes, result)
    feeds = _feeds(light, _specs(lowered.proto), dims)
    unwritten = _window_presents(light.proto)
    outputs = [o.name for o in lowered.proto.graph.output if o.name not in unwritten]
    if unwritten:
        result.lines.append(f"not compared: {', '.join(unwritten)} (a window-sized KV cache's buffer: the rows the "
                            "op does not write hold whatever memory was there)")
    with tempfile.TemporaryDirectory(prefix="onnx-autodiff-check-") as tmp:
        path = str(Path(tmp) / "model.onnx")
        lowered.save(path)
        reference = load_runner(RUNTIMES["onnxruntime"])(path)(feeds)
        _compare_on(runtimes, lambda rt: load_runner(rt)(path)(feeds), reference, outputs, result, "model",
                    "{where!r} differs from onnxruntime's by {worst:.1e} of its largest value (random feeds)",
                    "converted and ran the model on random feeds: its outputs agree with onnxruntime")
    _unconfirmed(warned, target, result, "model")


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
                    standard = normalize_domain(n.domain) == "" and what.partition("[")[2] != f"{RUN_TIME_AXES}]"
                    since = FORM_SINCE.get(n.op_type) if standard else None
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


__all__ = ["check_target", "TargetCheck", "missing_ops", "target_report", "dropout_ratio"]
