"""Lower ``Gradient`` nodes (ai.onnx.preview.training, or the proposal's ai.onnx.training) to plain ops."""
from __future__ import annotations

from collections import Counter
from graphlib import CycleError, TopologicalSorter

import onnx
from onnx import helper

from ..engine.reverse import differentiate, prepare_gradient_path
from ..errors import GradientRuleError, GradientShapeError, GradientSpecError
from ..graph import FLOAT_TYPES, TRAINING_DOMAINS, GraphView, ancestors, attr_value, set_nodes, topological_sort
from .context import LoweringContext


def is_gradient(node: onnx.NodeProto) -> bool:
    return node.op_type == "Gradient" and node.domain in TRAINING_DOMAINS


def _spec(node: onnx.NodeProto):
    xs = list(attr_value(node, "xs", []))
    zs = list(attr_value(node, "zs", []))
    y = attr_value(node, "y", "")
    where = f"Gradient node {node.name!r}"
    if not y:
        raise GradientSpecError(f"{where}: attribute 'y' is missing or empty; name the tensor to differentiate")
    if not xs:
        raise GradientSpecError(f"{where}: attribute 'xs' is missing or empty; list the tensors to differentiate by")
    if len(node.input) != len(xs) + len(zs):
        raise GradientSpecError(
            f"{where}: has {len(node.input)} inputs but xs and zs name {len(xs) + len(zs)} tensors; "
            "give one input per name in xs followed by zs"
        )
    if len(node.output) > len(xs):
        raise GradientSpecError(
            f"{where}: has {len(node.output)} outputs but xs names {len(xs)} tensors; give at most one output per x"
        )
    dup = {n for n, k in Counter(xs + zs).items() if k > 1}
    if dup:
        raise GradientSpecError(f"{where}: {sorted(dup)} appear more than once in xs/zs")
    return xs, zs, y


def lower_gradient_node(view: GraphView, node: onnx.NodeProto, taken: set[str],
                        target=None) -> list[onnx.NodeProto]:
    """The plain nodes that replace one Gradient node (its outputs keep their names); ``view`` is the
    prepared model (``prepare_gradient_path``); ``target`` the record of the runtime they are for."""
    xs, zs, y = _spec(node)
    where = f"Gradient node {node.name!r}"
    if view.opset("") < 7:
        raise GradientRuleError(
            f"{where}: the model's default opset is {view.opset('')}; before opset 7 Add/Mul/Sub/Div broadcast "
            "only with a 'broadcast' attribute, which gradient rules do not emit. Convert the model first "
            "(onnx.version_converter.convert_version(model, 7) or newer)"
        )
    for field, names in (("xs", xs), ("zs", zs), ("y", [y])):
        for name in names:
            if not view.known(name):
                raise GradientSpecError(
                    f"{where}: {field} names {name!r}, which no node, graph input or initializer defines"
                )
    _check_request(view, node, xs, y)
    values = [a or n for a, n in zip(node.input, xs + zs)]
    at = {n: v for n, v in zip(xs + zs, values) if n != v}
    return differentiate(view, [y], xs, list(node.output), taken=taken, scope=node.name or "Gradient",
                         where=where, zs=zs, at=at, target=target)


def _type_name(dtype: int) -> str:
    return helper.tensor_dtype_to_string(dtype).replace("TensorProto.", "").lower()


