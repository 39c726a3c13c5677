"""Lower ``Gradient`` nodes (ai.onnx.preview.training, or the proposal's ai.onnx.training) to plain ops."""
from __future__ import annotations

from collections import Counter

import onnx
from onnx import helper

from ..autodiff import backprop, function_nodes
from ..builder import Emitter, GradBuilder
from ..errors import GradientRuleError, GradientShapeError, GradientSpecError, OpsetTooOldError
from ..graph import FLOAT_TYPES, GraphView, TensorInfo, topological_sort
from .cleanup import cleanup_nodes
from .peephole import peephole

TRAINING_DOMAINS = ("ai.onnx.preview.training", "ai.onnx.training")


def is_gradient(node: onnx.NodeProto) -> bool:
    return node.op_type == "Gradient" and node.domain in TRAINING_DOMAINS


def _spec(node: onnx.NodeProto):
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    decode = lambda v: v.decode() if isinstance(v, bytes) else v  # noqa: E731
    xs = [decode(v) for v in attrs.get("xs", [])]
    zs = [decode(v) for v in attrs.get("zs", [])]
    y = decode(attrs.get("y", ""))
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


def lower_gradient_node(view: GraphView, node: onnx.NodeProto, taken: set[str]) -> list[onnx.NodeProto]:
    """The plain nodes that replace one Gradient node (its outputs keep their names)."""
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
    em = Emitter(view, taken)
    scope = node.name or "Gradient"
    cut = set(xs) | set(zs)
    nodes = function_nodes(view.nodes, y, cut)
    values = [a or n for a, n in zip(node.input, xs + zs)]
    binding = {n: v for n, v in zip(xs + zs, values) if n != v}
    if binding:
        nodes, y = _evaluate_at(em, nodes, binding, y, f"{scope}/at")
        xs = [binding.get(x, x) for x in xs]

    g = GradBuilder(em, f"{scope}/seed")
    y_shape = view.shape(y)
    seed = _emit(node, lambda: g.const(1.0, like=y) if y_shape == () else g.ones_like(y))
    grads = backprop(em, nodes, xs, y, seed, scope)

    out = GradBuilder(em, scope)
    for x, dx, name in zip(xs, grads, node.output):
        if not name:
            continue
        if dx is None:
            dx = _emit(node, lambda: out.zeros_like(x))
        _check_like(view, dx, x, node)
        em.nodes.append(helper.make_node("Identity", [dx], [name], name=em.fresh(f"{scope}/out")))
    keep = {o for o in node.output if o}
    return cleanup_nodes(peephole(em.nodes, view, keep), keep)


def _type_name(dtype: int) -> str:
    return helper.tensor_dtype_to_string(dtype).replace("TensorProto.", "").lower()


def _check_request(view: GraphView, node: onnx.NodeProto, xs: list[str], y: str) -> None:
    """Refuse what has no gradient (integer xs or y) and declared output shapes that cannot hold one,
    naming the user's tensors rather than a node the lowering would emit."""
    where = f"Gradient node {node.name!r}"
    dt = view.dtype(y)
    if dt is None:
        for n in function_nodes(view.nodes, y, set(xs)):
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


def _emit(node: onnx.NodeProto, build):
    """Run a builder call for the Gradient node itself (seed, zeros), naming the node on failure."""
    try:
        return build()
    except OpsetTooOldError:
        raise  # lower() converts the model and tries again
    except ValueError as e:
        raise GradientRuleError(f"Gradient node {node.name!r}: {e}") from e


def _check_like(view: GraphView, dx: str, x: str, node: onnx.NodeProto) -> None:
    a, b = view.info.get(dx), view.info.get(x)
    if a is None or b is None:
        return
    if a.dtype and b.dtype and a.dtype != b.dtype:
        raise GradientShapeError(
            f"Gradient node {node.name!r}: the gradient of {x!r} has element type "
            f"{helper.tensor_dtype_to_string(a.dtype)}, expected {helper.tensor_dtype_to_string(b.dtype)}"
        )


def _evaluate_at(em: Emitter, nodes, binding: dict[str, str], y: str, scope: str):
    """Copy the nodes that depend on the rebound tensors, reading the Gradient's inputs instead."""
    renamed = dict(binding)
    out_nodes = []
    for n in nodes:
        if not any(i in renamed for i in n.input):
            out_nodes.append(n)
            continue
        copy = onnx.NodeProto()
        copy.CopyFrom(n)
        copy.name = em.fresh(f"{scope}/{n.name}")
        del copy.input[:]
        copy.input.extend(renamed.get(i, i) for i in n.input)
        del copy.output[:]
        for o in n.output:
            if o:
                renamed[o] = em.fresh(f"{scope}/{o}")
                info = em.info.get(o)
                if info is not None:
                    em.info[renamed[o]] = TensorInfo(info.dtype, info.shape)
            copy.output.append(renamed.get(o, "") if o else "")
        em.nodes.append(copy)
        out_nodes.append(copy)
    return out_nodes, renamed.get(y, y)


def _ready(grad_nodes, all_nodes):
    """A Gradient node whose y does not depend on the output of another unlowered Gradient node."""
    pending = {o for n in grad_nodes for o in n.output if o}
    for node in grad_nodes:
        _, _, y = _spec(node)
        deps = function_nodes(all_nodes, y, set())
        if not any(o in pending for d in deps for o in d.output) and y not in pending:
            return node
    raise GradientSpecError(
        "Gradient nodes depend on each other in a cycle: "
        + ", ".join(repr(n.name) for n in grad_nodes)
    )


def lower_gradients(model: onnx.ModelProto, taken: set[str] | None = None) -> set[str]:
    """Replace every Gradient node of ``model.graph``; returns the names of the nodes added."""
    from .functions import prepare_gradient_path
    from .naming import name_nodes, used_names

    name_nodes(model)
    taken = used_names(model) if taken is None else taken
    added: set[str] = set()
    while True:
        pending = [n for n in model.graph.node if is_gradient(n)]
        if not pending:
            return added
        node = _ready(pending, list(model.graph.node))
        xs, zs, y = _spec(node)
        prepare_gradient_path(model, xs, zs, y, taken)  # function bodies for rule-less ops, Dropout masks
        view = GraphView.of_model(model)
        _complete_declarations(model.graph, view, node, xs)
        new = lower_gradient_node(view, node, taken)
        added.update(n.name for n in new)
        nodes = []
        for n in model.graph.node:
            nodes.extend(new if n.name == node.name else [n])
        set_nodes(model.graph, topological_sort(nodes))


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


def set_nodes(graph: onnx.GraphProto, nodes) -> None:
    """Replace a graph's node list (copies first: the old list may own the given messages)."""
    copies = []
    for n in nodes:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        copies.append(c)
    del graph.node[:]
    graph.node.extend(copies)
