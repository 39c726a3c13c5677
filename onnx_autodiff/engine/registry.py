"""The gradient-rule registry: rules keyed by (domain, op_type, since), the one for a node picked by its opset.

Rules live in the ``gradient_rules`` package; this module only stores them. ``load_rules`` imports
that package once so the registry fills itself. A user's rule (any function outside ``gradient_rules``)
wins over a built-in one for the same op, whether it was registered before or after the built-ins loaded.
``gradient_rule``, ``derivative`` and ``no_gradient`` are the three ways to register a reverse-mode rule
(a contrib op's type rule, ``type_rules.type_rule``, sits beside its gradient rule); ``jvp_rule`` registers a
forward-mode one (a Jacobian-vector product) beside it, in a table of its own with the same precedence (a
user's rule wins, the largest ``since`` not above the node's opset is picked). A ``derivative`` registers
both: the JVP of a unary elementwise op is the same product, f'(x) * dx.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..graph import STAND_IN_LOADERS, STAND_INS, normalize_domain


@dataclass(frozen=True)
class Rule:
    fn: Callable
    op_type: str
    domain: str
    since: int  # the lowest opset this rule handles
    builtin: bool = False  # defined in the gradient_rules package


def _is_builtin(fn) -> bool:
    module = getattr(fn, "__module__", "") or ""
    return module == "gradient_rules" or module.startswith("gradient_rules.")


_RULES: dict[tuple[str, str], list[Rule]] = {}
_JVP_RULES: dict[tuple[str, str], list[Rule]] = {}
_NO_GRADIENT: dict[tuple[str, str], str] = {}
_GROUPS: list[Callable] = []
_loaded = False


def gradient_rule(*op_types: str, domain: str = "", since: int = 1):
    """Register ``fn(g, node, dy) -> list of input gradients`` for each op type.

    ``since`` is the opset floor: for a node at opset v, the rule with the largest ``since <= v`` wins,
    so a rule for a newer operator version can sit beside the older one. A user's rule takes precedence
    over the built-in rules of that op at every opset it covers.
    """
    if not op_types:
        raise ValueError("gradient_rule needs at least one op type")
    return _registrar(_RULES, op_types, domain, since)


def jvp_rule(*op_types: str, domain: str = "", since: int = 1):
    """Register ``fn(g, node, dx) -> list of output tangents`` for each op type (forward mode).

    ``dx`` holds one tangent per input (then per outer-scope tensor the node's subgraphs read), None where
    an input has none; the rule returns one tangent per output, None where an output has none (zero), and
    emits through the same builder as a gradient rule (its names scoped ``<node>/jvp``). It may return
    ``NotImplemented`` for a case it leaves to the fallback (the JVP read off the op's gradient rule).
    ``since`` and precedence as for ``gradient_rule``.
    """
    if not op_types:
        raise ValueError("jvp_rule needs at least one op type")
    return _registrar(_JVP_RULES, op_types, domain, since)


def _registrar(table: dict, op_types, domain: str, since: int):
    def register(fn):
        builtin = _is_builtin(fn)
        for op in op_types:
            key = (normalize_domain(domain), op)
            rules = table.get(key, [])
            if builtin and any(r.since == since and not r.builtin for r in rules):
                continue  # the built-ins are loading after the user registered this op: keep the user's
            rules = [r for r in rules if not (r.since == since and r.builtin == builtin)]
            rules.append(Rule(fn, op, key[0], since, builtin))
            table[key] = sorted(rules, key=lambda r: (r.since, not r.builtin))
        return fn

    return register


def derivative(*op_types: str, domain: str = "", since: int = 1):
    """Register ``fn(g, node, x, y) -> f'(x)`` (a tensor name) for unary elementwise ops: the gradient
    rule multiplies it into dy, the JVP rule into dx. The rules keep ``fn``'s module, so a user's
    derivative is the user's rule (and wins over a built-in one, as with ``gradient_rule``)."""

    def register(fn):
        def rule(g, node, dy):
            return [g.Mul(dy[0], fn(g, node, node.inputs[0], node.outputs[0]))]

        def jvp(g, node, dx):
            return [g.Mul(dx[0], fn(g, node, node.inputs[0], node.outputs[0])) if dx[0] else None]

        for made, suffix in ((rule, "grad"), (jvp, "jvp")):
            made.__name__ = made.__qualname__ = f"{fn.__name__}_{suffix}"
            made.__doc__ = fn.__doc__
            made.__module__ = fn.__module__
        gradient_rule(*op_types, domain=domain, since=since)(rule)
        jvp_rule(*op_types, domain=domain, since=since)(jvp)
        return fn

    return register


def no_gradient(*op_types: str, domain: str = "", reason: str = "not differentiable"):
    """Declare ops whose outputs carry no gradient (Shape, comparisons, ArgMax, Floor, ...).

    'No gradient' is an answer: gradients simply stop there. It differs from 'no rule', which is an error.
    """
    for op in op_types:
        _NO_GRADIENT[(normalize_domain(domain), op)] = reason


def gradient_group(fn):
    """Register ``fn(view, nodes) -> [(node, members)]``: forward nodes the reverse walk differentiates as one op.
    ``node`` (made by ``fn``, never put in the graph) reads the group's inputs and writes its output under the
    output's own name, and is an op with a rule; ``members`` names the nodes it stands for. For a form whose pieces
    have no useful gradient of their own: a dynamically quantized product, whose int8 codes are a step function of
    the activation, is differentiated as the float product it approximates (a straight-through estimate)."""
    _GROUPS.append(fn)
    return fn


def gradient_groups(view, nodes) -> list:
    """``(node, members)`` of every registered group among ``nodes``."""
    load_rules()
    return [found for fn in _GROUPS for found in fn(view, nodes)]


def load_rules() -> None:
    """Import the ``gradient_rules`` package once (its modules register themselves)."""
    global _loaded
    if not _loaded:
        importlib.import_module("gradient_rules")
        _loaded = True


STAND_IN_LOADERS.append(load_rules)  # the type rules of graph.infer_tensor_info sit in the rule files


def find_rule(domain: str, op_type: str, opset: int) -> Rule | None:
    """The gradient (VJP) rule for a node of this op at this opset, or None."""
    return _find(_RULES, domain, op_type, opset)


def find_jvp_rule(domain: str, op_type: str, opset: int) -> Rule | None:
    """The direct forward-mode (JVP) rule for a node of this op at this opset, or None (the forward walk
    then linearizes through the gradient rule)."""
    return _find(_JVP_RULES, domain, op_type, opset)


def _find(table: dict, domain: str, op_type: str, opset: int) -> Rule | None:
    load_rules()
    rules = [r for r in table.get((normalize_domain(domain), op_type), []) if r.since <= opset]
    user = [r for r in rules if not r.builtin]
    return (user or rules)[-1] if rules else None


def is_non_differentiable(domain: str, op_type: str) -> bool:
    load_rules()
    key = (normalize_domain(domain), op_type)
    if key not in _NO_GRADIENT:
        return False
    # a user's rule for an op the built-ins declare non-differentiable wins
    return not any(not r.builtin for r in _RULES.get(key, []))


def registered_rules() -> dict[tuple[str, str], list[Rule]]:
    load_rules()
    return {k: list(v) for k, v in _RULES.items()}


def registered_jvp_rules() -> dict[tuple[str, str], list[Rule]]:
    load_rules()
    return {k: list(v) for k, v in _JVP_RULES.items()}


def non_differentiable_ops() -> dict[tuple[str, str], str]:
    load_rules()
    return dict(_NO_GRADIENT)


@contextmanager
def scratch_registry() -> Iterator[None]:
    """Whatever is registered (or declared without gradient) inside the block is undone when it ends:
    for tests and doc snippets that register rules of their own."""
    load_rules()
    rules = {k: list(v) for k, v in _RULES.items()}
    jvps = {k: list(v) for k, v in _JVP_RULES.items()}
    no_grad = dict(_NO_GRADIENT)
    stand_ins = dict(STAND_INS)
    try:
        yield
    finally:
        _RULES.clear()
        _RULES.update(rules)
        _JVP_RULES.clear()
        _JVP_RULES.update(jvps)
        _NO_GRADIENT.clear()
        _NO_GRADIENT.update(no_grad)
        STAND_INS.clear()
        STAND_INS.update(stand_ins)


@contextmanager
def override_rule(op_type: str, fn: Callable, *, domain: str = "", since: int = 1) -> Iterator[None]:
    """Within the block ``fn`` is the rule for ``op_type`` (taken as a user's rule); after it, the registry
    is as it was."""
    with scratch_registry():
        gradient_rule(op_type, domain=domain, since=since)(fn)
        yield