def _check_request(view: GraphView, node: onnx.NodeProto, xs: list[str], y: str) -> None:
    """Refuse what has no gradient (integer xs or y) and declared output shapes that cannot hold one,
    naming the user's tensors rather than a node the lowering would emit."""
    where = f"Gradient node {node.name!r}"
    dt = view.dtype(y)
    if dt is None:
        for n in ancestors(view.nodes, y, xs):
            if not onnx.defs.has(n.op_type, n.domain):
                out = next((o for o in n.output if o and view.dtype(o) is None), n.output[0])
                raise GradientSpecError(
                    f"{where}: the element type of y {y!r} is unknown because node {n.name!r} (op {n.op_type!r}, "
                    f"domain {n.domain or 'ai.onnx'!r}) has no ONNX schema to infer the type of {out!r}. Declare "
                    f"{out!r} in the graph's value_info and register a gradient rule for {n.op_type} "
                    "(docs/writing_rules.md), or keep that op off the path from xs to y")
    if dt is not None and dt not in FLOAT_TYPES:
        raise GradientSpecError(
            f"{where}: y {y!r} is {_type_name(dt)}; only a floating-point y has a gradient (an integer y is "
            "piecewise constant, so every gradient would be zero). Differentiate a float tensor, e.g. the loss "
            "before any Cast to an integer type")
    for x in xs:
        dt = view.dtype(x)
        if dt is not None and dt not in FLOAT_TYPES:
            raise GradientSpecError(
                f"{where}: xs names {x!r}, which is {_type_name(dt)}; gradients exist only with respect to "
                "floating-point tensors. Remove it from xs (freeze it), or make it a float tensor")
    for x, out in zip(xs, node.output):
        declared, actual = view.shape(out) if out else None, view.shape(x)
        if declared is None or actual is None:
            continue
        if len(declared) != len(actual) or any(isinstance(a, int) and isinstance(b, int) and a != b
                                               for a, b in zip(declared, actual)):
            shown = lambda dims: "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"  # noqa: E731
            raise GradientShapeError(
                f"{where}: output {out!r} (the gradient of {x!r}) is declared with shape {shown(declared)}, but a "
                f"gradient has the shape of its x, {shown(actual)}. Fix or drop the shape declared for {out!r} "
                "(graph output or value_info)")


def gradient_order(model: onnx.ModelProto) -> list[str]:
    """The names of the Gradient nodes of ``model.graph``, each after the Gradient nodes its y depends on."""
    nodes = list(model.graph.node)
    grads = [n for n in nodes if is_gradient(n)]
    sorter = TopologicalSorter()
    for node in grads:
        _, _, y = _spec(node)
        sorter.add(node.name, *(d.name for d in ancestors(nodes, y) if is_gradient(d)))
    try:
        return list(sorter.static_order())
    except CycleError as e:
        raise GradientSpecError(
            "Gradient nodes depend on each other in a cycle: " + ", ".join(repr(n) for n in dict.fromkeys(e.args[1]))
        ) from None


def lower_gradients(model: onnx.ModelProto, ctx: LoweringContext) -> bool:
    """Replace every Gradient node of ``model.graph`` (the names of the nodes added go to ``ctx.added``)."""
    order = gradient_order(model)
    for name in order:
        node = next(n for n in model.graph.node if n.name == name)
        xs, zs, y = _spec(node)
        view = prepare_gradient_path(model, xs, zs, y, ctx.taken)  # function bodies, Dropout masks
        _complete_declarations(model.graph, view, node, xs)
        new = lower_gradient_node(view, node, ctx.taken, ctx.target)
        names = [n.name for n in new]
        ctx.added.update(names)
        ctx.cleaned.append(names)
        nodes = []
        for n in model.graph.node:
            nodes.extend(new if n.name == node.name else [n])
        set_nodes(model.graph, topological_sort(nodes))
    return bool(order)


def _complete_declarations(graph: onnx.GraphProto, view: GraphView, node: onnx.NodeProto, xs) -> None:
    """A graph output of the Gradient node declared without a type or shape (make_empty_tensor_value_info,
    make_tensor_value_info(name, FLOAT, None)) gets its x's type and shape: a gradient has them."""
    of = dict(zip(node.output, xs))
    for vi in graph.output:
        x = of.get(vi.name)
        if x is None:
            continue
        tt = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and tt.elem_type and tt.HasField("shape"):
            continue
        dt, shape = view.dtype(x), view.shape(x)
        if dt is None or shape is None:
            continue
        full = helper.make_tensor_value_info(vi.name, tt.elem_type or dt, list(shape))
        vi.type.CopyFrom(full.type)
