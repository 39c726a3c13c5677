"""MaxPool's tangent read at Indices the graph computes anyway (the node's own, or the gradient's MaxPool in
``hvp``): one GatherElements over the flattened tangent instead of SpaceToDepth + ArgMax. Held against the form
before it (``max_pool_shared_indices`` off), a numpy first-maximum reference with ties, and central differences of the
gradient in float64 (the gradient's MaxUnpool, which onnxruntime has no float64 kernel of, switched to its
scatter form: ``unpool_disjoint`` off)."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

import onnx_autodiff as oa
from onnx_autodiff.engine.builder import emit_options
from tests.forward.test_fast_forms import first_max_tangent, tied
from tests.models import model, vi
from tests.torch_export import session

D = TensorProto.DOUBLE
POOL = {"kernel_shape": [2, 2], "strides": [2, 2]}


def relu_pool(dtype: int = D):
    """loss = sum(MaxPool(Relu(x * W))^2) * scale: a Relu before a tiling 2x2 pool, as in a CNN; W elementwise."""
    nodes = [helper.make_node("Mul", ["x", "W"], ["z"]), helper.make_node("Relu", ["z"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], **POOL), helper.make_node("Mul", ["p", "p"], ["p2"]),
             helper.make_node("ReduceSum", ["p2"], ["loss"], keepdims=0)]
    w = np.random.default_rng(3).standard_normal((1, 3, 8, 6)).astype(np.float64 if dtype == D else np.float32)
    return model(nodes, [vi("x", ["N", 3, 8, 6], dtype)], [vi("loss", [], dtype)], {"W": w})


def ops(m) -> list[str]:
    return [n.op_type for n in m.graph.node]


def hvp64(m, **options):
    with emit_options(unpool_disjoint=False, **options):
        return oa.hvp(m, ["W", "x"])


def test_hvp_reads_the_gradients_indices_and_equals_the_form_before():
    m = relu_pool()
    new, old = hvp64(m), hvp64(m, max_pool_shared_indices=False)
    assert ops(old).count("SpaceToDepth") == 2 and "ArgMax" in ops(old)
    assert "SpaceToDepth" not in ops(new) and "ArgMax" not in ops(new)
    assert sum(n.op_type == "MaxPool" and len(n.output) > 1 for n in new.graph.node) == 1  # the gradient's alone
    rng = np.random.default_rng(5)
    x = tied((2, 3, 8, 6)) - 0.5 * (rng.random((2, 3, 8, 6)) < 0.3)  # ties, zero windows, negatives
    feeds = {"x": x, "x.tangent": rng.standard_normal(x.shape), "W.tangent": rng.standard_normal((1, 3, 8, 6))}
    names = ["W.grad", "x.grad", "W.hvp", "x.hvp"]
    for a, b in zip(session(new).run(names, feeds), session(old).run(names, feeds)):
        assert np.array_equal(a, b)


def test_hvp_equals_central_differences_of_the_gradient():
    m = relu_pool()
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 8, 6))  # no ties: the gradient is smooth around x
    vx, vw = rng.standard_normal(x.shape), rng.standard_normal((1, 3, 8, 6))
    grad = hvp64(m)
    hw, hx = session(grad).run(["W.hvp", "x.hvp"], {"x": x, "x.tangent": vx, "W.tangent": vw})
    w = next(t for t in grad.graph.initializer if t.name == "W")
    w0 = np.frombuffer(w.raw_data, np.float64).reshape(1, 3, 8, 6).copy() if w.raw_data else np.array(w.double_data)
    eps = 1e-6

    def gradients(sign: float):
        w.ClearField("double_data")
        w.raw_data = (w0 + sign * eps * vw).tobytes()
        return session(grad).run(["W.grad", "x.grad"], {"x": x + sign * eps * vx, "x.tangent": vx, "W.tangent": vw})

    (gw1, gx1), (gw0, gx0) = gradients(1.0), gradients(-1.0)
    assert np.allclose(hw, (gw1 - gw0) / (2 * eps), rtol=1e-6, atol=1e-6)
    assert np.allclose(hx, (gx1 - gx0) / (2 * eps), rtol=1e-6, atol=1e-6)


def test_jvp_reads_the_nodes_own_indices():
    pool = model([helper.make_node("MaxPool", ["x"], ["y", "i"], **POOL)],
                 [vi("x", ["N", 3, 8, 6], D)], [vi("y", ["N", 3, 4, 3], D), vi("i", ["N", 3, 4, 3], TensorProto.INT64)])
    out = oa.jvp(pool, ["x"])
    assert ops(out).count("MaxPool") == 1 and "SpaceToDepth" not in ops(out) and "GatherElements" in ops(out)
    x = tied((2, 3, 8, 6))
    dx = np.random.default_rng(1).standard_normal(x.shape)
    t = session(out).run(["y.tangent"], {"x": x, "x.tangent": dx})[0]
    assert np.array_equal(t, first_max_tangent(x, dx, 2))
    assert oa.jvp_check(pool, {"x": x}, of="y").ok


def test_windows_that_do_not_tile_gather_at_the_indices():
    pool = model([helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2])],
                 [vi("x", ["N", 3, 9, 7], D)], [vi("y", ["N", 3, 4, 3], D)])
    out = oa.jvp(pool, ["x"])
    assert "GatherElements" in ops(out) and "Gather" not in ops(out) and "SpaceToDepth" not in ops(out)
    assert oa.jvp_check(pool, {"x": tied((2, 3, 9, 7))}).ok


def test_relu_read_by_two_pools_of_one_window_is_masked_once_pooled():
    m = model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("MaxPool", ["r"], ["y"], **POOL),
               helper.make_node("MaxPool", ["r"], ["y2", "i"], **POOL), helper.make_node("Add", ["y", "y2"], ["s"])],
              [vi("x", ["N", 3, 8, 6], D)], [vi("s", ["N", 3, 4, 3], D)])
    out = oa.jvp(m, ["x"])
    assert "Greater" in ops(out) and not any(n.op_type == "Cast" and "x" in n.input for n in out.graph.node)
    rng = np.random.default_rng(7)
    x = tied((2, 3, 8, 6)) - 0.5 * (rng.random((2, 3, 8, 6)) < 0.3)
    dx = rng.standard_normal(x.shape)
    t = session(out).run(["s.tangent"], {"x": x, "x.tangent": dx})[0]
    assert np.array_equal(t, 2 * first_max_tangent(np.maximum(x, 0), dx * (x > 0), 2))
    assert oa.jvp_check(m, {"x": x}).ok


def test_float64_reference_gathers_elements_along_an_axis_longer_than_64():
    from onnx_autodiff.runtimes.reference_ops import Float64Evaluator

    m = model([helper.make_node("GatherElements", ["d", "i"], ["t"], axis=-1)],
              [vi("d", [2, 300], D), vi("i", [2, 5], TensorProto.INT64)], [vi("t", [2, 5], D)])
    d = np.random.default_rng(8).standard_normal((2, 300))
    i = np.array([[0, 299, -1, 150, 64], [-300, 1, 2, 200, 65]])
    t, = Float64Evaluator(m).run(None, {"d": d, "i": i})
    assert np.array_equal(t, np.take_along_axis(d, i % 300, axis=-1))
