"""Inline ``GraphCall`` nodes (the training proposal's call of the inference graph) into plain nodes.

``GraphCall(graph_name=ModelProto.graph.name)`` binds its inputs and outputs to the inference graph's
inputs and outputs by position. An empty (or missing) input whose graph input names a global
initializer (``ModelProto.graph.initializer``) falls back to that initializer, so gradients taken
through the call reach the global tensor. The copy reads the global initializers by their own names;
every tensor the copy computes gets a fresh name scoped under the GraphCall node.
"""
from __future__ import annotations

import onnx
from onnx import helper

from ..errors import TrainingSpecError
from ..graph import TRAINING_DOMAINS, attr_value, fresh_name, rename_outer_reads, set_nodes, subgraphs
from .context import LoweringContext


def is_graph_call(node: onnx.NodeProto) -> bool:
    return node.op_type == "GraphCall" and node.domain in TRAINING_DOMAINS


def _graph_name(node: onnx.NodeProto) -> str:
    name = attr_value(node, "graph_name")
    if name is None:
        raise TrainingSpecError(f"GraphCall node {node.name!r}: attribute 'graph_name' is missing")
    return name


def inline_call(call: onnx.NodeProto, callee: onnx.GraphProto, taken: set[str]) -> list[onnx.NodeProto]:
    """The nodes that replace one GraphCall of ``callee`` (the call's output names are kept)."""
    where = f"GraphCall node {call.name!r}"
    inputs = [i.name for i in callee.input]
    outputs = [o.name for o in callee.output]
    globals_ = {t.name for t in callee.initializer}
    if len(call.input) > len(inputs):
        raise TrainingSpecError(
            f"{where}: has {len(call.input)} inputs but graph {callee.name!r} takes {len(inputs)}; "
            "inputs bind to the graph's inputs by position"
        )
    if len(call.output) > len(outputs):
        raise TrainingSpecError(
            f"{where}: has {len(call.output)} outputs but graph {callee.name!r} returns {len(outputs)}; "
            "outputs bind to the graph's outputs by position"
        )
    rename: dict[str, str] = {}
    for k, name in enumerate(inputs):
        given = call.input[k] if k < len(call.input) else ""
        if given:
            rename[name] = given
        elif name not in globals_:
            raise TrainingSpecError(
                f"{where}: input {k} of graph {callee.name!r} ({name!r}) is not given and is not a global "
                "initializer to fall back to; pass a tensor in that position"
            )
    produced = {o for n in callee.node for o in n.output if o}
    bound: dict[str, str] = {}  # callee output -> call output, for outputs a node produces
    extra: list[tuple[str, str]] = []  # (callee tensor, call output) needing an Identity
    for name, target in zip(outputs, call.output):
        if not target:
            continue
        if name in produced and name not in bound:
            bound[name] = target
        else:
            extra.append((name, target))
    scope = call.name or "GraphCall"
    for n in callee.node:
        for o in n.output:
            if o:
                rename[o] = bound.get(o) or fresh_name(taken, f"{scope}/{o}")
    nodes = []
    for n in callee.node:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        c.name = fresh_name(taken, f"{scope}/{n.name or n.op_type}")
        for k, i in enumerate(c.input):
            if i:
                c.input[k] = rename.get(i, i)
        for k, o in enumerate(c.output):
            if o:
                c.output[k] = rename[o]
        for sg in subgraphs(c):
            rename_outer_reads(sg, rename)
        nodes.append(c)
    for name, target in extra:
        nodes.append(helper.make_node("Identity", [rename.get(name, name)], [target],
                                      name=fresh_name(taken, f"{scope}/out")))
    return nodes


def inline_graph_calls(model: onnx.ModelProto, ctx: LoweringContext) -> bool:
    """Replace every GraphCall node of every training graph by a copy of the inference graph."""
    taken = ctx.taken
    changed = False
    for ti in model.training_info:
        for field in ("initialization", "algorithm"):
            graph = getattr(ti, field)
            if not any(is_graph_call(n) for n in graph.node):
                continue
            nodes = []
            for n in graph.node:
                if not is_graph_call(n):
                    nodes.append(n)
                    continue
                name = _graph_name(n)
                if name != model.graph.name:
                    raise TrainingSpecError(
                        f"GraphCall node {n.name!r} in TrainingInfoProto.{field}: graph_name {name!r} does not "
                        f"name the inference graph {model.graph.name!r}, the only graph a GraphCall can call"
                    )
                new = inline_call(n, model.graph, taken)
                ctx.added.update(m.name for m in new)
                nodes.extend(new)
            set_nodes(graph, nodes)
            changed = True
    return changed
