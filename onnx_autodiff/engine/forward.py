"""The forward-mode engine: ``push_forward``, the walk that carries tangents (Jacobian-vector products)
from the xs through the registered JVP rules, ``linearize``, the fallback that reads an op's JVP off its
gradient rule, and ``jvp_nodes``, the front door that the public ``jvp``/``hvp``/``jacobian`` share.

The fallback: a gradient rule emits J^T u for cotangents u of the node's outputs, which is linear in u, so
the gradient of <J^T u, v> with respect to u is J v. The engine emits the gradient rule on placeholder
cotangents and runs the reverse walk over what it emitted, from u, seeded with the tangents v. It needs
nothing of an op but its gradient rule (and gradient rules for the ops that rule emits, which second order
needs anyway), so every op with a gradient rule has a JVP; a direct ``jvp_rule`` is the cheap form.
"""
from __future__ import annotations

from collections import ChainMap
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

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
    ancestors,
    implicit_inputs,
    infer_tensor_info,
    node_inputs,
    normalize_domain,
)
from .builder import Emitter, GradBuilder, NodeView
from .cleanup import cleanup_nodes
from .registry import find_jvp_rule, find_rule
from .reverse import active_nodes, apply_rule, backprop, output_count


def jvp_nodes(view: GraphView, xs: Sequence[str], tangents: Sequence[str], ys: Sequence[str],
              outputs: Sequence[str], *, taken: set[str], scope: str, where: str,
              target: str | None = None, replaced: dict | None = None) -> list[onnx.NodeProto]:
    """The nodes that write the tangent of ``ys[k]`` into ``outputs[k]`` (``""`` skips one), given the
    tangent ``tangents[i]`` of each ``xs[i]``: J v, v the tangents. A y that does not depend on the xs
    gets zeros of its shape. ``view``: the prepared graph (``reverse.prepare_gradient_path``); ``where``
    names the request in error messages. The nodes come cleaned up (CSE, Identity folding, dead nodes).
    ``replaced``: a dict from a caller that drops nodes: JVP rules may then compute a node's outputs
    themselves (``GradBuilder.replace_outputs``); the names of those nodes are its keys on return, and the
    nodes returned write their outputs (the caller drops them from the graph).
    """
    em = Emitter(view, taken, target=target)
    em.push = push_emitted
    em.replacements = replaced
    nodes = ancestors(view.nodes, list(ys), set(xs))
    for x, t in zip(xs, tangents):
        em.info.setdefault(t, TensorInfo(view.dtype(x), view.shape(x)))
    found = push_forward(em, nodes, dict(zip(xs, tangents)), scope)
    out = GradBuilder(em, scope)
    for y, name in zip(ys, outputs):
        if not name:
            continue
        t = found.get(y)
        if t is None:
            try:
                t = out.zeros_like(y)
            except ValueError as e:
                raise GradientRuleError(f"{where}: {e}") from e
        em.nodes.append(helper.make_node("Identity", [t], [name], name=em.fresh(f"{scope}/out")))
    keep = {o for o in outputs if o}
    for node_outputs in (replaced or {}).values():
        for o, v in node_outputs.items():
            em.nodes.append(helper.make_node("Identity", [v], [o], name=em.fresh(f"{scope}/primal")))
            keep.add(o)
    return cleanup_nodes(em.nodes, keep)


def push_forward(emitter: Emitter, nodes: Sequence[onnx.NodeProto], tangents: dict[str, str],
                 scope: str) -> dict[str, str]:
    """Emit the tangents of what ``nodes`` (topologically ordered) compute, given the tangents of some of
    the tensors they read (tensor -> tangent name). Returns every tangent known afterwards (those given
    included); a tensor without one has a zero tangent. Ops declared without gradient stop the tangents;
    an op with neither a JVP rule nor a gradient rule on the way raises UnsupportedOperatorError, listing
    every such op, before anything is emitted."""
    view = emitter.view
    tangents = dict(tangents)
    emitter.tangents = tangents
    active, _ = active_nodes(view, nodes, list(tangents))
    plan = _plan(view, active, scope)
    for node, rule, vjp, opset in plan:
        if emitter.replacements and node.name in emitter.replacements:
            continue  # an earlier rule computed its outputs and their tangents (``GradBuilder.replace_outputs``)
        inputs = implicit_inputs(node)
        dx = [tangents.get(i) if i else None for i in inputs]
        if all(d is None for d in dx):
            continue
        result = NotImplemented if rule is None else apply_jvp(emitter, node, rule, opset, dx, inputs)
        if result is NotImplemented:
            if vjp is None:
                raise UnsupportedOperatorError([(node.name, node.op_type, normalize_domain(node.domain), opset)],
                                               scope)
            result = linearize(emitter, node, vjp, opset, dx, inputs)
        for o, t in zip(node.output, result):
            if o and t is not None and _floating(view, o):
                _check_like(view, t, o, node)
                share_tangent_info(emitter, t, o)
                tangents[o] = t
    return tangents


