"""The standard-op forms we emit where a target (``engine/targets.py``) lacks an op.

``lower(model, target=T)`` ends with ``rewrite_for_target``: each node of an op T lacks that has a
standard form here (``REWRITES``) is replaced by it, outputs keeping their names. ``missing_ops(model, T)``
lists the nodes whose op T lacks, before anything is built (``check --target``).
"""
from __future__ import annotations

import numpy as np
import onnx

from ..engine.builder import Emitter, GradBuilder
from ..engine.targets import Target, get_target
from ..errors import TargetError
from ..graph import GraphView, infer_tensor_info, normalize_domain, opset_map, set_nodes, top_graphs, walk_graph

# ---- the standard-op forms ------------------------------------------------------------------------

def _nll(g: GradBuilder, node: onnx.NodeProto, lp: str) -> str:
    """NegativeLogLikelihoodLoss of log-probabilities ``lp`` [N, C, d...]: -w[t] * lp[t] picked by a mask
    of the targets, reduced as the node says ('mean' divides by the weights of the kept targets)."""
    target = node.input[1]
    weights = node.input[2] if len(node.input) > 2 and node.input[2] else None
    rank = g.rank(lp) or (g.rank(target) + 1 if g.rank(target) is not None else None)
    if rank is None:
        raise TargetError(f"node {node.name!r} ({node.op_type}): its standard form needs the rank of {lp!r}")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    t = g.Cast(target, to=onnx.TensorProto.INT64)
    count = g.Gather(g.Shape(lp), g.ints([1]), axis=0)
    classes = g.Range(g.const(0, dtype=np.int64), g.Squeeze(count), g.const(1, dtype=np.int64))
    classes = g.unsqueeze(classes, list(range(1, rank - 1)))  # (C, 1, ...)
    hit = g.Equal(g.unsqueeze(t, [1]), classes)
    if "ignore_index" in attrs:
        kept = g.Not(g.Equal(t, g.const(int(attrs["ignore_index"]), dtype=np.int64)))
        hit = g.And(hit, g.unsqueeze(kept, [1]))
    one = g.const(1.0, like=lp)
    zero = g.const(0.0, like=lp)
    on = one if weights is None else g.unsqueeze(weights, [0] + list(range(2, rank)))
    w = g.Where(hit, on, zero)
    picked = g.reduce_sum(g.Where(hit, g.Mul(lp, on), zero), [1], keepdims=False)
    loss = g.Neg(picked)
    reduction = attrs.get("reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if reduction == "none":
        return loss
    total = g.reduce_sum(loss, None, keepdims=False)
    return total if reduction == "sum" else g.Div(total, g.reduce_sum(w, None, keepdims=False))


def _log_softmax(g: GradBuilder, node: onnx.NodeProto, x: str) -> str:
    rank = g.rank(x)
    if g.opset >= 13 or rank == 2:
        return g.LogSoftmax(x, axis=1)
    if rank is None:
        raise TargetError(f"node {node.name!r} (SoftmaxCrossEntropyLoss): its standard form below opset 13 "
                          f"needs the rank of {x!r}")
    last = [0] + list(range(2, rank)) + [1]
    back = [0, rank - 1] + list(range(1, rank - 1))
    return g.Transpose(g.LogSoftmax(g.Transpose(x, perm=last), axis=rank - 1), perm=back)


def _softmax_cross_entropy(g: GradBuilder, node: onnx.NodeProto) -> list[str]:
    lp = _log_softmax(g, node, node.input[0])
    return [_nll(g, node, lp), lp]


def _negative_log_likelihood(g: GradBuilder, node: onnx.NodeProto) -> list[str]:
    return [_nll(g, node, node.input[0])]


def _max_unpool(g: GradBuilder, node: onnx.NodeProto) -> list[str]:
    """X scattered at the flat indices I into zeros of the output shape (ScatterElements on the flat
    tensors); needs the output_shape input, which is what our MaxPool gradient gives."""
    if len(node.input) < 3 or not node.input[2]:
        raise TargetError(f"node {node.name!r} (MaxUnpool) has no output_shape input: the target lacks "
                          "MaxUnpool and its standard form needs the output shape")
    x, indices, shape = node.input[0], node.input[1], node.input[2]
    flat = g.ints([-1])
    zero = onnx.numpy_helper.from_array(np.zeros([1], g.np_dtype(x)))
    zeros = g.Reshape(g.op("ConstantOfShape", shape, value=zero), flat)
    scattered = g.op("ScatterElements", zeros, g.Reshape(indices, flat), g.Reshape(x, flat), axis=0)
    return [g.Reshape(scattered, shape)]


def _dropout(g: GradBuilder, node: onnx.NodeProto) -> list[str]:
    """A Dropout that drops nothing (ratio a constant 0, or not in training mode) as Identity, with an
    all-true mask; a training-mode Dropout that drops has no standard form (its random mask is the
    runtime's)."""
    ratio = g.value(node.input[1]) if len(node.input) > 1 and node.input[1] else np.array(0.5)
    training = g.value(node.input[2]) if len(node.input) > 2 and node.input[2] else np.array(False)
    if ratio is None or training is None or (bool(training) and float(ratio) != 0.0):
        raise TargetError(f"node {node.name!r}: a training-mode Dropout (ratio {ratio}) has no standard form; the "
                          f"target lacks it. Export with dropout 0 or in eval mode, or choose another target")
    x = node.input[0]
    outs = [g.Identity(x)]
    if len(node.output) > 1 and node.output[1]:
        true = onnx.numpy_helper.from_array(np.ones([1], np.bool_))
        outs.append(g.op("ConstantOfShape", g.Shape(x), value=true))
    return outs


REWRITES = {
    "Dropout": (12, _dropout),
    "SoftmaxCrossEntropyLoss": (12, _softmax_cross_entropy),
    "NegativeLogLikelihoodLoss": (12, _negative_log_likelihood),
    "MaxUnpool": (11, _max_unpool),
}


def _info_model(model: onnx.ModelProto, graph: onnx.GraphProto) -> onnx.ModelProto:
    """A model whose graph is ``graph`` after the inference graph (a training graph reads its tensors)."""
    m = onnx.ModelProto()
    m.ir_version = model.ir_version
    m.opset_import.extend(model.opset_import)
    m.graph.CopyFrom(model.graph)
    if graph is not model.graph:
        m.graph.node.extend(graph.node)
        m.graph.input.extend(graph.input)
        m.graph.initializer.extend(graph.initializer)
        m.graph.value_info.extend(graph.value_info)
    return m


def _rewrite_graph(model: onnx.ModelProto, graph: onnx.GraphProto, target: Target, taken: set[str]) -> bool:
    opsets = opset_map(model)
    todo = [n for n in graph.node if normalize_domain(n.domain) == "" and n.op_type in target.lacks
            and n.op_type in REWRITES and opsets.get("", 0) >= REWRITES[n.op_type][0]]
    if not todo:
        return False
    both = _info_model(model, graph).graph
    view = GraphView(graph.node, infer_tensor_info(_info_model(model, graph)), opsets,
                     [i.name for i in both.input], [], {t.name: t for t in both.initializer})
    nodes: list[onnx.NodeProto] = []
    for n in graph.node:
        if not any(n is t for t in todo):
            nodes.append(n)
            continue
        em = Emitter(view, taken)
        results = REWRITES[n.op_type][1](GradBuilder(em, f"{n.name or n.op_type}/{target.name}"), n)
        rename = {r: o for r, o in zip(results, n.output) if o}
        for m in em.nodes:
            m.output[:] = [rename.get(o, o) for o in m.output]
            m.input[:] = [rename.get(i, i) for i in m.input]
        nodes.extend(em.nodes)
    set_nodes(graph, nodes)
    return True


def rewrite_for_target(model: onnx.ModelProto, target: str | Target | None, taken: set[str]) -> bool:
    """Replace, in place, each node of an op ``target`` lacks by its standard form (where we have one)."""
    t = get_target(target)
    if not t.lacks:
        return False
    changed = False
    for graph in list(top_graphs(model)):
        changed |= _rewrite_graph(model, graph, t, taken)
    return changed


def missing_ops(model: onnx.ModelProto, target: str | Target | None) -> list[tuple[str, str, bool]]:
    """``(op, node name, rewritten)`` for every node of every graph whose op ``target`` lacks; rewritten:
    whether lowering for the target replaces it by standard ops (then nothing is missing in the result)."""
    t = get_target(target)
    opset = opset_map(model).get("", 0)
    out = []
    for top in top_graphs(model):
        for graph in walk_graph(top):
            for n in graph.node:
                if normalize_domain(n.domain) == "" and n.op_type in t.lacks:
                    since = REWRITES.get(n.op_type, (None,))[0]
                    out.append((n.op_type, n.name, since is not None and opset >= since))
    return out


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
        lines.append(f"{t.name} lacks {op}: needed by node {names} ({what})")
    if not lines:
        lines.append(f"{t.name}: every op of the model is implemented")
    return lines, missing


__all__ = ["target_report", "rewrite_for_target", "missing_ops", "REWRITES"]
