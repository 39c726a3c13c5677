"""The reverse-mode walk: from a seed on y back to xs, through the registered rules.

The walk owns the bookkeeping (pruning, which inputs need a gradient, fan-in sums, zero gradients)
so rules stay small pure functions.
"""
from __future__ import annotations

from typing import Sequence

import onnx

from .builder import Emitter, GradBuilder, NodeView
from .errors import GradientRuleError, GradientShapeError, OnnxAutodiffError, UnsupportedOperatorError
from .graph import FLOAT_TYPES, TensorInfo, node_inputs
from .registry import find_rule, is_non_differentiable, normalize_domain


def function_nodes(nodes: Sequence[onnx.NodeProto], y: str | Sequence[str], cut: set[str]) -> list[onnx.NodeProto]:
    """The nodes y (one name or several) depends on, stopping at the ``cut`` tensors, in graph order."""
    producer = {o: n for n in nodes for o in n.output if o}
    keep: set[int] = set()
    stack = [y] if isinstance(y, str) else list(y)
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


def implicit_inputs(node: onnx.NodeProto) -> list[str]:
    """``node.input`` followed by the outer-scope names its subgraphs read (If/Loop/Scan bodies)."""
    names = list(node.input)
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        seen = set(names)
        for n in node_inputs(node):
            if n not in seen:
                seen.add(n)
                names.append(n)
    return names


def _differentiable(emitter: Emitter, name: str) -> bool:
    dt = emitter.view.dtype(name)
    return dt is None or dt in FLOAT_TYPES


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
    reach = set(x for x in xs if _differentiable(emitter, x))
    active: list[tuple[onnx.NodeProto, list[bool]]] = []
    for node in nodes:
        needs = [bool(i) and i in reach for i in implicit_inputs(node)]
        if not any(needs) or is_non_differentiable(node.domain, node.op_type):
            continue
        active.append((node, needs))
        reach.update(o for o in node.output if o and _differentiable(emitter, o))

    if not any(v in reach for v in ys):
        return [None] * len(xs)

    missing, plan = [], []
    for node, needs in active:
        opset = view.opset(node.domain)
        rule = find_rule(node.domain, node.op_type, opset)
        if rule is None:
            missing.append((node.name, node.op_type, normalize_domain(node.domain), opset))
        plan.append((node, needs, rule, opset))
    if missing:
        raise UnsupportedOperatorError(missing, scope)

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
        _share_info(emitter, parts[0], name)
        return parts[0]

    for node, needs, rule, opset in reversed(plan):
        dy = [total(o) if o else None for o in node.output]
        if all(d is None for d in dy):
            continue
        inputs = implicit_inputs(node)
        view_node = NodeView(node, opset, needs, outer_inputs=inputs[len(node.input):])
        g = GradBuilder(emitter, f"{node.name or node.op_type}/grad")
        try:
            result = list(rule.fn(g, view_node, dy) or [])
        except OnnxAutodiffError:
            raise
        except Exception as e:  # a rule's own ValueError etc.: say which node it was about
            raise GradientRuleError(
                f"cannot differentiate node {node.name!r} (op {node.op_type}, domain "
                f"{normalize_domain(node.domain) or 'ai.onnx'}, opset {opset}): {e}"
            ) from e
        if len(result) > len(inputs):
            raise GradientShapeError(
                f"the {node.op_type} rule returned {len(result)} gradients for node {node.name!r}, "
                f"which has {len(node.input)} inputs and reads {len(inputs) - len(node.input)} outer-scope tensors"
            )
        for name, needed, gi in zip(inputs, needs, result):
            if needed and gi is not None:
                grads.setdefault(name, []).append(gi)

    return [total(x) for x in xs]


def _share_info(emitter: Emitter, grad: str, value: str) -> None:
    """A gradient has its value's type and shape: record that where inference has not."""
    g, v = emitter.info.get(grad), emitter.info.get(value)
    if v is None or (g is not None and g.shape is not None and g.dtype is not None):
        return
    emitter.info[grad] = TensorInfo(g.dtype if g and g.dtype else v.dtype, g.shape if g and g.shape else v.shape)
