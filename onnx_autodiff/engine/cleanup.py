"""Clean-up of emitted nodes: identity Transposes, common subexpressions, pass-through Identities, dead nodes.

An identity Transpose (``perm`` 0, 1, ..., r-1) is never left in what we emit: it copies its input for
nothing, and onnxruntime's GemmTransposeFusion folds ``perm=[0, 1]`` into a Gemm as if it were ``[1, 0]``
(microsoft/onnxruntime#32228, since 1.20.1). It becomes an Identity, which the Identity folding then drops.

``cleanup_nodes`` works on one lowering's node list before it enters the graph (nothing outside reads
its tensors but the names in ``keep``); ``cleanup`` does the same inside a graph, touching only the
nodes named in ``added`` so the user's own nodes stay as they are.
"""
from __future__ import annotations

from collections import Counter
from itertools import chain

import onnx

from ..graph import has_subgraph, node_inputs, set_nodes

_IMPURE = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
           "Dropout", "Bernoulli"}


def _attr_key(node: onnx.NodeProto, attr_keys: dict) -> tuple | None:
    """The node's serialized attributes, or None when one is a subgraph (If/Loop/Scan are never merged);
    cached by node in ``attr_keys`` (a node's attributes do not change during clean-up, its inputs may)."""
    if not node.attribute:
        return ()  # most nodes: nothing to serialize or cache
    if id(node) not in attr_keys:
        attr_keys[id(node)] = None if has_subgraph(node) else tuple(
            (a.name, a.SerializeToString(deterministic=True)) for a in node.attribute[:])
    return attr_keys[id(node)]


def _all(node) -> bool:
    return True


def cse(nodes: list[onnx.NodeProto], keep: set[str], removable=_all, attr_keys: dict | None = None,
        reads: dict[int, list[str]] | None = None) -> list[onnx.NodeProto]:
    """Merge a node into an earlier one with the same op, inputs and attributes. ``reads``: filled with each
    kept node's ``node_inputs`` by node id, from the inputs this loop reads anyway."""
    attr_keys = {} if attr_keys is None else attr_keys
    reads = {} if reads is None else reads
    seen: dict[tuple, onnx.NodeProto] = {}
    alias: dict[str, str] = {}
    out = []
    for node in nodes:
        ins = node.input[:]  # [:]: see graph.py's docstring
        if alias and not alias.keys().isdisjoint(ins):
            for k, i in enumerate(ins):
                if i in alias:
                    node.input[k] = ins[k] = alias[i]
        attrs = None if node.op_type in _IMPURE else _attr_key(node, attr_keys)
        if attrs is None:
            reads[id(node)] = node_inputs(node)
            out.append(node)
            continue
        key = node.op_type, node.domain, tuple(ins), attrs
        first = seen.get(key)
        if (first is not None and len(first.output) == len(node.output) and not keep.intersection(node.output)
                and removable(node)):
            alias.update({o: f for o, f in zip(node.output, first.output) if o})
            continue
        seen.setdefault(key, node)
        reads[id(node)] = [i for i in ins if i]  # a key's node has no subgraph: its node_inputs
        out.append(node)
    return out


def _cse_key(node: onnx.NodeProto, attr_keys: dict) -> tuple | None:
    """The key ``cse`` compares the node by (its inputs as they stand), or None when it is never merged."""
    attrs = None if node.op_type in _IMPURE else _attr_key(node, attr_keys)
    return None if attrs is None else (node.op_type, node.domain, tuple(node.input[:]), attrs)


def merges_into(earlier: list[onnx.NodeProto], later: list[onnx.NodeProto]) -> bool:
    """Whether a node of ``later`` has the CSE key of a node of ``earlier`` (so ``cse`` of the two lists
    together could merge it): for ``later`` nodes that are a clean-up fixed point among themselves."""
    attr_keys: dict = {}
    ops = {n.op_type for n in earlier}
    keys = {k for n in earlier if (k := _cse_key(n, attr_keys)) is not None}
    return any(n.op_type in ops and _cse_key(n, attr_keys) in keys for n in later)


