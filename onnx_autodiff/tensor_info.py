"""Tensor types and shapes: ``TensorInfo`` and what onnx's shape inference tells of a model, seeing through the
nodes it has no schema for (``Gradient``, onnxruntime's contrib ops) by their standard-ONNX stand-ins
(``STAND_INS``), with the attribute and domain basics every module reads. The ground floor under ``graph.py``
(which re-exports these names): it imports nothing of ours."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import onnx
from onnx import helper

_DOMAIN_ALIASES = {"ai.onnx": ""}


def normalize_domain(domain: str | None) -> str:
    """The default domain as ``""`` whichever way it is spelled (``""``, ``"ai.onnx"``, None)."""
    return _DOMAIN_ALIASES.get(domain or "", domain or "")


def attr_value(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """The value of a node's attribute (strings decoded to ``str``), or ``default`` when it is absent."""
    for a in node.attribute:
        if a.name == name:
            return decoded(helper.get_attribute_value(a))
    return default


def decoded(value: Any) -> Any:
    """An attribute value with bytes (and lists of bytes) decoded to ``str``."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode() for v in value]
    return value


@dataclass
class TensorInfo:
    dtype: int | None  # onnx elem type, None when unknown
    shape: tuple | None  # dims are int, str (symbolic) or None; None when the rank is unknown


def info_from_type(tp: onnx.TypeProto) -> TensorInfo:
    if not tp.HasField("tensor_type"):
        return TensorInfo(None, None)
    tt = tp.tensor_type
    dtype = tt.elem_type or None
    if not tt.HasField("shape"):
        return TensorInfo(dtype, None)
    dims = []
    for d in tt.shape.dim[:]:
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return TensorInfo(dtype, tuple(dims))


def opset_map(model: onnx.ModelProto) -> dict[str, int]:
    return {normalize_domain(o.domain): o.version for o in model.opset_import}


# Type rules of ops onnx has no schema for (onnxruntime's contrib ops): (domain, op_type) ->
# ``fn(node, opset, known) -> nodes``, standard-ONNX nodes that write the node's outputs with the same element
# types and shapes, for onnx's shape inference to see through (``known``: name -> TensorInfo of the graph's
# inputs, initializers and declared values). The engine fills the table (engine/type_rules.py, where rule
# files register them beside their gradient rules) and puts its loader in STAND_IN_LOADERS, which
# ``infer_tensor_info`` calls first: this module imports nothing of the engine.
STAND_INS: dict[tuple[str, str], Callable] = {}
STAND_IN_LOADERS: list[Callable[[], None]] = []


def infer_tensor_info(model: onnx.ModelProto, graph: onnx.GraphProto | None = None) -> dict[str, TensorInfo]:
    """Types and shapes of every tensor onnx's shape inference can tell (inputs, initializers, values)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(with_stand_ins(model), data_prop=True)
        for _ in range(3):  # then what they feed
            if graph is not None or not _types_inference_leaves_out(inferred):
                break
            inferred = onnx.shape_inference.infer_shapes(inferred, data_prop=True)
    except Exception:  # inference is best effort; what it cannot tell stays unknown
        inferred = model
    g = inferred.graph if graph is None else graph
    info: dict[str, TensorInfo] = {}
    for init in g.initializer:
        info[init.name] = TensorInfo(init.data_type, tuple(init.dims))
    read: dict[bytes, TensorInfo] = {}  # most values share a few types: each distinct one decoded once
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        name = vi.name
        have = info.get(name)
        if have is None or have.dtype is None:
            tp = vi.type
            key = tp.SerializeToString()
            t = read.get(key)
            if t is None:
                t = read[key] = info_from_type(tp)
            info[name] = TensorInfo(t.dtype, t.shape)  # an instance of its own (the shape is a tuple)
    for node in g.node:
        if node.op_type == "Constant" and normalize_domain(node.domain) == "":
            for a in node.attribute:
                if a.name == "value":
                    info[node.output[0]] = TensorInfo(a.t.data_type, tuple(a.t.dims))
    return info


