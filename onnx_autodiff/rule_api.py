"""All a gradient rule imports: ``from onnx_autodiff.rule_api import ...``.

Registration (``gradient_rule``, ``jvp_rule``, ``derivative``, ``no_gradient``; ``gradient_group`` for nodes
differentiated as one op; ``type_rule`` for the type and shape of an op onnx has no schema for, with its
``StandIn`` emitter), what a rule sees of its node
(``NodeView``), what it builds with (``GradBuilder``), its result type (``Grads``), its one error
(``GradientRuleError``) and the float element types (``FLOAT_TYPES``). Rules for control flow also use
``onnx_autodiff.engine.subgraph``.
"""
from .engine.builder import GradBuilder, Grads, NodeView
from .engine.registry import derivative, gradient_group, gradient_rule, jvp_rule, no_gradient
from .engine.type_rules import StandIn, type_rule
from .errors import GradientRuleError
from .graph import FLOAT_TYPES

__all__ = ["gradient_rule", "jvp_rule", "derivative", "no_gradient", "gradient_group", "type_rule", "StandIn",
           "GradBuilder", "NodeView", "Grads", "GradientRuleError", "FLOAT_TYPES"]
