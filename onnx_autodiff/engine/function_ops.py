"""Expand function ops (ops whose schema defines them by a body of other ops) into that body.

An op with no gradient rule but a function body in its schema (MeanVarianceNormalization,
CenterCropPad, RMSNormalization, ...) is differentiated through its body: the node is replaced by
the body's nodes, instantiated at the model's opset, with fresh names and its attributes
(including ``ref_attr_name`` references) substituted. Context-dependent bodies are built from the
node and its input types. Body nodes that are function ops without a rule are expanded in turn.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import onnx
from onnx import AttributeProto, helper

from ..graph import (
    GraphView,
    fresh_name,
    has_subgraph,
    normalize_domain,
    rename_outer_reads,
    set_nodes,
    subgraphs,
    topological_sort,
)
from .registry import find_rule, is_non_differentiable

_MAX_DEPTH = 8  # rounds of nested expansion (bodies calling function ops)


def _schema(node: onnx.NodeProto, opset: int):
    try:
        return onnx.defs.get_schema(node.op_type, opset, normalize_domain(node.domain))
    except onnx.defs.SchemaError:
        return None


def _best(versions: Iterable[int], opset: int) -> int | None:
    fit = [v for v in versions if v <= opset]
    return max(fit) if fit else None


def has_function_body(node: onnx.NodeProto, opset: int) -> bool:
    """Whether the schema in force at ``opset`` defines the op by a body usable at that opset."""
    s = _schema(node, opset)
    if s is None:
        return False
    return (_best(s.function_opset_versions, opset) is not None
            or _best(s.context_dependent_function_opset_versions, opset) is not None)


def expandable(node: onnx.NodeProto, opset: int) -> bool:
    """Whether the reverse walk differentiates ``node`` through its schema's body: no rule, no no-gradient
    declaration, and a body at ``opset``."""
    return (find_rule(node.domain, node.op_type, opset) is None
            and not is_non_differentiable(node.domain, node.op_type) and has_function_body(node, opset))


def function_body(node: onnx.NodeProto, opset: int, input_types=None) -> onnx.FunctionProto | None:
    """The schema's body for ``node`` at ``opset`` (None when there is none).

    ``input_types``: one TypeProto (or None) per input, needed for context-dependent bodies.
    """
    s = _schema(node, opset)
    if s is None:
        return None
    v = _best(s.function_opset_versions, opset)
    if v is not None:
        body = s.get_function_with_opset_version(v)
        if isinstance(body, bytes):
            body = onnx.FunctionProto.FromString(body)
        return body
    v = _best(s.context_dependent_function_opset_versions, opset)
    if v is None:
        return None
    types = [(t or onnx.TypeProto()).SerializeToString() for t in (input_types or [])]
    types += [onnx.TypeProto().SerializeToString()] * (len(node.input) - len(types))
    try:
        raw = s.get_context_dependent_function_with_opset_version(v, node.SerializeToString(), types)
    except Exception:  # the builder rejects nodes it cannot type (unknown input types)
        return None
    return onnx.FunctionProto.FromString(raw) if raw else None


def _attribute_defaults(node: onnx.NodeProto, opset: int) -> dict[str, AttributeProto]:
    s = _schema(node, opset)
    out = {}
    for name, a in (s.attributes.items() if s is not None else []):
        d = a.default_value
        if d is not None and d.type != AttributeProto.UNDEFINED:
            c = AttributeProto()
            c.CopyFrom(d)
            c.name = name
            out[name] = c
    return out


def _substitute(attrs, given: dict[str, AttributeProto], defaults: dict[str, AttributeProto]):
    """Body attributes with ``ref_attr_name`` resolved against the node (then the schema defaults);
    a reference to an attribute that is neither given nor defaulted is dropped."""
    out = []
    for a in attrs:
        if a.ref_attr_name:
            src = given.get(a.ref_attr_name) or defaults.get(a.ref_attr_name)
            if src is None:
                continue
            c = AttributeProto()
            c.CopyFrom(src)
            c.name = a.name
            out.append(c)
        else:
            out.append(a)
    return out


def instantiate(node: onnx.NodeProto, body: onnx.FunctionProto, opset: int, taken: set[str]) -> list[onnx.NodeProto]:
    """The body's nodes wired to ``node``'s inputs and outputs, with fresh internal names."""
    names: dict[str, str] = {}
    for k, formal in enumerate(body.input):
        names[formal] = node.input[k] if k < len(node.input) else ""
    scope = node.name or node.op_type
    for k, formal in enumerate(body.output):
        actual = node.output[k] if k < len(node.output) and node.output[k] else ""
        names[formal] = actual or fresh_name(taken, f"{scope}/{formal}")
    given = {a.name: a for a in node.attribute}
    defaults = _attribute_defaults(node, opset)
    out = []
    for bn in body.node:
        n = onnx.NodeProto()
        n.CopyFrom(bn)
        for o in bn.output:
            if o and o not in names:
                names[o] = fresh_name(taken, f"{scope}/{o}")
        del n.input[:]
        n.input.extend(names.get(i, i) if i else "" for i in bn.input)
        del n.output[:]
        n.output.extend(names[o] if o else "" for o in bn.output)
        attrs = _substitute(bn.attribute, given, defaults)
        del n.attribute[:]
        n.attribute.extend(attrs)
        for sg in subgraphs(n):
            rename_outer_reads(sg, names)
        n.name = fresh_name(taken, f"{scope}/{bn.name or bn.op_type}")
        out.append(n)
    return out


def _type_proto(view: GraphView, name: str):
    if not name:
        return None
    dt, shape = view.dtype(name), view.shape(name)
    if dt is None:
        return None
    return helper.make_tensor_type_proto(dt, list(shape) if shape is not None else None)


def expand_function_nodes(model: onnx.ModelProto, should_expand: Callable[[onnx.NodeProto], bool],
                          taken: set[str], accept: Callable[[onnx.FunctionProto], bool] = lambda body: True) -> bool:
    """Replace each node of ``model.graph`` for which ``should_expand(node)`` holds and whose schema
    has a body (that ``accept`` takes) by that body, repeating for function ops inside the bodies.
    Returns whether the model changed."""
    changed = False
    for _ in range(_MAX_DEPTH):
        todo = [n for n in model.graph.node if should_expand(n)]
        if not todo:
            break
        view = GraphView.of_model(model)
        bodies = {}
        for n in todo:
            opset = view.opset(n.domain)
            body = function_body(n, opset, [_type_proto(view, i) for i in n.input])
            if body is not None and accept(body):
                bodies[n.name] = (body, opset)
        if not bodies:
            break
        nodes, typed = [], []
        for n in model.graph.node:
            hit = bodies.get(n.name)
            nodes.extend(instantiate(n, hit[0], hit[1], taken) if hit else [n])
            if hit:
                _import_opsets(model, hit[0])
                typed += [o for o in n.output if o]
        set_nodes(model.graph, topological_sort(nodes))
        _keep_types(model.graph, view, typed)
        changed = True
    return changed


def _keep_types(graph: onnx.GraphProto, view: GraphView, names: list[str]) -> None:
    """Value infos for the outputs of expanded nodes, as the op's own schema typed them: a body's shape
    arithmetic (RMSNormalization's axes from Shape and Range) can leave them, and all after them, unknown."""
    declared = {vi.name for vi in list(graph.value_info) + list(graph.output) + list(graph.input)}
    for name in names:
        dt, shape = view.dtype(name), view.shape(name)
        if name not in declared and dt is not None and shape is not None:
            graph.value_info.append(helper.make_tensor_value_info(name, dt, list(shape)))


def without_subgraphs(body: onnx.FunctionProto) -> bool:
    """Whether no body node carries a subgraph. The reverse walk sees a node's inputs, not the
    outer-scope names its branches read, so a body with If/Loop/Scan (AffineGrid's) is not
    differentiated through: its op stays a missing rule instead of a silent zero gradient."""
    return not any(has_subgraph(n) for n in body.node)


def _import_opsets(model: onnx.ModelProto, body: onnx.FunctionProto) -> None:
    have = {normalize_domain(o.domain) for o in model.opset_import}
    for o in body.opset_import:
        if normalize_domain(o.domain) not in have:
            model.opset_import.append(helper.make_opsetid(o.domain, o.version))