def _types_inference_leaves_out(model: onnx.ModelProto) -> bool:
    """Shapes onnx's inference leaves out although they are known, added to the main graph's value infos
    (whether any was):

    - a Loop's loop-carried outputs (the state may change shape from one iteration to the next): each
      iteration's value has the shape the body declares for it, and the value before any has the initial
      value's, so the dims on which the two agree hold, the rest stay unknown, the rank is known;
    - the outputs of a Split whose sizes are computed (RotaryEmbedding's body): the input's shape, the split
      axis unknown.
    """
    g = model.graph
    if not any(n.op_type in ("Loop", "Split") and normalize_domain(n.domain) == "" for n in g.node):
        return False  # the two cases below; most graphs have neither (and the index below is a walk of every value)
    known = {vi.name: vi for vi in list(g.input) + list(g.value_info) + list(g.output)}
    known.update({t.name: onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in g.initializer})

    def shape_of(name):
        vi = known.get(name)
        return None if vi is None else info_from_type(vi.type).shape

    def declare(name, like: onnx.ValueInfoProto, dims) -> bool:
        have = known.get(name)
        if not name or (have is not None and have.type.tensor_type.HasField("shape")):
            return False
        typed = onnx.helper.make_tensor_value_info(name, like.type.tensor_type.elem_type, dims)
        at = next((i for i, v in enumerate(g.value_info) if v.name == name), None)
        if at is not None:
            g.value_info[at].CopyFrom(typed)
        elif have is None:
            g.value_info.append(typed)
        else:
            return False  # a graph output or input of its own declared type
        known[name] = typed
        return True

    added = False
    for node in g.node:
        if normalize_domain(node.domain) != "":
            continue
        if node.op_type == "Loop":
            body = next(a.g for a in node.attribute if a.name == "body")
            for k, out in enumerate(node.output[:len(node.input) - 2]):
                init = known.get(node.input[2 + k])
                declared = body.output[1 + k] if len(body.output) > 1 + k else None
                a, b = shape_of(node.input[2 + k]), declared and info_from_type(declared.type).shape
                if init is not None and a is not None and b is not None and len(a) == len(b):
                    added |= declare(out, init, [x if x == y else None for x, y in zip(a, b)])
        elif node.op_type == "Split" and shape_of(node.input[0]) is not None:
            dims = list(shape_of(node.input[0]))
            if dims:
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0) % len(dims)
                dims[axis] = None
                for out in node.output:
                    added |= declare(out, known[node.input[0]], dims)
    return added


def with_stand_ins(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy onnx's shape inference can see through: each Gradient node becomes Identity(input i) ->
    output i (dy/dx has x's type and shape), and each node with a type rule (``STAND_INS``) its standard-ONNX
    stand-in. onnx has no type inference for either, which would leave everything after it unknown.
    ``model`` itself when it has neither."""
    for load in STAND_IN_LOADERS:
        load()
    ruled = {op for _, op in STAND_INS} | {"Gradient"}
    first = next((k for k, n in enumerate(model.graph.node[:]) if n.op_type in ruled and (
        n.op_type == "Gradient" or (normalize_domain(n.domain), n.op_type) in STAND_INS)), None)
    if first is None:
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    known: dict[str, TensorInfo] | None = None  # made for the first type rule (a Gradient node needs none)
    opset = opset_map(m).get("", 0)
    tail = g.node[first:]  # the nodes before the first one replaced stay where the copy put them
    del g.node[first:]  # (a message deleted from a repeated field stays readable)
    nodes = []
    for n in tail:
        if n.op_type not in ruled:  # most nodes: one read and one set lookup
            nodes.append(n)
            continue
        rule = STAND_INS.get((normalize_domain(n.domain), n.op_type))
        if n.op_type == "Gradient":
            nodes.extend(onnx.helper.make_node("Identity", [i], [o]) for i, o in zip(n.input, n.output) if o)
        elif rule is not None:
            known = _declared_info(g) if known is None else known
            nodes.extend(rule(n, opset, known))
        else:
            nodes.append(n)
    g.node.extend(nodes)
    return m


def _declared_info(g: onnx.GraphProto) -> dict[str, TensorInfo]:
    """Name -> TensorInfo of the graph's initializers, inputs and value infos (initializers first)."""
    known = {t.name: TensorInfo(t.data_type, tuple(t.dims)) for t in g.initializer}
    for vi in list(g.input) + list(g.value_info):
        known.setdefault(vi.name, info_from_type(vi.type))
    return known
