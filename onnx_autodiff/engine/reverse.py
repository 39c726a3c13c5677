"""The reverse-mode engine: ``differentiate``, the one front door that Gradient lowering and
``build_vjp`` share, and ``backprop``, the reverse walk from a seed on y back to xs through the
registered rules.

The engine owns the bookkeeping (preparing the path, pruning, which inputs need a gradient, fan-in
sums, zero gradients, the context of a rule's error) so rules stay small pure functions.
"""
from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper

from ..errors import (
    GradientRuleError,
    GradientShapeError,
    OnnxAutodiffError,
    OpsetTooOldError,
    UnsupportedOperatorError,
)
from ..graph import (
    FLOAT_TYPES,
    GraphView,
    TensorInfo,
    descendants,
    fresh_name,
    implicit_inputs,
    normalize_domain,
)
from .builder import Emitter, GradBuilder, NodeView
from .cleanup import cleanup_nodes
from .function_ops import expand_function_nodes, expandable, has_function_body, without_subgraphs
from .peephole import peephole
from .registry import find_rule, gradient_groups, is_non_differentiable

_MAX_DY = 16  # a schema with more optional outputs than this is variadic (Split): dy is not padded


def active_nodes(view: GraphView, nodes: Sequence[onnx.NodeProto], xs: Sequence[str]
                 ) -> tuple[list[onnx.NodeProto], set[str]]:
    """The nodes on a differentiable path from xs (they read a float tensor reachable from xs and are
    not declared no-gradient), and the tensors reachable that way."""
    def floating(name: str) -> bool:
        dt = view.dtype(name)
        return dt is None or dt in FLOAT_TYPES

    return descendants(nodes, xs, carries=floating,
                       passes=lambda n: not is_non_differentiable(n.domain, n.op_type))


