"""Rematerialization under a memory budget: the backward recomputes cheap forward activations instead of
keeping them alive from the forward to their last reader.

``make_training_model(memory_budget=...)`` records the budget under ``metadata.MEMORY_BUDGET``; this pass (after
the loss split: no pass for onnxruntime rewrites the algorithm after it, so the plan is the graph that runs)
reads it and rewrites each lowered algorithm. Candidate plans come from the
min-cut of ``remat_plan`` at two tiers of recomputable ops (elementwise; then normalizations, reductions,
softmax), each over the first quarter, half, three quarters or all of the forward's activations (the
earliest live longest). The estimate is the peak RSS of the process that steps (``remat_plan.peak_bytes``
plus what the process holds now). Of the plans whose estimated peak fits the budget, the one with the fewest
recomputed FLOPs wins; when none fits, the one with the lowest estimate (said in a warning).

The recomputation is standard ONNX: copies of the forward nodes, with fresh names, placed just before
the first backward node that reads them, which now reads the copies. onnxruntime merges identical nodes
(common subexpression elimination), which would fold a copy back into its original; so each copy that
reads only original tensors reads one of them through ``Where(c, x, x)`` (exactly ``x``), with ``c``
taken from one element of a tensor of the gradient chain that the reader itself reads (see ``_late_tensors``):
the copy differs from the original and cannot run before the backward reaches it. (Runtimes order nodes
by data dependencies alone: anchored on a constant, onnxruntime ran the copies in the forward, where
they lived as long as the originals and saved nothing.)
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import MemoryBudgetError
from ..graph import TRAINING_DOMAINS, TensorInfo, fresh_name, node_inputs, set_nodes
from ..model import metadata
from .context import LoweringContext
from .remat_plan import (
    StepGraph,
    min_cut_keep,
    networkx_module,
    node_flops,
    peak_bytes,
    recompute_set,
    step_graph,
)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_log = logging.getLogger("onnx_autodiff")


def parse_size(value) -> int | str | None:
    """A memory budget: None, ``"auto"``, a number of bytes, or a text such as ``2GiB``, ``500MB``, ``1.5 GB``."""
    if value is None or value == "auto":
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (m := re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)) \
            and m.group(2).lower() in _UNITS:
        size = float(m.group(1)) * _UNITS[m.group(2).lower()]
    else:
        raise MemoryBudgetError(f"memory_budget: {value!r} is not a size; write bytes (2000000000), a size with "
                                f"a unit (2GiB, 500MB, 1.5GB) or 'auto'")
    if not np.isfinite(size) or size <= 0:
        raise MemoryBudgetError(f"memory_budget: {value!r} is not a positive size")
    return int(size)


def budget_record(budget, dims: dict | None, loss: str) -> dict[str, str]:
    """The metadata entry ``make_training_model`` writes for a budget (nothing for None)."""
    budget = parse_size(budget)
    if budget is None:
        return {}
    networkx_module()  # the plan needs it: say so where the budget is set, not at the first step
    for name, size in (dims or {}).items():
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size <= 0:
            raise MemoryBudgetError(f"MemoryBudget dims: the size of {name!r} must be a positive int, got {size!r}")
    return {metadata.MEMORY_BUDGET: json.dumps({"budget": budget, "dims": {k: int(v) for k, v in (dims or {}).items()},
                                    "loss": loss})}


def note_gradients(model: onnx.ModelProto, ctx: LoweringContext) -> bool:
    """The pipeline pass before the Gradient nodes are lowered: under a recorded budget, their outputs join the
    record (a session keeps the gradients in buffers of their own for the whole step: the plan counts them so).
    Changes no graph; a record that has them already (a lowered model lowered again) keeps them."""
    settings = metadata.read_json(model, metadata.MEMORY_BUDGET)
    if settings is None or not len(model.training_info) or "gradients" in settings:
        return False
    settings["gradients"] = [o for n in model.training_info[0].algorithm.node
                             if n.op_type == "Gradient" and n.domain in TRAINING_DOMAINS for o in n.output if o]
    metadata.write(model, {metadata.MEMORY_BUDGET: json.dumps(settings)})
    return False


def rematerialize(model: onnx.ModelProto, ctx: LoweringContext) -> bool:
    """The pipeline pass: apply the recorded budget to every lowered algorithm (no budget: no change)."""
    settings = metadata.read_json(model, metadata.MEMORY_BUDGET)
    if settings is None or not len(model.training_info):
        return False
    metadata.write(model, {metadata.REMAT: _apply(model, model.training_info[0].algorithm, settings, ctx)})
    return True


def remat_summary(model: onnx.ModelProto) -> str | None:
    """The one-line summary the pass left in a lowered model, or None."""
    return metadata.read(model).get(metadata.REMAT)


@dataclass
class Plan:
    tier: int
    share: float
    rerun: list[int]
    rebuilt: set[str]
    nodes: list[onnx.NodeProto] | None = None
    inits: list[onnx.TensorProto] | None = None
    peak: int = 0
    flops: int = 0


def _apply(model: onnx.ModelProto, alg: onnx.GraphProto, settings: dict, ctx: LoweringContext) -> str:
    base = process_bytes()  # what the process holds already: the session's step comes on top of it
    step = step_graph(model, alg, settings["loss"], settings.get("dims", {}), settings.get("gradients", ()))
    budget = settings["budget"]
    budget = base + available_bytes() if budget == "auto" else int(budget)  # "auto": what is free, beside what we hold
    n_inf = len(model.graph.node)
    outputs = {o.name for o in alg.output} | {o.name for o in model.graph.output}
    plans = _candidates(step)
    for p in plans:
        p.nodes, p.inits = rewrite(step, n_inf, p.rerun, p.rebuilt, set(ctx.taken), model)
        p.peak = base + peak_bytes(step, step.nodes[:n_inf] + p.nodes, outputs)
        p.flops = sum(node_flops(step, step.nodes[i]) for i in p.rerun)
    _log.debug("remat plans (tier, share of activations, nodes, estimated peak, FLOPs): %s",
               [(p.tier, p.share, len(p.rerun), p.peak, p.flops) for p in plans])
    fits = [p for p in plans if p.peak <= budget]
    best = min(fits, key=lambda p: (p.flops, p.peak)) if fits else min(plans, key=lambda p: (p.peak, p.flops))
    line = _summary(step, plans[0], best, budget, base)
    if not fits:
        _log.warning("%s; no plan fits the budget: this is the lowest estimate", line)
    else:
        _log.info("%s", line)
    if best.rerun:
        nodes, inits = rewrite(step, n_inf, best.rerun, best.rebuilt, ctx.taken, model)
        set_nodes(alg, nodes)
        alg.initializer.extend(inits)
        ctx.added.update(n.name for n in nodes)
    return line


def process_bytes() -> int:
    """This process's resident bytes now (Linux ``/proc/self/statm``; 0 where there is none): the interpreter,
    the runtime's libraries and what the caller holds, which a step's peak RSS includes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return 0