def fold_identities(nodes: list[onnx.NodeProto], keep: set[str], reads: dict[int, list[str]], removable=_all
                    ) -> list[onnx.NodeProto]:
    """Drop ``Identity(a) -> b`` where a is produced here and read once: its producer writes b.
    ``reads``: each node's ``node_inputs``, by node id."""
    producer = {o: n for n in nodes for o in n.output[:] if o}
    uses = Counter(chain.from_iterable(reads[id(n)] for n in nodes))
    drop = set()
    for n in nodes:
        if n.op_type != "Identity" or not removable(n):
            continue
        src, dst = n.input[0], n.output[0]
        p = producer.get(src)
        if p is None or not removable(p) or uses.get(src, 0) != 1 or src in keep:
            continue
        for k, o in enumerate(p.output):
            if o == src:
                p.output[k] = dst
        producer[dst] = p
        drop.add(id(n))
    return [n for n in nodes if id(n) not in drop] if drop else nodes


def eliminate_dead(nodes: list[onnx.NodeProto], keep: set[str], reads: dict[int, list[str]], removable=_all
                   ) -> list[onnx.NodeProto]:
    """Remove nodes none of whose outputs is read (``keep`` counts as read); ``reads`` as for
    ``fold_identities``."""
    live = set(keep)
    live.discard("")  # an empty output name is no tensor: it never keeps a node
    out = []
    for node in reversed(nodes):
        if live.isdisjoint(node.output[:]) and removable(node):  # most nodes are live: removable() asked less
            continue
        live.update(reads[id(node)])
        out.append(node)
    out.reverse()
    return out


def identity_perm(node: onnx.NodeProto) -> bool:
    """A default-domain Transpose whose ``perm`` keeps every axis in place."""
    if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return False
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
    return perm is not None and perm == list(range(len(perm)))


def identity_transposes_as_identities(nodes: list[onnx.NodeProto], removable=_all) -> int:
    """Each removable identity Transpose rewritten in place as an Identity (same name, input, output);
    how many were."""
    count = 0
    for n in nodes:
        if identity_perm(n) and removable(n):
            n.op_type = "Identity"
            del n.attribute[:]
            count += 1
    return count


def cleanup_nodes(nodes: list[onnx.NodeProto], keep: set[str], removable=_all) -> list[onnx.NodeProto]:
    """Identity Transposes as Identities, then CSE, Identity folding and dead-node removal, to a fixed point.

    A round in which CSE merged nothing and no node was dead reaches it, whatever Identities it folded:
    folding renames producers' outputs, never a node's inputs, so another round's CSE would see the keys
    this one saw, its Identity folding the same use counts (one pass already follows chains of
    Identities), and its dead-node removal the list this one kept whole. That round is not run."""
    attr_keys: dict = {}  # the nodes outlive this call's loop, so their ids stay unique
    identity_transposes_as_identities(nodes, removable)
    while True:
        reads: dict[int, list[str]] = {}  # inputs change only in CSE: its read serves folding and dead nodes
        merged = cse(nodes, keep, removable, attr_keys, reads)
        folded = fold_identities(merged, keep, reads, removable)
        live = eliminate_dead(folded, keep, reads, removable)
        if len(merged) == len(nodes) and len(live) == len(folded):
            return live
        nodes = live


def cleanup(graph: onnx.GraphProto, added: set[str], keep=frozenset()) -> bool:
    """``cleanup_nodes`` inside a graph, removing only the nodes named in ``added``; graph outputs
    and ``keep`` stay. Returns whether the graph changed."""
    nodes = list(graph.node)
    rewritten = identity_transposes_as_identities(nodes, lambda n: n.name in added)
    new = cleanup_nodes(nodes, set(keep) | {o.name for o in graph.output}, lambda n: n.name in added)
    if len(new) == len(nodes):
        return rewritten > 0
    set_nodes(graph, new)
    return True