def grouped(view: GraphView, nodes: Sequence[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` with each registered group (``registry.gradient_group``) in place of its members, at the
    position of the member that writes the group's output (its inputs are written before)."""
    found = gradient_groups(view, nodes)
    if not found:
        return list(nodes)
    members = {m for _, ms in found for m in ms}
    at = {}
    for node, _ in found:
        at[view.producer[node.output[0]].name] = node
    out = []
    for n in nodes:
        if n.name in at:
            out.append(at[n.name])
        elif n.name not in members:
            out.append(n)
    return out


def prepare_gradient_path(model: onnx.ModelProto, xs: Sequence[str], zs: Sequence[str], y: str | Sequence[str],
                          taken: set[str]) -> GraphView:
    """Make ``model.graph`` ready to differentiate y (a name or several) w.r.t. xs, in place: expand the
    function ops on the path that have no rule and no no-gradient declaration, and give Dropout nodes on
    the path a mask output. Returns the view of the prepared model."""
    cut = set(xs) | set(zs)
    opsets = {normalize_domain(o.domain): o.version for o in model.opset_import}

    def candidate(n: onnx.NodeProto) -> bool:
        return expandable(n, opsets.get(normalize_domain(n.domain), 0))

    view = GraphView.of_model(model)  # made again only after the model changed (each is a shape inference)
    path = grouped(view, view.ancestors(y, cut))
    changed = False
    if any(candidate(n) for n in path):
        expand = {n.name for n in active_nodes(view, path, xs)[0] if candidate(n)}
        if expand:
            # nodes created by an expansion are expanded in turn when they need it
            before = {n.name for n in model.graph.node}
            changed = expand_function_nodes(
                model, lambda n: n.name in expand or (n.name not in before and candidate(n)), taken,
                without_subgraphs)
        if changed:
            view = GraphView.of_model(model)
        path = grouped(view, view.ancestors(y, cut))
    if any(n.op_type == "Dropout" and normalize_domain(n.domain) == "" for n in path):
        if add_dropout_masks(model, active_nodes(view, path, xs)[0], taken):
            view = GraphView.of_model(model)
    return view


def check_rules(model: onnx.ModelProto, xs: Sequence[str], y: str, where: str = "") -> None:
    """Raise UnsupportedOperatorError, listing every op on the path from ``xs`` to ``y`` that has no gradient
    rule, no no-gradient declaration and no function body to differentiate through: what lowering would
    find, without building the backward (``make_training_model(check=True)``)."""
    view = GraphView.of_model(model)
    path = grouped(view, view.ancestors(y, set(xs)))
    missing = []
    for n in active_nodes(view, path, xs)[0]:
        opset = _opset(view, n)
        if find_rule(n.domain, n.op_type, opset) is None and not has_function_body(n, opset):
            missing.append((n.name, n.op_type, normalize_domain(n.domain), opset))
    if missing:
        raise UnsupportedOperatorError(missing, where)


def add_dropout_masks(model: onnx.ModelProto, nodes: Sequence[onnx.NodeProto], taken: set[str]) -> bool:
    """Name a mask output for each default-domain Dropout among ``nodes`` (which must belong to
    ``model.graph``) that has none, so the backward reuses the forward mask (rules never touch protobufs,
    and a node that does not ask for its mask has none). Returns whether a node changed."""
    wanted = {n.name for n in nodes if n.op_type == "Dropout" and normalize_domain(n.domain) == ""
              and (len(n.output) < 2 or not n.output[1])}
    changed = False
    for n in model.graph.node:
        if n.name not in wanted:
            continue
        mask = fresh_name(taken, f"{n.name}/mask")
        if len(n.output) < 2:
            n.output.append(mask)
        else:
            n.output[1] = mask
        changed = True
    return changed


def differentiate(view: GraphView, ys: Sequence[str], xs: Sequence[str], outputs: Sequence[str], *,
                  taken: set[str], scope: str, where: str, seeds: Sequence[str] | None = None,
                  zs: Sequence[str] = (), at: dict[str, str] | None = None,
                  target=None) -> list[onnx.NodeProto]:
    """The nodes that write d(sum_k <ys[k], seeds[k]>)/d xs[i] into ``outputs[i]`` (``""`` skips one).

    ``view``: the prepared graph (``prepare_gradient_path``). ``seeds``: one gradient tensor per y;
    None seeds each y with ones. ``zs`` also cut the graph but get no gradient. ``at`` (x or z -> tensor)
    evaluates the graph with those tensors in place of the xs/zs: the nodes depending on them are copied,
    reading the given tensors, and the gradients are with respect to the given tensors. An x that y does
    not depend on gets zeros of its shape. ``where`` names the request in error messages. The nodes come
    cleaned up (CSE, Identity folding, dead nodes). ``target``: the runtime the nodes are for (a
    ``runtimes/targets.py`` record; None: every op).
    """
    em = Emitter(view, taken, target=target)
    xs, ys = list(xs), list(ys)
    nodes = view.ancestors(ys, set(xs) | set(zs))
    if at:
        nodes, ys = _evaluate_at(em, nodes, at, ys, f"{scope}/at")
        xs = [at.get(x, x) for x in xs]
    if seeds is None:
        g = GradBuilder(em, f"{scope}/seed")
        seeds = [_emit(where, lambda y=y: g.const(1.0, like=y) if view.shape(y) == () else g.ones_like(y))
                 for y in ys]
    grads = backprop(em, nodes, xs, ys, list(seeds), scope)
    out = GradBuilder(em, scope)
    for x, dx, name in zip(xs, grads, outputs):
        if not name:
            continue
        if dx is None:
            dx = _emit(where, lambda x=x: out.zeros_like(x))
        _check_like(view, dx, x, where)
        em.nodes.append(helper.make_node("Identity", [dx], [name], name=em.fresh(f"{scope}/out")))
    keep = {o for o in outputs if o}
    return cleanup_nodes(peephole(em.nodes, view, keep, em.options), keep)


def _emit(where: str, build):
    """Run a builder call for the request itself (seed, zeros), naming it on failure."""
    try:
        return build()
    except OpsetTooOldError:
        raise  # lower() converts the model and tries again
    except ValueError as e:
        raise GradientRuleError(f"{where}: {e}") from e


def _check_like(view: GraphView, dx: str, x: str, where: str) -> None:
    a, b = view.info.get(dx), view.info.get(x)
    if a is None or b is None:
        return
    if a.dtype and b.dtype and a.dtype != b.dtype:
        raise GradientShapeError(
            f"{where}: the gradient of {x!r} has element type "
            f"{helper.tensor_dtype_to_string(a.dtype)}, expected {helper.tensor_dtype_to_string(b.dtype)}"
        )


def _evaluate_at(em: Emitter, nodes, binding: dict[str, str], ys: list[str], scope: str):
    """Copy the nodes that depend on the rebound tensors, reading the given tensors instead."""
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
    return out_nodes, [renamed.get(y, y) for y in ys]


def backprop(emitter: Emitter, nodes: Sequence[onnx.NodeProto], xs: Sequence[str], y: str | Sequence[str],
             seed: str | Sequence[str], scope: str) -> list[str | None]:
    """Emit the gradient of y w.r.t. each x, given the gradient ``seed`` of y.

    ``y`` and ``seed`` may be parallel lists (a vector-Jacobian product of several outputs in one
    sweep, so shared work is done once). Returns one gradient name per x, or None where y does not
    depend on x (the caller decides whether that becomes an explicit zero).
    """
    ys = [y] if isinstance(y, str) else list(y)
    seeds = [seed] if isinstance(seed, str) else list(seed)
    view = emitter.view
    active, reach = active_nodes(view, grouped(view, nodes), xs)
    if not any(v in reach for v in ys):
        return [None] * len(xs)

    plan = _plan(view, active, scope)

    grads: dict[str, list[str]] = {}
    for v, sd in zip(ys, seeds):
        if v in reach:
            grads.setdefault(v, []).append(sd)

    def total(name: str) -> str | None:
        parts = grads.get(name)
        if not parts:
            return None
        if len(parts) > 1:
            g = GradBuilder(emitter, f"{scope}/sum")
            parts[:] = [g.op("Sum", *parts)]
        share_info(emitter, parts[0], name)
        return parts[0]

    for node, rule, opset in reversed(plan):
        dy = [total(o) if o else None for o in node.output[:]]
        if all(d is None for d in dy):
            continue
        dy += [None] * (output_count(node, opset) - len(dy))
        inputs = implicit_inputs(node)
        needs = [bool(i) and i in reach for i in inputs]
        result = apply_rule(emitter, node, rule, opset, dy, inputs, needs)
        for name, needed, gi in zip(inputs, needs, result):
            if needed and gi is not None:
                grads.setdefault(name, []).append(gi)

    return [total(x) for x in xs]


def _plan(view, active: Sequence[onnx.NodeProto], scope: str) -> list:
    """(node, rule, opset) for each active node; UnsupportedOperatorError listing every op without a rule."""
    missing, plan = [], []
    for node in active:
        opset = _opset(view, node)
        rule = find_rule(node.domain, node.op_type, opset)
        if rule is None:
            missing.append((node.name, node.op_type, normalize_domain(node.domain), opset))
        plan.append((node, rule, opset))
    if missing:
        raise UnsupportedOperatorError(missing, scope)
    return plan


def _opset(view: GraphView, node: onnx.NodeProto) -> int:
    """The opset of the node's domain; 1 for a domain the model does not import (a group's contrib op)."""
    return view.opset(node.domain) or (1 if normalize_domain(node.domain) else 0)


def apply_rule(emitter: Emitter, node: onnx.NodeProto, rule, opset: int, dy: list, inputs: list[str],
           needs: list[bool]) -> list:
    """One rule on one node: its input gradients (trailing Nones dropped); a failure names the node."""
    view_node = NodeView(node, opset, needs, outer_inputs=inputs[len(node.input):])
    g = GradBuilder(emitter, f"{node.name or node.op_type}/grad")
    try:
        result = list(rule.fn(g, view_node, dy) or [])
    except OpsetTooOldError:
        raise  # lower() converts the model to the opset it names and tries again
    except Exception as e:  # a rule's GradientRuleError (or its own ValueError etc.): say which node
        if isinstance(e, OnnxAutodiffError) and not isinstance(e, GradientRuleError):
            raise  # an error of a nested walk (a body's missing rule) already says where
        raise GradientRuleError(
            f"cannot differentiate node {node.name!r} (op {node.op_type}, domain "
            f"{normalize_domain(node.domain) or 'ai.onnx'}, opset {opset}): {e}"
        ) from e
    while len(result) > len(inputs) and result[-1] is None:
        result.pop()
    if len(result) > len(inputs):
        raise GradientShapeError(
            f"the {node.op_type} rule returned {len(result)} gradients for node {node.name!r}, "
            f"which has {len(node.input)} inputs and reads {len(inputs) - len(node.input)} outer-scope tensors"
        )
    return result


def output_count(node: onnx.NodeProto, opset: int) -> int:
    """How many outputs the op's schema allows (so ``dy`` has an entry, maybe None, for each), or the
    node's own count for a variadic op or one without a schema."""
    n = _max_outputs(node.op_type, opset, normalize_domain(node.domain))
    count = len(node.output)
    return n if n is not None and count <= n <= _MAX_DY else count


_MAX_OUTPUTS: dict[tuple[str, int, str], int] = {}


def _max_outputs(op_type: str, opset: int, domain: str) -> int | None:
    """The schema's ``max_output`` (None: no schema), looked up once per op and opset (10k nodes: 10k
    schema look-ups were 5% of a chain's lowering). Only found schemas are kept: one registered later
    (``onnx.defs.register_schema``) is still found."""
    key = (op_type, opset, domain)
    n = _MAX_OUTPUTS.get(key)
    if n is None:
        try:
            n = _MAX_OUTPUTS[key] = onnx.defs.get_schema(op_type, opset, domain).max_output
        except onnx.defs.SchemaError:
            return None
    return n


def share_info(emitter: Emitter, grad: str, value: str) -> None:
    """A gradient has its value's type and shape: record that where inference has not."""
    g, v = emitter.info.get(grad), emitter.info.get(value)
    if v is None or (g is not None and g.shape is not None and g.dtype is not None):
        return
    emitter.info[grad] = TensorInfo(g.dtype if g and g.dtype else v.dtype, g.shape if g and g.shape else v.shape)