def available_bytes() -> int:
    """What ``"auto"`` fits into: the physical memory the system reports available now."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no sysconf: no limit we can read
        return 2**62


def _candidates(step: StepGraph) -> list[Plan]:
    """The plain step first, then one plan per tier and share of the activations (duplicates dropped)."""
    plans = [Plan(0, 0.0, [], set())]
    seen = {()}
    pinned = _pinned(step)
    position = {o: k for k, i in enumerate(step.forward) for o in step.nodes[i].output if o}
    span = max(len(position), 1)
    for tier in (1, 2):
        for share in (0.25, 0.5, 0.75, 1.0):
            targets = {t for t in step.activations if position[t] < share * span and t not in pinned}
            keep = min_cut_keep(step, tier, targets) | pinned
            rerun, rebuilt = recompute_set(step, keep, tier)
            if tuple(rerun) not in seen:
                seen.add(tuple(rerun))
                plans.append(Plan(tier, share, rerun, rebuilt))
    return plans


def _pinned(step: StepGraph) -> set[str]:
    """Activations read as outer names by a backward node's subgraph: kept (their readers are not rewired)."""
    fwd = set(step.forward)
    out: set[str] = set()
    for i, n in enumerate(step.nodes):
        if i not in fwd:
            out.update(set(node_inputs(n)) - set(n.input))
    return out


