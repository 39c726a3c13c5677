"""Property tests of the one shared unbroadcast helper, static and run-time paths."""
from hypothesis import given, settings

from onnx_autodiff.engine.builder import broadcast_axes
from onnx_autodiff.testing import binary_broadcast_cases, broadcast_shapes, check_rule_case


@settings(max_examples=25, deadline=None)
@given(binary_broadcast_cases("Mul", symbolic=True))
def test_mul_gradient_for_any_broadcast_pair_and_symbolic_dims(case):
    assert check_rule_case(case).ok


@settings(max_examples=15, deadline=None)
@given(binary_broadcast_cases("Add", symbolic=False, opset=12))
def test_add_gradient_static_unbroadcast_below_opset_13(case):
    assert check_rule_case(case).ok


@settings(max_examples=200, deadline=None)
@given(broadcast_shapes())
def test_static_broadcast_axes_reduce_z_to_x(pair):
    import numpy as np

    a, b = pair
    z = np.broadcast_shapes(a, b)
    for x in (a, b):
        lead, kept = broadcast_axes(x, z)
        reduced = np.ones(z).sum(axis=tuple(range(lead)) + tuple(kept), keepdims=True)
        assert reduced.reshape(reduced.shape[lead:]).shape == x


def test_symbolic_dim_facing_a_different_dim_is_left_to_run_time():
    assert broadcast_axes(("N", 3), (4, 3)) is None
    assert broadcast_axes(("N", 3), ("N", 3)) == (0, [])
    assert broadcast_axes((1, 3), ("N", 3)) == (0, [0])
    assert broadcast_axes(None, (2,)) is None
