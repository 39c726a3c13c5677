"""One rewriting mechanism for the passes that replace single nodes by standard-op forms.

A ``Rule`` is pattern + condition + replacement (as onnxscript's rewriter writes them): an op of a domain (the
default one unless said; from a default-domain opset on), a condition on the node in its graph, and a function
that emits the replacement through the same builder gradient rules use (``g.Mul(...)``), returning one tensor
per output of the node. The replacement's results take the node's output names, so nothing downstream changes.
``apply_rules`` runs a rule set over every top graph of a model (the inference graph and each training
algorithm, which reads the inference graph's tensors). Users: ``runtimes/targets.py`` (the forms of ops a
runtime lacks), ``passes/loss_forms.py`` (SoftmaxCrossEntropyLoss split for memory), ``passes/step_quirks.py``
(a runtime's wrong answers avoided) and ``check/contrib_forms.py`` (onnxruntime's contrib ops in standard ops,
a float64 reference). The engine's peephole works on the nodes it has just emitted, before they are a graph,
and stays beside the reverse walk (``engine/peephole.py``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx

from ..engine.builder import Emitter, GradBuilder
from ..graph import GraphView, infer_tensor_info, normalize_domain, opset_map, set_nodes, top_graphs


class Facts:
    """What a rule's condition may ask of a node's graph: declared ranks and shapes first (cheap), the
    model's shape inference when they say nothing (made once, on the first such question); ``memo`` keeps
    what a rule set computes once per graph."""

    def __init__(self, model: onnx.ModelProto, graph: onnx.GraphProto):
        self.model, self.graph = model, graph
        self.memo: dict = {}
        self._declared = {vi.name: vi for vi in list(graph.input) + list(graph.output) + list(graph.value_info)}
        if graph is not model.graph:
            self._declared.update({vi.name: vi for vi in list(model.graph.input) + list(model.graph.value_info)
                                   + list(model.graph.output)})
        self._view: GraphView | None = None
        self._bare: GraphView | None = None

    @property
    def bare(self) -> GraphView:
        """The graph's nodes and the model's opsets without tensor info: for a rule that only emits."""
        if self._bare is None:
            self._bare = GraphView(self.graph.node, {}, opset_map(self.model))
        return self._bare

    @property
    def view(self) -> GraphView:
        if self._view is None:
            both = combined(self.model, self.graph)
            g = both.graph
            self._view = GraphView(self.graph.node, infer_tensor_info(both), opset_map(self.model),
                                   [i.name for i in g.input], [], {t.name: t for t in g.initializer})
        return self._view

    def shape(self, name: str) -> tuple | None:
        vi = self._declared.get(name)
        tt = vi.type.tensor_type if vi is not None else None
        if tt is not None and tt.HasField("shape"):
            return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
        return self.view.shape(name)

    def rank(self, name: str) -> int | None:
        s = self.shape(name)
        return None if s is None else len(s)


@dataclass(frozen=True)
class Rule:
    """Replace each ``op`` node of ``domain`` (default-domain opset >= ``since``) for which ``when(node, facts,
    ctx)`` holds by what ``build(g, node, facts, ctx)`` emits: one tensor name per output of the node (None for
    an output it leaves unwritten). ``typed``: whether ``build`` asks the builder for types, shapes or values
    (``g.dtype``, ``g.shape``, ``g.const(like=...)``, ...); a rule that only emits ops on the node's inputs says
    False, and its graph is then not run through shape inference for it (a training step's 5,600 nodes)."""

    op: str
    build: Callable
    when: Callable = lambda node, facts, ctx: True
    since: int = 1
    domain: str = ""
    typed: bool = True


def combined(model: onnx.ModelProto, graph: onnx.GraphProto) -> onnx.ModelProto:
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


def apply_rules(model: onnx.ModelProto, rules, ctx, scope: str) -> bool:
    """Rewrite every top graph of ``model`` in place with ``rules`` (each node by the first rule that takes
    it); new names are fresh against ``ctx.taken`` and recorded in ``ctx.added``. Returns whether a node
    changed. ``scope``: the name part new nodes get (``<node>/<scope>/...``)."""
    opset = opset_map(model).get("", 0)
    by_op: dict[tuple[str, str], list[Rule]] = {}
    for r in rules:
        if opset >= r.since:
            by_op.setdefault((r.domain, r.op), []).append(r)
    ops = {op for _, op in by_op}  # most nodes' op is none of these: their domain is not read
    changed = False
    for graph in list(top_graphs(model)):
        if not any(n.op_type in ops and (normalize_domain(n.domain), n.op_type) in by_op for n in graph.node[:]):
            continue
        facts = Facts(model, graph)
        nodes, hit = [], False
        for n in graph.node[:]:
            op = n.op_type
            candidates = by_op.get((normalize_domain(n.domain), op)) if op in ops else None
            rule = next((r for r in candidates if r.when(n, facts, ctx)), None) if candidates else None
            if rule is None:
                nodes.append(n)
                continue
            em = Emitter(facts.view if rule.typed else facts.bare, ctx.taken, getattr(ctx, "target", None))
            new = replacement(em, n, scope, rule.build, facts, ctx)
            ctx.added.update(m.name for m in new)
            nodes.extend(new)
            hit = True
        if hit:
            set_nodes(graph, nodes)
            changed = True
    return changed


def replacement(em: Emitter, node: onnx.NodeProto, scope: str, build: Callable, *args) -> list[onnx.NodeProto]:
    """The nodes ``build(g, node, *args)`` emits into ``em`` for ``node`` (names under ``<node>/<scope>``), the
    tensors it returns (one per output of the node, None for one it leaves unwritten) renamed to the node's
    outputs."""
    first = len(em.nodes)
    results = build(GradBuilder(em, f"{node.name or node.op_type}/{scope}"), node, *args)
    rename = {r: o for r, o in zip(results, node.output) if o and r}
    new = em.nodes[first:]
    for m in new:
        m.output[:] = [rename.get(o, o) for o in m.output]
        m.input[:] = [rename.get(i, i) for i in m.input]
    return new


__all__ = ["Rule", "Facts", "apply_rules", "combined", "replacement"]