def rewrite(step: StepGraph, n_inf: int, rerun: list[int], rebuilt: set[str], taken: set[str],
            model: onnx.ModelProto) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The algorithm's nodes with the recomputation inserted, and the few constants it needs."""
    w = _Writer(step, set(rerun), taken, _opset(model) >= 9)
    fwd = set(step.forward)
    late = _late_tensors(step)
    for k in range(n_inf, len(step.nodes)):
        node = step.nodes[k]
        if k in fwd:
            w.out.append(node)
            continue
        needs = [x for x in node.input if x in rebuilt and x not in w.copies]
        if needs:
            w.emit_group(needs, next((x for x in node.input if x in late), w.last_made))
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        for j, x in enumerate(copy.input):
            if x in rebuilt:
                copy.input[j] = w.copies[x]
        if w.barriers and w.last_made and not late.intersection(copy.input) and _large_output(step, node):
            w.tie(copy, w.last_made)
        w.out.append(copy)
        w.last_made = next((o for o in node.output if o in late), w.last_made)
    return w.out, w.inits


def _large_output(step: StepGraph, node: onnx.NodeProto) -> bool:
    """A backward node worth tying to the gradient chain: one that reads none of it (so it may run as early
    as its inputs exist: in the forward) and makes at least 64 KiB that would stay alive until its reader."""
    return node.op_type not in ("Shape", "Size") and sum(step.nbytes(o) for o in node.output if o) >= 2**16


def _late_tensors(step: StepGraph) -> set[str]:
    """The backward tensors that exist only once the backward is under way: those that depend, through
    backward nodes, on the forward's last tensors as much as every parameter update does (the chain of
    gradients from the loss). A copy anchored on one cannot run in the forward; a constant, a shape or a
    tensor derived from an early activation alone could (runtimes order by data dependencies only)."""
    position = {i: k for k, i in enumerate(step.forward)}
    latest: dict[str, int] = {}  # tensor -> forward position of the latest forward node it depends on
    for i, n in enumerate(step.nodes):
        k = position[i] if i in position else max((latest.get(x, -1) for x in node_inputs(n)), default=-1)
        latest.update((o, k) for o in n.output if o)
    backward = [o for i, n in enumerate(step.nodes) if i not in position for o in n.output if o]
    ends = [latest[o] for o in backward if o in step.permanent and latest[o] >= 0]
    floor = min(ends) if ends else max(latest.values(), default=0)
    return {o for o in backward if latest[o] >= floor and step.nbytes(o) > 0}


