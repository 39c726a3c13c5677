"""A user's rules, registered through the public names, are the ones lower() uses."""
import numpy as np
import onnxruntime as ort
from onnx import helper

import onnx_autodiff as oa
from onnx_autodiff.engine import registry
from tests.models import TRAIN, model, vi

C = np.array([0.5, -2.0, 3.0, 1.5], dtype=np.float32)


def _floor_model():
    """s = sum(Floor(x) * c), and its Gradient with respect to x."""
    nodes = [helper.make_node("Floor", ["x"], ["f"], name="floor"),
             helper.make_node("Mul", ["f", "c"], ["p"], name="mul"),
             helper.make_node("ReduceSum", ["p"], ["s"], name="sum", keepdims=0),
             helper.make_node("Gradient", ["x"], ["dx"], name="grad", domain=TRAIN, xs=["x"], y="s")]
    return model(nodes, [vi("x", [4])], [vi("s", []), vi("dx", [4])], {"c": C}, training=True)


def _dx(m):
    sess = ort.InferenceSession(oa.lower(m).SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["dx"], {"x": np.array([0.3, 1.7, -2.2, 4.9], dtype=np.float32)})[0]


def test_a_users_straight_through_derivative_of_floor_is_used():
    """Floor is declared without gradient by the built-ins; a user's ``@derivative("Floor")`` (a straight-through
    estimator, d floor(x)/dx := 1) replaces that, so dx is c, not zeros."""
    assert not _dx(_floor_model()).any()  # the built-in answer: no gradient, zeros
    with registry.scratch_registry():

        @oa.derivative("Floor")
        def floor_straight_through(g, node, x, y):
            return g.ones_like(x)

        np.testing.assert_array_equal(_dx(_floor_model()), C)
        assert not registry.find_rule("", "Floor", 17).builtin
    assert not _dx(_floor_model()).any()  # the scratch registry is gone with the block


def test_override_rule_replaces_a_builtin_rule_inside_the_block_only():
    def doubled_tanh_grad(g, node, dy):
        return [g.Mul(g.const(2.0, like=dy[0]), dy[0])]

    with registry.override_rule("Tanh", doubled_tanh_grad):
        assert registry.find_rule("", "Tanh", 17).fn is doubled_tanh_grad
    assert registry.find_rule("", "Tanh", 17).builtin
