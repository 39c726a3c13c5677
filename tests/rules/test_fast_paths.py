"""Rules with a fast form for the common case and a plain general form: both give the same gradient.

Each test builds the backward twice, once through the fast path and once through the plain one (a
module switch, or inputs that make the fast path inapplicable), checks which ops each emitted (so the
test fails if the fast path is not taken), and compares the gradients in onnxruntime.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import build_vjp
from onnx_autodiff.engine.builder import emit_options
from tests.models import run_ort

F32 = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=(), opset=17):
    """A model whose outputs get the shapes onnx's shape inference gives them."""
    graph = helper.make_graph(nodes, "m", inputs, [], list(inits))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(m).graph.value_info}
    m.graph.output.extend(inferred[o] for o in outputs)
    return m


def _grads(model, wrt, feeds, seed=0):
    """(gradients of sum(y * dy) w.r.t. ``wrt``, the op type of each backward node)."""
    v = build_vjp(model, wrt=wrt)
    fwd = run_ort(v.forward, feeds)
    rng = np.random.default_rng(seed)
    dy = {f"{o}_grad": rng.standard_normal(fwd[o].shape).astype(fwd[o].dtype) for o in v.outputs}
    back = run_ort(v.backward, {**feeds, **fwd, **dy})
    return {k: back[f"{k}_grad"] for k in wrt}, [n.op_type for n in v.backward.graph.node]


@pytest.mark.parametrize("attrs,shape_x,shape_w", [
    ({"pads": [1, 1, 1, 1]}, (4, 3, 9, 8), (5, 3, 3, 3)),
    ({"strides": [2, 2], "pads": [1, 0, 2, 1]}, (3, 4, 11, 9), (6, 4, 3, 2)),
    ({"dilations": [2, 1], "strides": [1, 3]}, (2, 3, 10, 10), (4, 3, 2, 3)),
    ({"strides": [2, 2]}, (2, 8, 7, 7), (16, 8, 1, 1)),
    ({"strides": [2], "pads": [3, 2]}, (3, 2, 17), (4, 2, 5)),
    ({"strides": [2, 2], "pads": [3, 3, 3, 3]}, (2, 3, 16, 16), (8, 3, 7, 7)),  # im2col columns: a stem
    ({"pads": [1, 1, 1, 1]}, (2, 1, 6, 6), (4, 1, 3, 3)),  # one input channel
])
@pytest.mark.parametrize("im2col_columns,batched", [(0, True), (10**9, False), (10**9, True)],
                         ids=["gemm-per-offset", "im2col-rows", "im2col-batched"])