def _floating(view: GraphView, name: str) -> bool:
    dt = view.dtype(name)
    return dt is None or dt in FLOAT_TYPES


def _plan(view: GraphView, active: Sequence[onnx.NodeProto], scope: str) -> list:
    """(node, JVP rule or None, gradient rule or None, opset) per active node; UnsupportedOperatorError
    naming every op with neither. A user's gradient rule over a built-in one makes the forward mode read
    its JVP off the user's rule too (unless the user registered a JVP rule as well)."""
    missing, plan = [], []
    for node in active:
        opset = view.opset(node.domain)
        rule = find_jvp_rule(node.domain, node.op_type, opset)
        vjp = find_rule(node.domain, node.op_type, opset)
        if rule is not None and rule.builtin and vjp is not None and not vjp.builtin:
            rule = None
        if rule is None and vjp is None:
            missing.append((node.name, node.op_type, normalize_domain(node.domain), opset))
        plan.append((node, rule, vjp, opset))
    if missing:
        raise UnsupportedOperatorError(missing, scope)
    return plan


def apply_jvp(emitter: Emitter, node: onnx.NodeProto, rule, opset: int, dx: list, inputs: list[str]):
    """One JVP rule on one node: its output tangents (or NotImplemented); a failure names the node."""
    view_node = NodeView(node, opset, [d is not None for d in dx], outer_inputs=inputs[len(node.input):])
    g = GradBuilder(emitter, f"{node.name or node.op_type}/jvp")
    try:
        result = rule.fn(g, view_node, dx)
    except OpsetTooOldError:
        raise
    except Exception as e:
        if isinstance(e, OnnxAutodiffError) and not isinstance(e, GradientRuleError):
            raise
        raise GradientRuleError(
            f"cannot push a tangent through node {node.name!r} (op {node.op_type}, domain "
            f"{normalize_domain(node.domain) or 'ai.onnx'}, opset {opset}): {e}") from e
    if result is NotImplemented:
        return result
    result = list(result or [])
    while len(result) > len(node.output) and result[-1] is None:
        result.pop()
    if len(result) > max(len(node.output), output_count(node, opset)):
        raise GradientShapeError(f"the {node.op_type} JVP rule returned {len(result)} tangents for node "
                                 f"{node.name!r}, which has {len(node.output)} outputs")
    return result[:len(node.output)]  # tangents of optional outputs the node does not have are not wanted


def linearize(emitter: Emitter, node: onnx.NodeProto, rule, opset: int, dx: list, inputs: list[str]) -> list:
    """The output tangents of ``node`` read off its gradient rule: the gradient of
    sum_i <(J^T u)_i, dx_i> with respect to the cotangents u, which is J dx.

    The cotangent placeholders are copies of the outputs (the values do not matter, J^T u being linear in
    u; their shapes do). The reverse walk runs over the nodes the gradient rule emitted, with their types
    and shapes from onnx's inference."""
    view = emitter.view
    g = GradBuilder(emitter, f"{node.name or node.op_type}/jvp")
    us = []
    for o in node.output:
        u = None
        if o and _floating(view, o):
            u = g.Identity(o)
            emitter.info[u] = TensorInfo(view.dtype(o), view.shape(o))
        us.append(u)
    dy = us + [None] * (output_count(node, opset) - len(us))
    mark = len(emitter.nodes)
    jtu = apply_rule(emitter, node, rule, opset, dy, inputs, [d is not None for d in dx])
    pairs = [(j, d) for j, d in zip(jtu, dx) if j is not None and d is not None]
    xs = [u for u in us if u]
    if not pairs or not xs:
        return [None] * len(node.output)
    emitted = emitter.nodes[mark:]
    local = local_view(emitter, emitted)
    inner = Emitter(local, emitter.taken, target=emitter.target, options=emitter.options)
    inner.push = push_emitted
    inner.constants = emitter.constants
    found = backprop(inner, emitted, xs, [j for j, _ in pairs], [d for _, d in pairs], f"{g.scope}/lin")
    emitter.nodes.extend(inner.nodes)
    emitter.info.update(local.info.maps[0])
    by_u = dict(zip(xs, found))
    return [by_u.get(u) if u else None for u in us]


