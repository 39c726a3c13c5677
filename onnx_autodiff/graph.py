"""A light read-only view over an ONNX graph: producers, consumers, types and shapes, opsets."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto

from .registry import normalize_domain

FLOAT_TYPES = frozenset(
    {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
)

Dim = "int | str | None"


@dataclass
class TensorInfo:
    dtype: int | None  # onnx elem type, None when unknown
    shape: tuple | None  # dims are int, str (symbolic) or None; None when the rank is unknown


def _info_from_type(tp: onnx.TypeProto) -> TensorInfo:
    if not tp.HasField("tensor_type"):
        return TensorInfo(None, None)
    tt = tp.tensor_type
    dtype = tt.elem_type or None
    if not tt.HasField("shape"):
        return TensorInfo(dtype, None)
    dims = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return TensorInfo(dtype, tuple(dims))


def opset_map(model: onnx.ModelProto) -> dict[str, int]:
    return {normalize_domain(o.domain): o.version for o in model.opset_import}


def infer_tensor_info(model: onnx.ModelProto, graph: onnx.GraphProto | None = None) -> dict[str, TensorInfo]:
    """Types and shapes of every tensor onnx's shape inference can tell (inputs, initializers, values)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(_gradient_as_identity(model), data_prop=True)
    except Exception:  # inference is best effort; what it cannot tell stays unknown
        inferred = model
    g = inferred.graph if graph is None else graph
    info: dict[str, TensorInfo] = {}
    for init in g.initializer:
        info[init.name] = TensorInfo(init.data_type, tuple(init.dims))
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.name not in info or info[vi.name].dtype is None:
            info[vi.name] = _info_from_type(vi.type)
    if graph is None:
        for vi in inferred.graph.value_info:
            info.setdefault(vi.name, _info_from_type(vi.type))
    for node in g.node:
        if node.op_type == "Constant" and normalize_domain(node.domain) == "":
            for a in node.attribute:
                if a.name == "value":
                    info[node.output[0]] = TensorInfo(a.t.data_type, tuple(a.t.dims))
    return info


def _gradient_as_identity(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy where each Gradient node is Identity(input i) -> output i: dy/dx has x's type and
    shape, and onnx has no type inference for Gradient, which would leave everything after it unknown."""
    if not any(n.op_type == "Gradient" for n in model.graph.node):
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    nodes = []
    for n in m.graph.node:
        if n.op_type != "Gradient":
            nodes.append(n)
            continue
        for i, o in zip(n.input, n.output):
            if o:
                nodes.append(onnx.helper.make_node("Identity", [i], [o]))
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


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
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.nodes:
            for o in node.output:
                if o:
                    self.producer[o] = node
            for i in node.input:
                if i:
                    self.consumers.setdefault(i, []).append(node)

    @classmethod
    def of_model(cls, model: onnx.ModelProto) -> "GraphView":
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
        input), else None."""
        from onnx import numpy_helper

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
        if t is not None and name not in self.graph_inputs:
            return numpy_helper.to_array(t)
        return None

    def known(self, name: str) -> bool:
        return name in self.producer or name in self.initializers or name in self.graph_inputs


def is_topological(nodes) -> bool:
    """Whether no node reads a tensor that a later node produces."""
    produced_later = {o for n in nodes for o in n.output if o}
    for n in nodes:
        for o in n.output:
            produced_later.discard(o)
        if any(i in produced_later for i in node_inputs(n)):
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
    import heapq

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
    names = [i for i in node.input if i]
    for a in node.attribute:
        if a.type == _GRAPH:
            names.extend(_outer_names(a.g))
        elif a.type == _GRAPHS:
            for sg in a.graphs:
                names.extend(_outer_names(sg))
    return names


_GRAPH = onnx.AttributeProto.GRAPH
_GRAPHS = onnx.AttributeProto.GRAPHS


def _outer_names(graph: onnx.GraphProto) -> list[str]:
    local = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    outer = []
    for n in graph.node:
        for i in node_inputs(n):
            if i not in local:
                outer.append(i)
        local.update(o for o in n.output if o)
    outer.extend(o.name for o in graph.output if o.name not in local)
    return outer