def test_conv_weight_gradient_gemm_form_matches_conv_form(attrs, shape_x, shape_w, im2col_columns, batched):
    """The im2col rows as one Gemm of dz transposed to [M, out*N], or (stride 1) per sample by one batched
    MatMul of dz in its own layout."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape_x).astype(np.float32)
    w = rng.standard_normal(shape_w).astype(np.float32)
    model = _model([helper.make_node("Conv", ["x", "w"], ["y"], **attrs)],
                   [helper.make_tensor_value_info("x", F32, list(shape_x))],
                   ["y"], [numpy_helper.from_array(w, "w")])
    # the input gradient in its per-sample forms: the Gemms counted here are the weight gradient's
    with emit_options(im2col_columns=im2col_columns, im2col_batched=batched, batched_input_grad_max_out=0):
        fast, fast_ops = _grads(model, ["x", "w"], {"x": x})
    with emit_options(gemm_weight_grad=False, batched_input_grad_max_out=0):
        plain, plain_ops = _grads(model, ["x", "w"], {"x": x})
    by_matmul = batched and im2col_columns > 0 and all(s == 1 for s in attrs.get("strides", [1]))
    by_matmul = by_matmul and np.prod(shape_w[2:]) > 1
    assert ("MatMul" if by_matmul else "Gemm") in fast_ops and "Gemm" not in plain_ops
    assert ("Gemm" in fast_ops) != by_matmul
    scale = np.abs(plain["w"]).max()
    np.testing.assert_allclose(fast["w"], plain["w"], rtol=1e-4, atol=1e-5 * scale)
    np.testing.assert_allclose(fast["x"], plain["x"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("index,axis,shape", [
    (1, 0, (3, 4, 5)),  # q/k/v pick from a stacked projection
    (0, 1, (4, 6, 5)),  # a CLS token
    (-1, 2, (2, 3, 4)),
    ([2, 3, 4], 1, (2, 6, 3)),  # a block
])
def test_gather_constant_block_gradient_matches_scatter(index, axis, shape):
    rng = np.random.default_rng(2)
    x = rng.standard_normal(shape)
    idx = np.asarray(index, np.int64)
    vi = [helper.make_tensor_value_info("x", TensorProto.DOUBLE, list(shape))]
    out = ["y"]
    node = helper.make_node("Gather", ["x", "i"], ["y"], axis=axis)
    constant = _model([node], vi, out, [numpy_helper.from_array(idx, "i")])
    fed = _model([node], vi + [helper.make_tensor_value_info("i", TensorProto.INT64, list(idx.shape))], out)
    fast, fast_ops = _grads(constant, ["x"], {"x": x})
    plain, plain_ops = _grads(fed, ["x"], {"x": x, "i": idx})
    assert "Pad" in fast_ops and "ScatterElements" not in fast_ops and "ScatterElements" in plain_ops
    np.testing.assert_allclose(fast["x"], plain["x"], rtol=1e-12, atol=1e-12)


def test_gather_repeated_constant_indices_keep_the_scatter():
    node = helper.make_node("Gather", ["x", "i"], ["y"], axis=0)
    model = _model([node], [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [4, 3])],
                   ["y"],
                   [numpy_helper.from_array(np.array([1, 1, 2], np.int64), "i")])
    x = np.arange(12.0).reshape(4, 3)
    grads, ops = _grads(model, ["x"], {"x": x})
    assert "ScatterElements" in ops and "Pad" not in ops


@pytest.mark.parametrize("shape_a,dims_a", [((3, 5, 4), [3, 5, 4]), ((2, 3, 2, 4), ["N", "S", 2, 4])])
def test_matmul_by_matrix_weight_gradient_is_one_gemm(shape_a, dims_a):
    """B as a (K, N) matrix takes the Gemm form; the same B as a (1, K, N) tensor takes the batched
    MatMul + ReduceSum form; the gradients agree."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal(shape_a)
    b = rng.standard_normal((4, 6))
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    vi = [helper.make_tensor_value_info("a", TensorProto.DOUBLE, dims_a)]
    matrix = _model([node], vi, ["y"], [numpy_helper.from_array(b, "b")])
    batched = _model([node], vi, ["y"], [numpy_helper.from_array(b[None], "b")])
    fast, fast_ops = _grads(matrix, ["a", "b"], {"a": a})
    plain, plain_ops = _grads(batched, ["a", "b"], {"a": a})
    assert "Gemm" in fast_ops and "ReduceSum" not in fast_ops and "ReduceSum" in plain_ops
    np.testing.assert_allclose(fast["b"], plain["b"][0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(fast["a"], plain["a"], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("channels,kernel,gemms", [(3, 7, 1), (1, 3, 1), (64, 3, 9)])
def test_conv_weight_gradient_builds_im2col_columns_only_for_few_channels(channels, kernel, gemms):
    w = np.zeros((8, channels, kernel, kernel), np.float32)
    model = _model([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])],
                   [helper.make_tensor_value_info("x", F32, [2, channels, 12, 12])], ["y"],
                   [numpy_helper.from_array(w, "w")])
    backward = build_vjp(model, wrt=["w"]).backward
    assert sum(n.op_type in ("Gemm", "MatMul") for n in backward.graph.node) == gemms  # im2col: one batched MatMul


@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (6, 2), (3, 4, 7)])
def test_batch_norm_training_gradient_with_shared_sums_matches_general_form(shape):
    rng = np.random.default_rng(4)
    c = shape[1]
    x = rng.standard_normal(shape)
    inits = [numpy_helper.from_array(v, n) for n, v in
             [("s", rng.standard_normal(c)), ("b", rng.standard_normal(c)), ("m", np.zeros(c)), ("v", np.ones(c))]]
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"], training_mode=1)
    model = _model([node], [helper.make_tensor_value_info("x", TensorProto.DOUBLE, list(shape))], ["y"], inits)
    fast, fast_ops = _grads(model, ["x", "s", "b"], {"x": x})
    with emit_options(shared_channel_sums=False):
        plain, plain_ops = _grads(model, ["x", "s", "b"], {"x": x})
    assert fast_ops.count("ReduceSum") < plain_ops.count("ReduceSum")
    for k in ("x", "s", "b"):
        np.testing.assert_allclose(fast[k], plain[k], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape,opset", [((4, 3, 5, 6), 17), ((6, 2), 15), ((3, 4, 7), 9)])
def test_batch_norm_training_input_gradient_by_inference_batch_norm_matches_plain_form(shape, opset):
    """dz - mean(dz), scaled per channel, as one inference-mode BatchNormalization of dz."""
    rng = np.random.default_rng(5)
    c = shape[1]
    x = 3.0 + rng.standard_normal(shape)
    inits = [numpy_helper.from_array(v, n) for n, v in
             [("s", rng.standard_normal(c)), ("b", rng.standard_normal(c)), ("m", np.zeros(c)), ("v", np.ones(c))]]
    attrs, outputs = ({"training_mode": 1}, ["y", "rm", "rv"]) if opset >= 14 else ({}, ["y", "rm", "rv", "sm", "sv"])
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], outputs, **attrs)
    model = _model([node], [helper.make_tensor_value_info("x", TensorProto.DOUBLE, list(shape))], ["y"], inits,
                   opset=opset)
    fast, fast_ops = _grads(model, ["x", "s", "b"], {"x": x})
    with emit_options(batch_norm_affine_grad=False):
        plain, plain_ops = _grads(model, ["x", "s", "b"], {"x": x})
    assert "BatchNormalization" in fast_ops and "BatchNormalization" not in plain_ops
    assert fast_ops.count("Sub") + fast_ops.count("Add") < plain_ops.count("Sub") + plain_ops.count("Add")
    for k in ("x", "s", "b"):
        np.testing.assert_allclose(fast[k], plain[k], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape,attrs", [
    ((2, 3, 8, 6), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ((2, 3, 9, 6), {"kernel_shape": [3, 2], "strides": [3, 2]}),
    ((2, 3, 12), {"kernel_shape": [3], "strides": [3]}),
])
def test_max_pool_disjoint_gradient_by_unpool_matches_scatter(shape, attrs):
    """Ties everywhere (a ReLU'd input has all-zero windows, small integers repeat): both forms send dy
    to the first maximum of each window."""
    rng = np.random.default_rng(6)
    x = np.maximum(rng.integers(-3, 3, shape), 0).astype(np.float32)
    model = _model([helper.make_node("MaxPool", ["x"], ["y"], **attrs)],
                   [helper.make_tensor_value_info("x", F32, list(shape))], ["y"])
    fast, fast_ops = _grads(model, ["x"], {"x": x})
    with emit_options(unpool_disjoint=False):
        plain, plain_ops = _grads(model, ["x"], {"x": x})
    assert "MaxUnpool" in fast_ops and "ScatterElements" not in fast_ops and "ScatterElements" in plain_ops
    np.testing.assert_array_equal(fast["x"], plain["x"])
    windows = int(np.prod(attrs["kernel_shape"]))
    assert np.count_nonzero(fast["x"]) <= x.size // windows


