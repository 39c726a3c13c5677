"""The gradient-rule registry: one table keyed by (domain, op_type), each entry with an opset floor.

Rules live in the ``gradient_rules`` package; this module only stores them. ``load_rules`` imports
that package once so the registry fills itself.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

ONNX_DOMAIN = ""
_DOMAIN_ALIASES = {"ai.onnx": ""}


def normalize_domain(domain: str) -> str:
    return _DOMAIN_ALIASES.get(domain or "", domain or "")


@dataclass(frozen=True)
class Rule:
    fn: Callable
    op_type: str
    domain: str
    since: int  # the lowest opset this rule handles


_RULES: dict[tuple[str, str], list[Rule]] = {}
_NO_GRADIENT: dict[tuple[str, str], str] = {}
_loaded = False


def gradient_rule(*op_types: str, domain: str = "", since: int = 1):
    """Register ``fn(g, node, dy) -> list of input gradients`` for each op type.

    ``since`` is the opset floor: for a node at opset v, the rule with the largest ``since <= v`` wins,
    so a rule for a newer operator version can sit beside the older one.
    """
    if not op_types:
        raise ValueError("gradient_rule needs at least one op type")

    def register(fn):
        for op in op_types:
            key = (normalize_domain(domain), op)
            rules = [r for r in _RULES.get(key, []) if r.since != since]
            rules.append(Rule(fn, op, key[0], since))
            _RULES[key] = sorted(rules, key=lambda r: r.since)
        return fn

    return register


def no_gradient(*op_types: str, domain: str = "", reason: str = "not differentiable"):
    """Declare ops whose outputs carry no gradient (Shape, comparisons, ArgMax, Floor, ...).

    'No gradient' is an answer: gradients simply stop there. It differs from 'no rule', which is an error.
    """
    for op in op_types:
        _NO_GRADIENT[(normalize_domain(domain), op)] = reason


def load_rules() -> None:
    """Import the ``gradient_rules`` package once (its modules register themselves)."""
    global _loaded
    if not _loaded:
        importlib.import_module("gradient_rules")
        _loaded = True


def find_rule(domain: str, op_type: str, opset: int) -> Rule | None:
    load_rules()
    for rule in reversed(_RULES.get((normalize_domain(domain), op_type), [])):
        if rule.since <= opset:
            return rule
    return None


def is_non_differentiable(domain: str, op_type: str) -> bool:
    load_rules()
    return (normalize_domain(domain), op_type) in _NO_GRADIENT


def registered_rules() -> dict[tuple[str, str], list[Rule]]:
    load_rules()
    return {k: list(v) for k, v in _RULES.items()}


def non_differentiable_ops() -> dict[tuple[str, str], str]:
    load_rules()
    return dict(_NO_GRADIENT)
