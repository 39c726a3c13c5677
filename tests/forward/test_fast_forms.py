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