class _Writer:
    """Emits the copies of forward nodes, their barriers and conditions, keeping track of what exists."""

    def __init__(self, step: StepGraph, rerun: set[int], taken: set[str], barriers: bool):
        self.step, self.rerun, self.taken, self.barriers = step, rerun, taken, barriers
        self.out: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.copies: dict[str, str] = {}  # forward tensor -> its recomputed name
        self.last_made: str | None = None  # the backward's latest late tensor (see _late_tensors)
        self._consts: dict[str, str] = {}
        self._conds: dict[str, str] = {}  # anchor -> the condition made from it

    def emit_group(self, needs: list[str], anchor: str | None) -> None:
        group: set[int] = set()
        stack = list(needs)
        while stack:
            i = self.step.producer.get(stack.pop())
            if i is None or i not in self.rerun or i in group or self.step.nodes[i].output[0] in self.copies:
                continue
            group.add(i)
            stack.extend(node_inputs(self.step.nodes[i]))
        cond: list[str] = []  # made on first use
        for i in sorted(group):
            self._copy(self.step.nodes[i], anchor, cond)

    def _copy(self, node: onnx.NodeProto, anchor: str | None, cond: list[str]) -> None:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = fresh_name(self.taken, f"{node.name}/remat")
        for j, x in enumerate(copy.input):
            if x in self.copies:
                copy.input[j] = self.copies[x]
        if self.barriers and copy.input and not any(x in self.copies for x in node.input):
            j = min((j for j, x in enumerate(node.input) if x), key=lambda j: self.step.nbytes(node.input[j]))
            copy.input[j] = self._barrier(node.input[j], anchor, cond)
        for j, o in enumerate(node.output):
            if o:
                copy.output[j] = self.copies[o] = fresh_name(self.taken, f"{o}/remat")
                self.step.info[copy.output[j]] = self.step.info.get(o, TensorInfo(None, None))
        self.out.append(copy)

    def tie(self, node: onnx.NodeProto, anchor: str) -> None:
        """Make ``node`` wait for ``anchor`` without a copy: its smallest input goes through
        ``Reshape(x, Where(c, Shape(x), Shape(x)))`` (a view of ``x`` with ``c`` from ``anchor``)."""
        inputs = [j for j, x in enumerate(node.input) if x]
        if not inputs:
            return
        j = min(inputs, key=lambda j: self.step.nbytes(node.input[j]))
        x, cond = node.input[j], self._cond_of(anchor)
        shape, same, out = (fresh_name(self.taken, f"{x}/tie_{what}") for what in ("shape", "same", "view"))
        self.out.append(helper.make_node("Shape", [x], [shape], name=fresh_name(self.taken, f"{shape}/node")))
        self.out.append(helper.make_node("Where", [cond, shape, shape], [same],
                                         name=fresh_name(self.taken, f"{same}/node")))
        self.out.append(helper.make_node("Reshape", [x, same], [out], name=fresh_name(self.taken, f"{out}/node")))
        self.step.info[out] = self.step.info.get(x, TensorInfo(None, None))
        node.input[j] = out

    def _cond_of(self, anchor: str) -> str:
        if anchor not in self._conds:
            self._conds[anchor] = self._condition(anchor)
        return self._conds[anchor]

    def _barrier(self, x: str, anchor: str | None, cond: list[str]) -> str:
        """``Where(c, x, x)``: exactly ``x``, but a tensor of its own that exists only once ``c`` does."""
        if not cond:
            cond.append(self._condition(anchor))
        out = fresh_name(self.taken, f"{x}/remat_barrier")
        self.out.append(helper.make_node("Where", [cond[0], x, x], [out], name=fresh_name(self.taken, f"{out}/node")))
        self.step.info[out] = self.step.info.get(x, TensorInfo(None, None))
        return out

    def _condition(self, anchor: str | None) -> str:
        if anchor is None:
            return self._const("true", np.array(True))
        flat = fresh_name(self.taken, f"{anchor}/remat_flat")
        first = fresh_name(self.taken, f"{anchor}/remat_first")
        cond = fresh_name(self.taken, f"{anchor}/remat_cond")
        self.out.append(helper.make_node("Reshape", [anchor, self._const("flat", np.array([-1], np.int64))],
                                         [flat], name=fresh_name(self.taken, f"{flat}/node")))
        self.out.append(helper.make_node("Gather", [flat, self._const("first", np.array(0, np.int64))], [first],
                                         name=fresh_name(self.taken, f"{first}/node")))
        self.out.append(helper.make_node("Cast", [first], [cond], to=TensorProto.BOOL,
                                         name=fresh_name(self.taken, f"{cond}/node")))
        return cond

    def _const(self, what: str, value: np.ndarray) -> str:
        if what not in self._consts:
            name = self._consts[what] = fresh_name(self.taken, f"remat/{what}")
            self.inits.append(numpy_helper.from_array(value, name))
        return self._consts[what]


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def _gb(n: float) -> str:
    if n < 1e5:
        return f"{n:.0f} bytes"
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _summary(step: StepGraph, plain: Plan, best: Plan, budget: int, base: int = 0) -> str:
    total = sum(node_flops(step, n) for n in step.nodes) or 1
    held = f", {_gb(base)} of it held before the step" if base else ""
    if not best.rerun:
        return f"remat: recompute nothing (estimated peak {_gb(plain.peak)}{held}, budget {_gb(budget)})"
    ops: dict[str, int] = {}
    for i in best.rerun:
        ops[step.nodes[i].op_type] = ops.get(step.nodes[i].op_type, 0) + 1
    names = ", ".join(sorted(ops, key=lambda o: -ops[o])[:4]) + ("..." if len(ops) > 4 else "")
    return (f"remat: recompute {len(best.rerun)} nodes ({names}), estimated peak {_gb(plain.peak)} -> "
            f"{_gb(best.peak)}{held} (budget {_gb(budget)}), +{100 * best.flops / total:.1f}% FLOPs")
