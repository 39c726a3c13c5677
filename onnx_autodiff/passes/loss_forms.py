"""SoftmaxCrossEntropyLoss on [N, C] scores as LogSoftmax + NegativeLogLikelihoodLoss.

The two are the operator's own definition (log-softmax along the classes, then the negative log-likelihood
of the targets with the same weights, ``ignore_index`` and reduction), so the loss and ``log_prob`` are the
same values. The reason is memory: onnxruntime has no kernel for SoftmaxCrossEntropyLoss and runs its
function body, which reshapes [N, C] scores to [N, C, 1] and takes LogSoftmax along axis 1, not the last
axis; that LogSoftmax transposes its input and output, so three [N, C] tensors are live beside the scores
where LogSoftmax on the last axis writes only log_prob (measured on [1024, 151936] float scores, a causal
LM's: 1.8 GB against 0.6 GB). The gradient is not affected: its rule reads ``log_prob`` by name, which
LogSoftmax now writes. Scores of any other rank, or of unknown rank, keep the node.
"""
from __future__ import annotations

import onnx
from onnx import helper

from ..graph import fresh_name, normalize_domain, opset_map, top_graphs

_SINCE = 12  # SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss; for [N, C] LogSoftmax(axis=1) is the same at
# every opset (before 13 it coerces to 2-D from the axis on, which for rank 2 is that axis alone)


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    """Tensor name -> rank, from the declared types of every top graph and from Flatten (always rank 2)."""
    ranks: dict[str, int] = {}
    for graph in top_graphs(model):
        for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
            tt = vi.type.tensor_type
            if tt.HasField("shape"):
                ranks[vi.name] = len(tt.shape.dim)
        for node in graph.node:
            if node.op_type == "Flatten" and normalize_domain(node.domain) == "":
                ranks[node.output[0]] = 2
    return ranks


def _split(node: onnx.NodeProto, taken: set[str]) -> list[onnx.NodeProto]:
    base = node.name or "SoftmaxCrossEntropyLoss"
    log_prob = node.output[1] if len(node.output) > 1 and node.output[1] else fresh_name(taken, f"{base}/log_prob")
    lsm = helper.make_node("LogSoftmax", [node.input[0]], [log_prob], name=fresh_name(taken, f"{base}/LogSoftmax"),
                           axis=1)
    nll = helper.make_node("NegativeLogLikelihoodLoss", [log_prob, *node.input[1:]], [node.output[0]],
                           name=fresh_name(taken, f"{base}/NegativeLogLikelihoodLoss"))
    nll.attribute.extend(a for a in node.attribute if a.name in ("reduction", "ignore_index"))
    return [lsm, nll]


def split_cross_entropy(model: onnx.ModelProto, ctx) -> bool:
    """Replace, in place, each default-domain SoftmaxCrossEntropyLoss of a top graph whose scores have rank 2
    by LogSoftmax + NegativeLogLikelihoodLoss (outputs keep their names); a lowering pass."""
    if opset_map(model).get("", 0) < _SINCE:
        return False
    ranks = None
    changed = False
    for graph in top_graphs(model):
        if not any(n.op_type == "SoftmaxCrossEntropyLoss" for n in graph.node):
            continue
        ranks = ranks if ranks is not None else _ranks(model)
        nodes: list[onnx.NodeProto] = []
        for n in graph.node:
            if n.op_type == "SoftmaxCrossEntropyLoss" and normalize_domain(n.domain) == "" \
                    and ranks.get(n.input[0]) == 2:
                parts = _split(n, ctx.taken)
                ctx.added.update(p.name for p in parts)
                nodes.extend(parts)
                changed = True
            else:
                nodes.append(n)
        del graph.node[:]
        graph.node.extend(nodes)
    return changed


__all__ = ["split_cross_entropy"]
