"""The cheap forms the forward mode emits for the ops a CNN spends its time in (MaxPool, BatchNormalization,
Relu, Conv), held against a direct numpy reference and the reverse mode (jvp_check), ties included."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import onnx_autodiff as oa
from tests.models import model, vi
from tests.torch_export import session

D = TensorProto.DOUBLE


def tied(shape, seed=0) -> np.ndarray:
    """ReLU'd noise with whole rows of ones and of zeros: windows whose maximum is reached more than once."""
    x = np.maximum(np.random.default_rng(seed).standard_normal(shape), 0.0)
    x[:, :, 1::4] = 1.0
    x[:, :, 2::5] = 0.0
    return x


def first_max_tangent(x: np.ndarray, dx: np.ndarray, k: int) -> np.ndarray:
    """dx at the first maximum (row-major in the window) of every k x k window that tiles x."""
    n, c, h, w = x.shape
    win = x.reshape(n, c, h // k, k, w // k, k).transpose(0, 1, 2, 4, 3, 5).reshape(n, c, h // k, w // k, k * k)
    dwin = dx.reshape(n, c, h // k, k, w // k, k).transpose(0, 1, 2, 4, 3, 5).reshape(n, c, h // k, w // k, k * k)
    return np.take_along_axis(dwin, win.argmax(-1)[..., None], -1)[..., 0]


@pytest.mark.parametrize("k,dims", [(2, ["N", 3, 8, 6]), (3, [2, 3, 9, 6]), (2, ["N", "C", 8, 6])])
def test_max_pool_tangent_of_tiling_windows_is_the_first_maximums(k, dims):
    shape = (2, 3) + tuple(dims[2:])
    pool = model([helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[k, k], strides=[k, k])],
                 [vi("x", dims, D)], [vi("y", dims[:2] + [dims[2] // k, dims[3] // k], D)])
    out = oa.jvp(pool, ["x"])
    ops = [n.op_type for n in out.graph.node]
    assert "SpaceToDepth" in ops and not any(n.op_type == "MaxPool" and len(n.output) > 1 for n in out.graph.node)
    x = tied(shape)
    dx = np.random.default_rng(1).standard_normal(shape)
    _, t = session(out).run(None, {"x": x, "x.tangent": dx})
    assert np.array_equal(t, first_max_tangent(x, dx, k))
    assert oa.jvp_check(pool, {"x": x}).ok


def test_max_pool_windows_that_do_not_tile_keep_the_indices_form():
    pool = model([helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2])],
                 [vi("x", [2, 3, 7, 6], D)], [vi("y", [2, 3, 3, 3], D)])
    out = oa.jvp(pool, ["x"])
    assert "SpaceToDepth" not in [n.op_type for n in out.graph.node]
    assert oa.jvp_check(pool, {"x": tied((2, 3, 7, 6))}).ok


def test_relu_tangent_reads_the_output_so_nothing_else_reads_the_input():
    relu = model([helper.make_node("Add", ["x", "b"], ["z"]), helper.make_node("Relu", ["z"], ["y"])],
                 [vi("x", ["N", 4], D)], [vi("y", ["N", 4], D)], {"b": np.zeros(4)})
    out = oa.jvp(relu, ["x", "b"])
    assert [n.op_type for n in out.graph.node if "z" in n.input] == ["Relu"]
    x = tied((2, 1, 5, 4)).reshape(10, 4) - 0.5  # zeros and ties across the kink included
    dx = np.random.default_rng(2).standard_normal(x.shape)
    _, t = session(out).run(None, {"x": x, "x.tangent": dx, "b.tangent": np.zeros(4)})
    assert np.array_equal(t, dx * (x > 0))
    assert oa.jvp_check(relu, {"x": x}).ok


def conv_bn(group: int = 1, bias: bool = True, extra_reader: bool = False, dtype=D):
    rng = np.random.default_rng(group)
    c = 4
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    inits = {"W": rng.standard_normal((c, c // group, 3, 3)), "scale": rng.uniform(0.5, 1.5, c),
             "B": rng.standard_normal(c), "mean": rng.standard_normal(c), "var": rng.uniform(0.5, 1.5, c)}
    if bias:
        inits["b"] = rng.standard_normal(c)
    inits = {k: v.astype(np_type) for k, v in inits.items()}
    nodes = [helper.make_node("Conv", ["x", "W"] + (["b"] if bias else []), ["z"], pads=[1, 1, 1, 1], group=group),
             helper.make_node("BatchNormalization", ["z", "scale", "B", "mean", "var"], ["y"], epsilon=1e-3)]
    outputs = [vi("y", ["N", c, 5, 4], dtype)]
    if extra_reader:
        nodes.append(helper.make_node("Tanh", ["z"], ["t"]))
        outputs.append(vi("t", ["N", c, 5, 4], dtype))
    return model(nodes, [vi("x", ["N", c, 5, 4], dtype)], outputs, inits), sorted(inits)


def readers(m, name):
    return [n.op_type for n in m.graph.node if name in n.input]


@pytest.mark.parametrize("group,bias", [(1, True), (1, False), (4, True)])
def test_batch_norm_tangent_after_a_conv_folds_into_the_convolutions(group, bias):
    m, weights = conv_bn(group, bias)
    assert readers(oa.jvp(m, ["x"] + weights), "z") == ["BatchNormalization"]
    x = np.random.default_rng(3).standard_normal((2, 4, 5, 4))
    assert oa.jvp_check(m, {"x": x}, wrt=["x"] + weights).ok
    assert readers(oa.jvp(m, ["scale"]), "z") == ["BatchNormalization"]  # x a + c as one Conv of x0 by W a
    assert oa.jvp_check(m, {"x": x}, wrt=["scale", "var"]).ok


@pytest.mark.parametrize("group,bias", [(1, True), (2, False), (2, True)])
def test_folded_batch_norm_tangent_equals_the_unfolded_one(group, bias):
    """float32 in onnxruntime (no float64 Conv there): the folded form against the general rule, which a second
    reader of the Conv's output keeps."""
    m, weights = conv_bn(group, bias, dtype=TensorProto.FLOAT)
    plain, _ = conv_bn(group, bias, extra_reader=True, dtype=TensorProto.FLOAT)
    folded, unfolded = oa.jvp(m, ["x"] + weights), oa.jvp(plain, ["x"] + weights)
    assert readers(folded, "z") == ["BatchNormalization"] and len(readers(unfolded, "z")) > 2
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((2, 4, 5, 4)).astype(np.float32)}
    for w in ["x"] + weights:
        shape = feeds["x"].shape if w == "x" else next(t.dims for t in m.graph.initializer if t.name == w)
        feeds[f"{w}.tangent"] = rng.standard_normal(tuple(shape)).astype(np.float32)
    got = session(folded).run(["y.tangent"], feeds)[0]
    want = session(unfolded).run(["y.tangent"], feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_batch_norm_tangent_of_a_conv_output_read_elsewhere_is_not_folded():
    m, weights = conv_bn(extra_reader=True)
    assert len(readers(oa.jvp(m, ["x"] + weights), "z")) > 2
    assert oa.jvp_check(m, {"x": np.random.default_rng(4).standard_normal((2, 4, 5, 4))}, wrt=["x"] + weights).ok


def test_relu_mask_of_a_relu_before_a_max_pool_is_applied_to_the_pooled_tangent():
    shape = (2, 3, 8, 6)
    m = model([helper.make_node("Relu", ["x"], ["r"]),
               helper.make_node("MaxPool", ["r"], ["y"], kernel_shape=[2, 2], strides=[2, 2])],
              [vi("x", ["N", 3, 8, 6], D)], [vi("y", ["N", 3, 4, 3], D)])
    out = oa.jvp(m, ["x"])
    assert readers(out, "x.tangent") == ["SpaceToDepth"]  # no full-size Relu mask
    x = tied(shape) - 0.5 * (np.random.default_rng(6).random(shape) < 0.3)  # negative windows and zero ties
    dx = np.random.default_rng(7).standard_normal(shape)
    _, t = session(out).run(None, {"x": x, "x.tangent": dx})
    assert np.array_equal(t, first_max_tangent(np.maximum(x, 0), dx * (x > 0), 2))
    assert oa.jvp_check(m, {"x": x}).ok
