"""The ground floor: a light read-only view over an ONNX graph (producers, consumers, types and shapes,
opsets) and the graph utilities every other module shares (walking graphs and subgraphs, outer-scope
reads, reachability, names); tensor types and shape inference are ``tensor_info.py``'s (re-exported here).
It imports nothing of ours but that.

The per-node loops read repeated fields as ``field[:]``, a list made in one call: iterating a upb
repeated field directly ends every loop in a formatted IndexError (the field has no ``__iter__``), which
was 7% of the instructions of lowering a 1,000-node chain (callgrind)."""
from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import chain

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .tensor_info import (  # noqa: F401 (re-exported: the names every module reads from graph)
    STAND_IN_LOADERS,
    STAND_INS,
    TensorInfo,
    attr_value,
    decoded,
    infer_tensor_info,
    info_from_type,
    normalize_domain,
    opset_map,
    with_stand_ins,
)

FLOAT_TYPES = frozenset(
    {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
)
TRAINING_DOMAINS = ("ai.onnx.preview.training", "ai.onnx.training")
MAX_IR_VERSION = 13  # the newest IR version stock onnxruntime (1.31) loads
_GRAPH, _GRAPHS = onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS
_NESTED = (_GRAPH, _GRAPHS)  # the attribute types that carry subgraphs


class GraphView:
    """Producers, consumers and tensor info of one graph, with the model's opsets."""

    def __init__(self, nodes, info: dict[str, TensorInfo], opsets: dict[str, int],
                 graph_inputs=(), graph_outputs=(), initializers=()):
        """``initializers``: names, or a name -> TensorProto mapping (then their values are known)."""
        self.nodes = list(nodes)
        self.info = info
        self.opsets = opsets
        self.graph_inputs = list(graph_inputs)
        self.graph_outputs = list(graph_outputs)
        self.initializers = set(initializers)
        self._init_protos = dict(initializers) if isinstance(initializers, dict) else {}
        self._ancestors: dict[tuple, list[onnx.NodeProto]] = {}

    # the two indices are made on first use: a view that only emits (a rewrite rule's bare view of a 20k-node
    # step) never reads them
    @cached_property
    def producer(self) -> dict[str, onnx.NodeProto]:
        producer = {}
        for node in self.nodes:
            for o in node.output[:]:
                if o:
                    producer[o] = node
        return producer

    @cached_property
    def consumers(self) -> dict[str, list[onnx.NodeProto]]:
        consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.nodes:
            for i in node.input[:]:
                if i:
                    consumers.setdefault(i, []).append(node)
        return consumers

    @classmethod
    def of_model(cls, model: onnx.ModelProto) -> GraphView:
        g = model.graph
        return cls(
            g.node,
            infer_tensor_info(model),
            opset_map(model),
            [i.name for i in g.input],
            [o.name for o in g.output],
            {t.name: t for t in g.initializer},
        )

    def opset(self, domain: str = "") -> int:
        return self.opsets.get(normalize_domain(domain), 0)

    def dtype(self, name: str) -> int | None:
        i = self.info.get(name)
        return i.dtype if i else None

    def shape(self, name: str) -> tuple | None:
        i = self.info.get(name)
        return i.shape if i else None

    def value(self, name: str):
        """The numpy value of a constant tensor (a Constant node or an initializer that is not an
        input, with its bytes in the model), else None."""
        node = self.producer.get(name)
        if node is not None:
            if node.op_type == "Constant" and normalize_domain(node.domain) == "":
                for a in node.attribute:
                    if a.name == "value":
                        return numpy_helper.to_array(a.t)
                    if a.name in ("value_int", "value_float"):
                        return np.array(a.i if a.name == "value_int" else a.f)
                    if a.name in ("value_ints", "value_floats"):
                        return np.array(list(a.ints) if a.name == "value_ints" else list(a.floats))
            return None
        t = self._init_protos.get(name)
        if t is not None and name not in self.graph_inputs and t.data_location != onnx.TensorProto.EXTERNAL:
            return numpy_helper.to_array(t)
        return None  # a tensor whose bytes live elsewhere (a light model's weights) is no constant we can read

    def ancestors(self, of: str | Iterable[str], stop: Iterable[str] = ()) -> list[onnx.NodeProto]:
        """``ancestors(self.nodes, of, stop)`` on the view's producer index, remembered per request: preparing
        a Gradient's path and differentiating it ask the same (a walk of the whole graph each)."""
        key = ((of,) if isinstance(of, str) else tuple(of), frozenset(stop))
        found = self._ancestors.get(key)
        if found is None:
            found = self._ancestors[key] = ancestors(self.nodes, of, stop, self.producer)
        return list(found)

    def known(self, name: str) -> bool:
        return name in self.producer or name in self.initializers or name in self.graph_inputs


def is_topological(nodes) -> bool:
    """Whether no node reads a tensor that a later node produces."""
    outputs = [n.output[:] for n in nodes]  # read once: each read converts the strings
    produced_later = set(chain.from_iterable(outputs))
    produced_later.discard("")  # an empty name is no tensor: then a node's empty inputs need no filtering
    for n, outs in zip(nodes, outputs):
        produced_later.difference_update(outs)
        if not produced_later.isdisjoint(node_inputs(n) if n.attribute else n.input[:]):
            return False
    return True


def topological_sort(nodes, available=()) -> list[onnx.NodeProto]:
    """Kahn's algorithm keeping the given order where the data allows it (stable)."""
    if is_topological(nodes):
        return list(nodes)
    producer = {}
    for idx, n in enumerate(nodes):
        for o in n.output:
            if o:
                producer[o] = idx
    deps = []
    users: dict[int, list[int]] = {}
    for idx, n in enumerate(nodes):
        d = {producer[i] for i in node_inputs(n) if i in producer and producer[i] != idx}
        deps.append(len(d))
        for p in d:
            users.setdefault(p, []).append(idx)
    ready = [i for i, c in enumerate(deps) if c == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(nodes[i])
        for u in users.get(i, []):
            deps[u] -= 1
            if deps[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(nodes):
        stuck = [nodes[i].name or nodes[i].op_type for i, c in enumerate(deps) if c > 0]
        raise ValueError(f"the graph has a cycle through nodes {stuck[:5]}")
    return order


def float_parameters(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    """(float graph inputs that are not initializers, float initializers), in model order."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    inputs = [i.name for i in g.input if i.name not in inits and i.type.tensor_type.elem_type in FLOAT_TYPES]
    return inputs, [t.name for t in g.initializer if t.data_type in FLOAT_TYPES]


def model_shell(model: onnx.ModelProto, doc_string: bool = False) -> onnx.ModelProto:
    """A new ModelProto with ``model``'s header fields, opset imports and functions, and no graph."""
    m = onnx.ModelProto()
    fields = ("ir_version", "producer_name", "producer_version", "domain", "model_version")
    for f in fields + (("doc_string",) if doc_string else ()):
        if model.HasField(f):
            setattr(m, f, getattr(model, f))
    m.opset_import.extend(model.opset_import)
    m.functions.extend(model.functions)
    return m


def node_inputs(node: onnx.NodeProto) -> list[str]:
    """A node's inputs plus the outer-scope names its subgraphs (If/Loop/Scan bodies) read."""
    names = [i for i in node.input[:] if i]
    if node.attribute:  # most nodes have none: no subgraph to look into
        for sg in subgraphs(node):
            names.extend(outer_names(sg))
    return names


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs a node carries as attributes (If branches, Loop/Scan bodies)."""
    if not node.attribute:
        return []  # most nodes: skip making the iterator
    out = []
    for a in node.attribute[:]:
        if a.type == _GRAPH:
            out.append(a.g)
        elif a.type == _GRAPHS:
            out.extend(a.graphs)
    return out


def has_subgraph(node: onnx.NodeProto) -> bool:
    return bool(node.attribute) and any(a.type in _NESTED for a in node.attribute[:])


def outer_names(graph: onnx.GraphProto) -> list[str]:
    """The outer-scope tensors a subgraph reads (its nodes, nested bodies and outputs), in first-use order."""
    local = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    out: list[str] = []
    seen: set[str] = set()
    for n in graph.node:
        for i in node_inputs(n):
            if i not in local and i not in seen:
                seen.add(i)
                out.append(i)
        local.update(o for o in n.output if o)
    out.extend(o.name for o in graph.output if o.name not in local and o.name not in seen)
    return out


def implicit_inputs(node: onnx.NodeProto) -> list[str]:
    """``node.input`` (empty names kept, so positions hold) followed by the outer-scope names its
    subgraphs read that are not already inputs."""
    names = node.input[:]
    if has_subgraph(node):
        seen = set(names)
        for n in node_inputs(node):
            if n not in seen:
                seen.add(n)
                names.append(n)
    return names


def top_graphs(model: onnx.ModelProto) -> Iterator[onnx.GraphProto]:
    """The graphs that hold initializers: the inference graph and every training graph."""
    yield model.graph
    for ti in model.training_info:
        yield ti.initialization
        yield ti.algorithm


def walk_graph(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph nested in its nodes, outermost first."""
    yield graph
    for n in graph.node:
        if n.attribute:  # most nodes have none
            for sg in subgraphs(n):
                yield from walk_graph(sg)


@dataclass(frozen=True)
class Nested:
    """A graph and where it sits: ``path`` is ``""`` for ``graph`` itself, else ``<path of the owner's graph>/``
    ``<owner node>/<attribute>`` (``[k]`` after a graphs attribute); ``owner`` is the node carrying it."""

    path: str
    graph: onnx.GraphProto
    owner: onnx.NodeProto | None = None
    attribute: str = ""


def nested_graphs(graph: onnx.GraphProto, path: str = "", owner=None, attribute: str = "") -> Iterator[Nested]:
    """``graph`` and every subgraph nested in its nodes, outermost first, each with its path."""
    yield Nested(path, graph, owner, attribute)
    for n in graph.node:
        for a in n.attribute[:]:
            inner = [a.g] if a.type == _GRAPH else list(a.graphs) if a.type == _GRAPHS else []
            for k, sg in enumerate(inner):
                tag = a.name if a.type == _GRAPH else f"{a.name}[{k}]"
                yield from nested_graphs(sg, f"{path}/{n.name}/{tag}" if path else f"{n.name}/{tag}", n, tag)


def walk_graphs(model: onnx.ModelProto) -> Iterator[onnx.GraphProto]:
    """Every graph of a model: the inference graph, the training graphs, and all their subgraphs."""
    for top in top_graphs(model):
        yield from walk_graph(top)


def rename_outer_reads(graph: onnx.GraphProto, rename: dict[str, str]) -> None:
    """Rename, in place, the outer-scope names a subgraph (and the subgraphs inside it) reads; the
    subgraph's own inputs, initializers and node outputs shadow them."""
    local = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    for n in graph.node:
        for k, i in enumerate(n.input):
            if i and i not in local and i in rename:
                n.input[k] = rename[i]
        inner = {k: v for k, v in rename.items() if k not in local}
        for sg in subgraphs(n):
            rename_outer_reads(sg, inner)
        local.update(o for o in n.output if o)
    for o in graph.output:
        if o.name not in local and o.name in rename:
            o.name = rename[o.name]


def ancestors(nodes: Sequence[onnx.NodeProto], of: str | Iterable[str], stop: Iterable[str] = (),
              producer: dict[str, onnx.NodeProto] | None = None) -> list[onnx.NodeProto]:
    """The nodes the tensors ``of`` depend on (through inputs and subgraph reads), not looking past the
    ``stop`` tensors, in the given order. ``producer``: tensor -> the node of ``nodes`` writing it (the last
    one), when the caller has that index already."""
    if producer is None:
        producer = {o: n for n in nodes for o in n.output[:] if o}
    cut = set(stop)
    keep: set[int] = set()
    stack = [of] if isinstance(of, str) else list(of)
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen or name in cut:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is None or id(node) in keep:
            continue
        keep.add(id(node))
        stack.extend(node_inputs(node))
    return [n for n in nodes if id(n) in keep]


def descendants(nodes: Sequence[onnx.NodeProto], of: Iterable[str],
                carries: Callable[[str], bool] = lambda name: True,
                passes: Callable[[onnx.NodeProto], bool] = lambda node: True
                ) -> tuple[list[onnx.NodeProto], set[str]]:
    """The nodes (topologically ordered ``nodes``) that read a tensor reachable from ``of``, and the set
    of reachable tensors. Only tensors for which ``carries(name)`` holds are reachable, and only through
    nodes for which ``passes(node)`` holds."""
    reach = {x for x in of if carries(x)}
    out = []
    for n in nodes:
        if reach.isdisjoint(node_inputs(n)) or not passes(n):
            continue
        out.append(n)
        reach.update(o for o in n.output[:] if o and carries(o))
    return out, reach


def used_names(model: onnx.ModelProto) -> set[str]:
    """Every tensor and node name in the model, its subgraphs and its training graphs."""
    names: set[str] = set()
    for g in walk_graphs(model):  # tensor_names with the node names read on the same walk
        _graph_tensor_names(g, names)
        for n in g.node[:]:
            names.update(n.input[:])
            names.update(n.output[:])
            names.add(n.name)
    names.discard("")
    return names


def fresh_name(taken: set[str], base: str) -> str:
    """``base``, or ``base_<k>`` for the first k not in ``taken``; the name is added to ``taken``."""
    name, k = base, 0
    while name in taken:
        name = f"{base}_{k}"
        k += 1
    taken.add(name)
    return name


def name_nodes(model: onnx.ModelProto, ctx=None) -> bool:
    """Name each unnamed (or duplicate-named) node ``<op_type>_<k>`` (rules scope the nodes they emit
    under it). ``ctx``: a pipeline's LoweringContext, whose ``taken`` names the new names join."""
    names = [n.name for g in walk_graphs(model) for n in g.node]
    if all(names) and len(set(names)) == len(names):
        return False
    taken = used_names(model) if ctx is None else ctx.taken
    seen: set[str] = set()
    changed = False
    counter = 0
    for g in walk_graphs(model):
        for n in g.node:
            if n.name and n.name not in seen:
                seen.add(n.name)
                continue
            while f"{n.op_type}_{counter}" in taken:
                counter += 1
            n.name = f"{n.op_type}_{counter}"
            taken.add(n.name)
            seen.add(n.name)
            changed = True
    return changed


def set_nodes(graph: onnx.GraphProto, nodes: Iterable[onnx.NodeProto]) -> None:
    """Replace a graph's node list. ``nodes`` may be the graph's own messages: a message deleted from a
    repeated field stays readable, and ``extend`` copies each into the graph (one copy, not two)."""
    nodes = list(nodes)
    del graph.node[:]
    graph.node.extend(nodes)


def runtime_ir_version(model: onnx.ModelProto) -> int:
    """An IR version the runtime reads that is still new enough for the model's opsets."""
    need = helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    return max(need, min(model.ir_version or MAX_IR_VERSION, MAX_IR_VERSION))


def used_domains(model: onnx.ModelProto) -> set[str]:
    return {n.domain or "" for g in walk_graphs(model) for n in g.node}


def strip_trailing_empty(model: onnx.ModelProto) -> bool:
    """Drop empty trailing optional inputs (``ReduceSum(x, "")``, ``Gemm(a, b, "")``): some
    runtimes (OpenVINO, tract) read an empty name as a tensor of unknown rank, or count it as an input."""
    return _portable_scan(model)[2]


def _portable_scan(model: onnx.ModelProto) -> tuple[list[onnx.NodeProto], set[str], bool]:
    """One walk for ``make_portable``: every node of every graph in ``walk_graphs`` order, the tensor names
    (``tensor_names``), and whether an empty trailing input was dropped (``strip_trailing_empty``, done on
    the way: the names it drops are empty, so the tensor names are the same before and after)."""
    nodes: list[onnx.NodeProto] = []
    names: set[str] = set()
    stripped = False
    for g in walk_graphs(model):
        _graph_tensor_names(g, names)
        for n in g.node[:]:
            ins = n.input[:]
            if ins and not ins[-1] and not has_subgraph(n):  # Loop / If / Scan: positions bind to their bodies
                while len(n.input) and not n.input[-1]:
                    n.input.pop()
                stripped = True
            names.update(ins)
            names.update(n.output[:])
            nodes.append(n)
    names.discard("")
    return nodes, names, stripped


def _graph_tensor_names(g: onnx.GraphProto, names: set[str]) -> None:
    """The names a graph declares (inputs, outputs, initializers, value infos) added to ``names``."""
    names.update(i.name for i in g.input)
    names.update(o.name for o in g.output)
    names.update(t.name for t in g.initializer)
    names.update(t.values.name for t in g.sparse_initializer)
    names.update(v.name for v in g.value_info)


def tensor_names(model: onnx.ModelProto) -> set[str]:
    """Every tensor name in the model, its subgraphs and its training graphs (node names left out)."""
    names: set[str] = set()
    for g in walk_graphs(model):
        _graph_tensor_names(g, names)
        for n in g.node:
            names.update(n.input[:])
            names.update(n.output[:])
    names.discard("")
    return names


def _dot_prefixes(names: set[str]) -> set[str]:
    """Each non-empty prefix of a name of ``names`` that a dot follows (``a.b.c``: ``a``, ``a.b``). Walked from
    the longest: a prefix already found had its own prefixes added then (``a.b.c`` after ``a.b.d``: one)."""
    out: set[str] = set()
    for name in names:
        k = name.rfind(".")
        while k > 0:
            p = name[:k]
            if p in out:
                break
            out.add(p)
            k = name.rfind(".", 0, k)
    return out


def distinct_node_names(model: onnx.ModelProto) -> bool:
    """Give every node a name that no other node has, that is no tensor's name and that no tensor name
    extends with a dot (tract names the nodes it adds ``<node>.bias`` and fails on a duplicate). Nodes
    whose name is already distinct keep it; the others get ``<name>_node`` (made fresh)."""
    nodes = [n for g in walk_graphs(model) for n in g.node]
    return _distinct_names(nodes, tensor_names(model))


def _distinct_names(nodes: list[onnx.NodeProto], tensors: set[str]) -> bool:
    """``distinct_node_names`` given the model's nodes (walk order) and tensor names."""
    taken = tensors | _dot_prefixes(tensors)  # a node name here collides
    seen: set[str] = set()
    changed = False
    for n in nodes:
        name = n.name
        if not name or name in seen or name in taken:
            base = f"{name or n.op_type}_node"
            name, k = base, 0
            while name in seen or name in taken:
                name, k = f"{base}_{k}", k + 1
            n.name = name
            changed = True
        seen.add(name)
    return changed


def make_portable(model: onnx.ModelProto) -> bool:
    """What every model we write gets, whatever runtime reads it: no empty trailing optional
    inputs, and node names distinct from each other and from every tensor name (in place)."""
    nodes, tensors, stripped = _portable_scan(model)
    renamed = _distinct_names(nodes, tensors)
    return stripped or renamed


def finalize(model: onnx.ModelProto) -> None:
    """Drop opset imports no node uses any more, make the graphs portable (``make_portable``) and pick
    an IR version the runtime reads (one walk of the graphs for all three)."""
    nodes, tensors, _ = _portable_scan(model)
    _distinct_names(nodes, tensors)
    domains = {n.domain or "" for n in nodes}
    keep = [o for o in model.opset_import if o.domain in ("", "ai.onnx") or o.domain in domains]
    if not any(o.domain in ("", "ai.onnx") for o in keep):
        keep.append(helper.make_opsetid("", 13))
    del model.opset_import[:]
    model.opset_import.extend(keep)
    model.ir_version = runtime_ir_version(model)


def lift_initializers(model: onnx.ModelProto, names) -> None:
    """Make the named initializers graph inputs too (their values stay as defaults), in place."""
    have = {i.name for i in model.graph.input}
    for t in model.graph.initializer:
        if t.name in names and t.name not in have:
            model.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
