"""Clean-up of the nodes a lowering added: common subexpressions, pass-through Identities, dead nodes.

Only nodes named in ``added`` are removed or merged away; the user's own nodes are left as they are.
"""
from __future__ import annotations

import onnx

from ..graph import node_inputs
from .gradient import set_nodes

_IMPURE = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
           "Dropout", "Bernoulli"}


def _key(node: onnx.NodeProto):
    attrs = tuple(sorted((a.name, a.SerializeToString(deterministic=True)) for a in node.attribute))
    return node.op_type, node.domain, tuple(node.input), attrs


def _rename_inputs(node: onnx.NodeProto, alias: dict[str, str]) -> None:
    for k, i in enumerate(node.input):
        if i in alias:
            node.input[k] = alias[i]


def cse(graph: onnx.GraphProto, added: set[str], keep: set[str]) -> bool:
    """Merge an added node into an earlier node with the same op, inputs and attributes."""
    seen: dict[tuple, onnx.NodeProto] = {}
    alias: dict[str, str] = {}
    out = []
    for node in graph.node:
        _rename_inputs(node, alias)
        has_subgraph = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
        if node.op_type in _IMPURE or has_subgraph:
            out.append(node)
            continue
        key = _key(node)
        first = seen.get(key)
        if (first is not None and node.name in added and len(first.output) == len(node.output)
                and not any(o in keep for o in node.output)):
            alias.update({o: f for o, f in zip(node.output, first.output) if o})
            continue
        seen.setdefault(key, node)
        out.append(node)
    if len(out) != len(graph.node):
        set_nodes(graph, out)
        return True
    return False


def fold_identities(graph: onnx.GraphProto, added: set[str], keep: set[str]) -> bool:
    """Drop an added ``Identity(a) -> b`` by renaming a's added producer to write b directly."""
    producer = {o: n for n in graph.node for o in n.output if o}
    uses: dict[str, int] = {}
    for n in graph.node:
        for i in node_inputs(n):
            uses[i] = uses.get(i, 0) + 1
    drop = set()
    alias: dict[str, str] = {}
    for n in graph.node:
        if n.op_type != "Identity" or n.name not in added:
            continue
        src, dst = n.input[0], n.output[0]
        p = producer.get(src)
        if p is None or p.name not in added or uses.get(src, 0) != 1 or src in keep:
            continue
        for k, o in enumerate(p.output):
            if o == src:
                p.output[k] = dst
        drop.add(n.name)
    if not drop:
        return False
    set_nodes(graph, [n for n in graph.node if n.name not in drop])
    return True


def eliminate_dead(graph: onnx.GraphProto, added: set[str], keep: set[str]) -> bool:
    """Remove added nodes none of whose outputs is used (graph outputs and ``keep`` count as uses)."""
    live = set(keep) | {o.name for o in graph.output}
    out = []
    for node in reversed(list(graph.node)):
        if node.name in added and not any(o in live for o in node.output if o):
            continue
        live.update(node_inputs(node))
        out.append(node)
    if len(out) != len(graph.node):
        set_nodes(graph, reversed(out))
        return True
    return False


def cleanup(graph: onnx.GraphProto, added: set[str], keep: set[str] = frozenset()) -> bool:
    """CSE, Identity folding and dead-node removal over the added nodes, to a fixed point."""
    keep = set(keep) | {o.name for o in graph.output}
    changed = False
    while True:
        step = cse(graph, added, set(keep))
        step |= fold_identities(graph, added, set(keep))
        step |= eliminate_dead(graph, added, set(keep))
        if not step:
            return changed
        changed = True
