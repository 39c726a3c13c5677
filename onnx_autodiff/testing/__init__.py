"""Testing helpers for rules and models.

- One-node rule cases (``In``, ``RuleCase``, ``rule_case_model``, ``check_rule_case``, ``check_rule_case_jvp``;
  ``substitute`` / ``check_reference`` for a case's standard-ONNX reference form): the table every built-in
  rule is checked by (``onnx_autodiff/conformance/cases/``).
- Node templates (``node_templates``): the same cases read as "how to make a valid node of this op".
- Hypothesis strategies: shapes and one-node cases (``shapes``, ``broadcast_shapes``, ``symbolic_dims``,
  ``inputs``, ``unary_cases``, ``binary_broadcast_cases``), random graphs made from the rule cases
  (``rule_graphs``; ``check_graph`` holds one against float64 central differences) and chains of matrix
  products (``linalg_graphs``).

The strategies need hypothesis (``pip install 'onnx-autodiff[testing]'``); importing this package does not
import it, and a strategy asked for without it raises ``MissingExtraError`` naming the extra.
"""
from __future__ import annotations

import importlib

from .rule_cases import In, RuleCase, check_reference, check_rule_case, check_rule_case_jvp, rule_case_model, substitute
from .templates import NodeTemplate, node_templates

_LAZY = {
    "shapes": "strategies", "broadcast_shapes": "strategies", "symbolic_dims": "strategies", "inputs": "strategies",
    "unary_cases": "strategies", "binary_broadcast_cases": "strategies",
    "rule_graphs": "graphs", "FuzzGraph": "check", "check_graph": "check", "Uncheckable": "check",
    "DECLINED": "check",
    "linalg_graphs": "linalg",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["In", "RuleCase", "check_rule_case", "check_rule_case_jvp", "check_reference", "substitute",
           "rule_case_model", "NodeTemplate", "node_templates", *_LAZY]