@pytest.mark.parametrize("dims_x", [[3, 5, 4], ["N", 5, 4], [6, 4]])
def test_linear_with_transposed_weight_backward_has_no_transposes(dims_x):
    """``MatMul(X, Transpose(W))`` (a Linear exported without constant folding): dX = dY @ W and
    dW = dY^T @ X read neither the forward's Transpose nor one of their own."""
    rng = np.random.default_rng(7)
    shape_x = [3 if isinstance(d, str) else d for d in dims_x]
    x = rng.standard_normal(shape_x)
    w = rng.standard_normal((6, 4))
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "wt"], ["y"])]
    vi = [helper.make_tensor_value_info("x", TensorProto.DOUBLE, dims_x)]
    model = _model(nodes, vi, ["y"], [numpy_helper.from_array(w, "w")])
    fast, fast_ops = _grads(model, ["x", "w"], {"x": x})
    assert "wt" not in {i.name for i in build_vjp(model, wrt=["x", "w"]).backward.graph.input}
    with emit_options(fold_transposes=False):
        plain, plain_ops = _grads(model, ["x", "w"], {"x": x})
    assert "Transpose" not in fast_ops and "Transpose" in plain_ops
    for k in ("x", "w"):
        np.testing.assert_allclose(fast[k], plain[k], rtol=1e-12, atol=1e-12)


