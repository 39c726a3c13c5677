"""The forward walk's hook for a JVP rule that computes its node's outputs itself (``GradBuilder.replace_outputs``):
the node is dropped from the jvp model and the rule's tensors stand for its outputs; where a walk cannot drop a
node (``jacobian``) the rule is told so and keeps the node."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import onnx_autodiff as oa
from onnx_autodiff.engine.registry import scratch_registry
from onnx_autodiff.errors import GradientRuleError
from onnx_autodiff.rule_api import jvp_rule
from tests.models import model, vi
from tests.torch_export import session

D = TensorProto.DOUBLE


def tanh_model():
    return model([helper.make_node("Tanh", ["x"], ["t"], name="tanh"), helper.make_node("Mul", ["t", "x"], ["y"])],
                 [vi("x", [3], D)], [vi("y", [3], D)])


def register(seen: list, force: bool = False):
    @jvp_rule("Tanh")
    def tanh_jvp(g, node, dx):
        seen.append(g.can_replace_outputs())
        if not (force or g.can_replace_outputs()):
            return NotImplemented
        y = g.Tanh(node.inputs[0])
        g.replace_outputs(node, [y])
        return [g.Mul(dx[0], g.Sub(g.const(1.0, like=y), g.Mul(y, y)))]


def test_a_replaced_node_is_dropped_and_its_outputs_come_from_the_rule():
    seen = []
    with scratch_registry():
        register(seen)
        out = oa.jvp(tanh_model(), ["x"])
    assert seen == [True]
    assert "tanh" not in [n.name for n in out.graph.node]
    x, dx = np.array([0.3, -1.2, 2.0]), np.array([1.0, 0.5, -2.0])
    y, t = session(out).run(None, {"x": x, "x.tangent": dx})
    np.testing.assert_allclose(y, np.tanh(x) * x, rtol=1e-15)
    np.testing.assert_allclose(t, dx * (1 - np.tanh(x) ** 2) * x + np.tanh(x) * dx, rtol=1e-14)


def test_a_walk_that_cannot_drop_a_node_says_so_and_refuses_a_replacement():
    seen = []
    with scratch_registry():
        register(seen)
        jac = oa.jacobian(tanh_model(), "y", "x")
        assert "tanh" in [n.name for n in jac.graph.node]
        register(seen, force=True)
        with pytest.raises(GradientRuleError, match="cannot drop a node"):
            oa.jacobian(tanh_model(), "y", "x")
    assert seen[0] is False
