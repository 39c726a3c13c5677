"""Property tests of the one shared unbroadcast helper, static and run-time paths."""
from hypothesis import given, settings

from onnx_autodiff.engine.builder import broadcast_plan
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
        lead, kept, unsure, rank = broadcast_plan(x, z)
        assert unsure == [] and rank == len(z)
        reduced = np.ones(z).sum(axis=tuple(range(lead)) + tuple(kept), keepdims=True)
        assert reduced.reshape(reduced.shape[lead:]).shape == x


def test_symbolic_dim_facing_a_different_dim_is_left_to_run_time():
    assert broadcast_plan(("N", 3), (4, 3)) == (0, [], [0], 2)
    assert broadcast_plan(("N", 3), ("N", 3)) == (0, [], [], 2)
    assert broadcast_plan((1, 3), ("N", 3)) == (0, [0], [], 2)
    assert broadcast_plan(None, (2,)) is None


def test_broadcast_plan_leaves_only_dims_the_shapes_cannot_tell():
    # GPT-2's attention mask [B, 1, 1, S] against the scores [B, H, S, S]: the shapes fix the axes
    assert broadcast_plan(("B", 1, 1, "S"), ("B", "H", "S", "S")) == (0, [1, 2], [], 4)
    # a residual Add whose dims a TorchScript export named apart: 1 or the same at run time
    assert broadcast_plan(("a", "b", 64), ("c", "d", 64)) == (0, [], [0, 1], 3)
    assert broadcast_plan(("a", 3), (5, "z", 2, 3)) == (2, [], [2], 4)
    assert broadcast_plan((4, "a"), ("b", 1)) == (0, [], [], 2)  # z's 1 means x's 1; x's 4 means z's 4
    assert broadcast_plan(None, (2,)) is None


def _residual_add(x_dims, z_dims, y_dims):
    """loss = ReduceSum(Tanh(x) + y), x and y declared with dims the shapes cannot relate."""
    from onnx import TensorProto, helper

    f = lambda n, d: helper.make_tensor_value_info(n, TensorProto.DOUBLE, d)  # noqa: E731
    nodes = [helper.make_node("Tanh", ["x"], ["t"]), helper.make_node("Add", ["t", "y"], ["z"]),
             helper.make_node("ReduceSum", ["z"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [f("x", x_dims), f("y", y_dims)], [f("loss", [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_ranked_unbroadcast_has_axes_of_static_length_and_is_right():
    """Ranks known, dims unrelated: the axes come from Shape(x) at run time into a tensor of static length (no
    NonZero, which OpenVINO refuses); where x is broadcast at run time and where it is not, central differences
    agree."""
    import numpy as np

    from onnx_autodiff import gradcheck, lower
    from onnx_autodiff.check.gradcheck import gradient_model

    model = _residual_add(["a", "b", 4], None, ["c", "d", 4])
    lowered = lower(gradient_model(model, ["loss"], ["x", "y"], {"loss": [], "x": ["a", "b", 4],
                                                                  "y": ["c", "d", 4]}))
    ops = [n.op_type for n in lowered.graph.node]
    assert "NonZero" not in ops and "ReduceSum" in ops
    rng = np.random.default_rng(0)
    for xs, ys in (((2, 3, 4), (2, 3, 4)), ((2, 1, 4), (2, 3, 4)), ((2, 3, 4), (1, 3, 4)), ((2, 3, 4), (1, 1, 4))):
        assert gradcheck(model, {"x": rng.standard_normal(xs), "y": rng.standard_normal(ys)}).ok


def test_unknown_rank_falls_back_to_nonzero():
    """x reshaped by a shape fed at run time has no rank the lowering can know."""
    import numpy as np
    from onnx import TensorProto, helper

    from onnx_autodiff import gradcheck, lower
    from onnx_autodiff.check.gradcheck import gradient_model

    f = helper.make_tensor_value_info
    nodes = [helper.make_node("Reshape", ["x", "s"], ["t"]), helper.make_node("Add", ["t", "y"], ["z"]),
             helper.make_node("ReduceSum", ["z"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [f("x", TensorProto.DOUBLE, [24]), f("s", TensorProto.INT64, ["k"]),
                                           f("y", TensorProto.DOUBLE, ["c", 4])], [f("loss", TensorProto.DOUBLE, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    lowered = lower(gradient_model(model, ["loss"], ["y"], {"loss": [], "y": ["c", 4]}))
    assert "NonZero" in [n.op_type for n in lowered.graph.node]
    feeds = {"x": np.arange(24.0), "s": np.array([2, 3, 4]), "y": np.ones((3, 4))}
    assert gradcheck(model, feeds, wrt=["y"]).ok
    assert gradcheck(model, {**feeds, "y": np.ones((1, 4))}, wrt=["y"]).ok
