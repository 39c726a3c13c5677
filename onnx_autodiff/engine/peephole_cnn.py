"""Rewrites of a lowered training graph's CNN patterns that span the forward and the backward.

A MaxPool whose forward node has no Indices output has its gradient scattered at the Indices of a second
MaxPool the rule emits in the backward (rules never touch the forward's protobufs). That second MaxPool
reads the same input with the same attributes, so it recomputes the forward's pooled values as well: the
forward node can give the Indices itself. ``max_pool_indices_from_forward`` names the backward's Indices as
the forward node's second output and drops the recomputation (its pooled output is read as the forward's).

In onnxruntime on the CPU (1 thread, the small CNN's 2x2/2 pools) the forward's plain MaxPool runs in the
blocked NCHWc layout with a reorder before and after; MaxPool with Indices has no NCHWc kernel, so the
forward's pool and its two reorders are traded for nothing and the backward no longer pools at all
(docs/benchmarks.md, "Issue 38: the CNN's step (third session)"). Memory: the Indices (int64, the pooled
size) live from the forward to the backward, where the recomputation kept the pool's input (float32, the
unpooled size: for a 2x2 window twice the bytes) alive instead.
"""
from __future__ import annotations

import onnx

from ..graph import implicit_inputs, normalize_domain, set_nodes
from .builder import emit_option

# attributes the MaxPool rule copies to its recomputation; storage_order is left at its default (0)
_GEOMETRY = ("kernel_shape", "strides", "pads", "dilations", "ceil_mode", "auto_pad")


def _geometry(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute if a.name in _GEOMETRY}


def _storage_order(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "storage_order"), 0)


def _plain_pool(node: onnx.NodeProto) -> bool:
    return node.op_type == "MaxPool" and normalize_domain(node.domain) == "" and _storage_order(node) == 0


def _key(node: onnx.NodeProto) -> tuple:
    return node.input[0], repr(sorted(_geometry(node).items()))


def max_pool_indices_from_forward(graph: onnx.GraphProto, forward: set[str]) -> bool:
    """In place on ``graph`` (the inference graph followed by its backward): each MaxPool not named in
    ``forward`` that writes Indices and reads the same input with the same geometry as a forward MaxPool
    without Indices (storage order 0 both) is dropped; the forward node writes its Indices, and readers of
    its pooled output read the forward's. Returns whether the graph changed. The emitter option
    ``max_pool_indices_from_forward`` False (``emit_options``) turns it off: tests compare the two forms."""
    if not emit_option("max_pool_indices_from_forward", True):
        return False
    pools = [n for n in graph.node if _plain_pool(n)]
    if not any(n.name not in forward and len(n.output) > 1 and n.output[1] for n in pools):
        return False  # no recomputation writing Indices: nothing to take from the forward (skips the walk below)
    plain = {}
    for n in pools:
        if n.name in forward and (len(n.output) < 2 or not n.output[1]):
            plain.setdefault(_key(n), n)
    # a pooled output read inside a subgraph or as a graph output keeps its recomputation
    fixed = {o.name for o in graph.output} | {i for n in graph.node for i in implicit_inputs(n)[len(n.input):]}
    drop, rename = set(), {}
    for n in pools:
        if n.name in forward or len(n.output) < 2 or not n.output[1] or n.output[0] in fixed:
            continue
        source = plain.pop(_key(n), None)  # one recomputation per forward pool
        if source is None:
            continue
        del source.output[1:]
        source.output.append(n.output[1])
        if n.output[0]:
            rename[n.output[0]] = source.output[0]
        drop.add(id(n))
    if not drop:
        return False
    kept = [n for n in graph.node if id(n) not in drop]
    for n in kept:
        for k, name in enumerate(n.input):
            if name in rename:
                n.input[k] = rename[name]
    set_nodes(graph, kept)
    return True


def drop_unread_max_pool_indices(graph: onnx.GraphProto) -> bool:
    """In place: the Indices output of each MaxPool in ``graph`` that nothing reads (no node, subgraph or graph
    output) is dropped, so an inference model exported from a training model pools without them (the faster
    kernel: onnxruntime's CPU MaxPool with Indices has no NCHWc form). Returns whether a node changed."""
    read = {o.name for o in graph.output} | {i for n in graph.node for i in implicit_inputs(n)}
    changed = False
    for n in graph.node:
        if _plain_pool(n) and len(n.output) > 1 and n.output[1] and n.output[1] not in read:
            del n.output[1:]
            changed = True
    return changed