def push_emitted(emitter: Emitter, nodes: Sequence[onnx.NodeProto], tangents: dict[str, str],
                 scope: str) -> dict[str, str]:
    """``push_forward`` through nodes a rule has just emitted (``GradBuilder.push``: an op's decomposition),
    their types and shapes inferred first so that the rules on the way can read them."""
    local = local_view(emitter, nodes)
    inner = Emitter(local, emitter.taken, target=emitter.target, options=emitter.options)
    inner.push = push_emitted
    inner.constants = emitter.constants
    found = push_forward(inner, nodes, tangents, scope)
    emitter.nodes.extend(inner.nodes)
    emitter.info.update(local.info.maps[0])
    return found


def local_view(emitter: Emitter, nodes: Sequence[onnx.NodeProto]) -> GraphView:
    """A view of emitted ``nodes`` with the types and shapes onnx infers for them (from what they read:
    constants by value, the emitter's own included, other tensors by their known types and shapes); the
    emitter's info below what it adds."""
    view, info = emitter.view, emitter.info
    produced = {o for n in nodes for o in n.output if o}
    reads: dict[str, None] = {}
    for n in nodes:
        for i in node_inputs(n):
            if i not in produced:
                reads.setdefault(i)
    consts, inputs = {}, []
    for r in reads:
        known = info.get(r)
        value = emitter.constants.get(r)
        if value is None and small(known):
            value = view.value(r)
        if value is not None:
            consts[r] = numpy_helper.from_array(np.asarray(value), r)
            continue
        dtype = known.dtype if known is not None and known.dtype else onnx.TensorProto.UNDEFINED
        shape = None if known is None or known.shape is None else [
            d if isinstance(d, (int, str)) else None for d in known.shape]
        inputs.append(helper.make_tensor_value_info(r, dtype, shape))
    graph = helper.make_graph(list(nodes), "local", inputs, [], initializer=list(consts.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in view.opsets.items()])
    inferred = infer_tensor_info(model)
    added = {k: v for k, v in inferred.items() if k in produced and v.dtype is not None}
    return GraphView(nodes, ChainMap(added, info), dict(view.opsets), [i.name for i in inputs], consts)


SMALL = 64  # elements: the constants rules read (shapes, axes, indices, a ratio); never a weight


def small(info: TensorInfo | None) -> bool:
    """Whether a tensor is known to be small enough that its value is worth reading (a large initializer
    may be detached: its bytes are not in the light model the passes see)."""
    if info is None or info.shape is None or any(not isinstance(d, int) for d in info.shape):
        return False
    return int(np.prod(info.shape, dtype=np.int64)) <= SMALL


def share_tangent_info(emitter: Emitter, tangent: str, value: str) -> None:
    """A tangent has its value's type and shape: record that where inference has not."""
    t, v = emitter.info.get(tangent), emitter.info.get(value)
    if v is None or (t is not None and t.shape is not None and t.dtype is not None):
        return
    emitter.info[tangent] = TensorInfo(t.dtype if t and t.dtype else v.dtype, t.shape if t and t.shape else v.shape)


def _check_like(view: GraphView, t: str, y: str, node: onnx.NodeProto) -> None:
    a, b = view.info.get(t), view.info.get(y)
    if a is None or b is None or not a.dtype or not b.dtype or a.dtype == b.dtype:
        return
    raise GradientShapeError(
        f"the tangent of {y!r} (output of node {node.name!r}, op {node.op_type}) has element type "
        f"{helper.tensor_dtype_to_string(a.dtype)}, expected {helper.tensor_dtype_to_string(b.dtype)}")