def test_transposed_gemm_fold_keeps_alpha_and_operand_flags():
    """Transpose(Gemm(A, B, transB=1, alpha)) becomes Gemm(B, A, transA=0, transB=1, alpha)."""
    rng = np.random.default_rng(8)
    a, b = rng.standard_normal((5, 3)), rng.standard_normal((4, 3))
    nodes = [helper.make_node("Gemm", ["a", "b"], ["p"], transB=1, alpha=0.5),
             helper.make_node("Transpose", ["p"], ["y"], perm=[1, 0])]
    vi = [helper.make_tensor_value_info(n, TensorProto.DOUBLE, list(v.shape)) for n, v in (("a", a), ("b", b))]
    model = _model(nodes, vi, ["y"])
    fast, fast_ops = _grads(model, ["a", "b"], {"a": a, "b": b})
    with emit_options(fold_transposes=False):
        plain, plain_ops = _grads(model, ["a", "b"], {"a": a, "b": b})
    assert fast_ops.count("Transpose") < plain_ops.count("Transpose")
    for k in ("a", "b"):
        np.testing.assert_allclose(fast[k], plain[k], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("picks,concat", [([0, 1, 2], True), ([2, 0, 1], True), ([0, 2], False), ([1, 1], False)])
def test_stacked_projection_picks_gradient_is_one_concat(picks, concat):
    """q, k, v = Gather(w, 0 / 1 / 2) of a stacked projection: the summed zero-padded blocks are one
    Concat when the picks tile the axis; a gap or a repeat keeps Pad + Sum."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 4, 5))
    nodes, outs = [], []
    for k in range(len(picks)):
        nodes.append(helper.make_node("Gather", ["x", f"i{k}"], [f"p{k}"], axis=0))
        nodes.append(helper.make_node("Mul", [f"p{k}", f"p{k}"], [f"y{k}"]) if k % 2 else
                     helper.make_node("Sin", [f"p{k}"], [f"y{k}"]))
        outs.append(f"y{k}")
    nodes.append(helper.make_node("Sum", outs, ["y"]))
    inits = [numpy_helper.from_array(np.array(i, np.int64), f"i{k}") for k, i in enumerate(picks)]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3, 4, 5])], ["y"], inits)
    fast, fast_ops = _grads(model, ["x"], {"x": x})
    with emit_options(concat_pads=False):
        plain, plain_ops = _grads(model, ["x"], {"x": x})
    assert ("Concat" in fast_ops and "Pad" not in fast_ops) == concat and "Pad" in plain_ops
    np.testing.assert_allclose(fast["x"], plain["x"], rtol=1e-12, atol=1e-12)
