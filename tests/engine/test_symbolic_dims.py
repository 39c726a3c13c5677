"""A model with a dynamic batch dim keeps it through lowering, and its gradients hold at any batch size."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_autodiff
from tests.models import model_of

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 3)).astype(np.float32)
B = RNG.standard_normal(3).astype(np.float32)


def batch_model():
    """loss = mean(x @ W + b) over a batch of N rows, with Gradient wrt W, b and x (opset 17)."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["z"]),
        helper.make_node("Mul", ["z", "z"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0),
        helper.make_node("Gradient", ["W", "b", "x"], ["dW", "db", "dx"], domain="ai.onnx.preview.training",
                         xs=["W", "b", "x"], y="loss"),
    ]
    graph = helper.make_graph(
        nodes, "batch",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("dW", TensorProto.FLOAT, [4, 3]),
         helper.make_tensor_value_info("db", TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info("dx", TensorProto.FLOAT, ["N", 4])],
        initializer=[numpy_helper.from_array(W, "W"), numpy_helper.from_array(B, "b")],
    )
    return model_of(graph, training=True, ir_version=8)


def expected(x):
    z = x.astype(np.float64) @ W + B
    dz = 2 * z / z.size
    return (z * z).mean(), x.T.astype(np.float64) @ dz, dz.sum(0), dz @ W.T.astype(np.float64)


@pytest.fixture(scope="module")
def lowered():
    return onnx_autodiff.lower(batch_model())


def test_lowered_inputs_and_outputs_keep_the_symbolic_batch_dim(lowered):
    x, = [i for i in lowered.graph.input if i.name == "x"]
    dims = x.type.tensor_type.shape.dim
    assert dims[0].dim_param == "N" and not dims[0].HasField("dim_value")
    assert dims[1].dim_value == 4
    dx, = [o for o in lowered.graph.output if o.name == "dx"]
    assert dx.type.tensor_type.shape.dim[0].dim_param == "N"
    assert not any(n.domain == "ai.onnx.preview.training" for n in lowered.graph.node)


@pytest.mark.parametrize("n", [1, 5, 8])
def test_gradients_at_several_batch_sizes(lowered, n):
    sess = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])
    x = RNG.standard_normal((n, 4)).astype(np.float32)
    loss, dw, db, dx = sess.run(["loss", "dW", "db", "dx"], {"x": x})
    want = expected(x)
    for got, ref in zip((loss, dw, db, dx), want):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    assert dx.shape == (n, 4)


def test_one_session_serves_two_batch_sizes(lowered):
    """The lowered graph holds no shape folded from one batch size: one session runs both."""
    sess = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])
    for n in (2, 7):
        x = RNG.standard_normal((n, 4)).astype(np.float32)
        _, dw, db, dx = sess.run(["loss", "dW", "db", "dx"], {"x": x})
        _, ew, eb, ex = expected(x)
        np.testing.assert_allclose(dw, ew, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(db, eb, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(dx, ex, rtol=1e-4, atol=1e-5)


def test_symbolic_batch_through_shape_rules():
    """Gather, Slice, Concat and Tile over a symbolic batch dim (run-time shape arithmetic)."""
    nodes = [
        helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["s"]),
        helper.make_node("Concat", ["s", "x"], ["c"], axis=0),
        helper.make_node("Tile", ["c", "reps"], ["t"]),
        helper.make_node("Gather", ["t", "idx"], ["gth"], axis=0),
        helper.make_node("ReduceSumSquare", ["gth"], ["loss"], keepdims=0),
        helper.make_node("Gradient", ["x"], ["dx"], domain="ai.onnx.preview.training", xs=["x"], y="loss"),
    ]
    ints = lambda name, v: numpy_helper.from_array(np.asarray(v, dtype=np.int64), name)  # noqa: E731
    graph = helper.make_graph(
        nodes, "shapes", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("dx", TensorProto.FLOAT, ["N", 3])],
        initializer=[ints("starts", [-1]), ints("ends", [-(2 ** 62)]), ints("axes", [0]), ints("steps", [-2]),
                     ints("reps", [2, 1]), ints("idx", [0, 1, 1])],
    )
    model = model_of(graph, training=True, ir_version=8)
    sess = ort.InferenceSession(onnx_autodiff.lower(model).SerializeToString(), providers=["CPUExecutionProvider"])
    for n in (3, 4):
        x = RNG.standard_normal((n, 3)).astype(np.float32)
        t = np.tile(np.concatenate([x[::-1][::2], x]), (2, 1))
        # d/dt of sum(t[idx]^2) scattered back to x by hand
        dt = np.zeros_like(t, dtype=np.float64)
        for i in (0, 1, 1):
            dt[i] += 2 * t[i]
        c_len = len(x[::-1][::2]) + n
        dc = dt[:c_len] + dt[c_len:]
        want = dc[len(x[::-1][::2]):].copy()
        picked = np.arange(n)[::-1][::2]
        want[picked] += dc[:len(picked)]
        got, = sess.run(["dx"], {"x": x})
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
