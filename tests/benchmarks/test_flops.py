"""benchmarks/flops.py against FLOP counts worked out by hand."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from benchmarks.flops import model_flops, node_flops


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_gemm_transposed_with_a_symbolic_batch():
    # A [N, 20] with N = 8 fed; B [30, 20] under transB; C [30]. Y = A B^T + C is [8, 30]: 8 * 30 dot
    # products of length 20, a multiply and an add each: 2 * 8 * 30 * 20 = 9600 (the bias is not counted)
    b = numpy_helper.from_array(np.zeros((30, 20), np.float32), "B")
    c = numpy_helper.from_array(np.zeros(30, np.float32), "C")
    m = _model([helper.make_node("Gemm", ["A", "B", "C"], ["Y"], transB=1)],
               [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["N", 20])],
               [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], [b, c])
    f = model_flops(m, {"A": (8, 20)})
    assert f.by_op == {"Gemm": 9600} and f.unknown == []
    assert model_flops(m).unknown == ["Y"]  # N unknown: listed, not guessed


def test_conv_grouped_strided_and_matmul():
    # X [2, 4, 9, 9], W [6, 2, 3, 3], group 2, stride 2, no padding: Y [2, 6, 4, 4] (floor((9 - 3) / 2) + 1 = 4);
    # each of its 2 * 6 * 4 * 4 = 192 elements sums 2 channels x 3 x 3 = 18 products: 2 * 192 * 18 = 6912.
    # Then Y reshaped [2, 96] @ [96, 5]: 2 * 2 * 5 * 96 = 1920.
    w = numpy_helper.from_array(np.zeros((6, 2, 3, 3), np.float32), "W")
    shape = numpy_helper.from_array(np.array([2, 96], np.int64), "shape")
    v = numpy_helper.from_array(np.zeros((96, 5), np.float32), "V")
    m = _model([helper.make_node("Conv", ["X", "W"], ["Y"], group=2, strides=[2, 2], kernel_shape=[3, 3]),
                helper.make_node("Reshape", ["Y", "shape"], ["R"]),
                helper.make_node("MatMul", ["R", "V"], ["Z"])],
               [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 4, 9, 9])],
               [helper.make_tensor_value_info("Z", TensorProto.FLOAT, None)], [w, shape, v])
    f = model_flops(m)
    assert f.by_op == {"Conv": 6912, "MatMul": 1920} and f.total == 8832


def test_conv_transpose_and_batched_matmul():
    # ConvTranspose: X [1, 3, 5, 5], W [3, 4, 2, 2]: each of the 75 input elements scatters into 4 x 2 x 2
    # outputs: 2 * 75 * 16 = 2400. MatMul [3, 4, 5] x [5, 6]: 3 * 4 * 6 dot products of 5: 2 * 72 * 5 = 720.
    assert node_flops("ConvTranspose", [(1, 3, 5, 5), (3, 4, 2, 2)], None, {}) == 2400
    assert node_flops("MatMul", [(3, 4, 5), (5, 6)], (3, 4, 6), {}) == 720
    assert node_flops("Gemm", [(20, 8), (20, 30)], (8, 30), {"transA": 1}) == 9600
    with pytest.raises(ValueError, match="no FLOP count for Relu"):
        node_flops("Relu", [(1, 2)], (1, 2), {})


def test_the_model_given_is_not_changed():
    w = numpy_helper.from_array(np.ones((3, 2), np.float32), "W")
    m = _model([helper.make_node("MatMul", ["X", "W"], ["Y"])],
               [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])],
               [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], [w])
    before = m.SerializeToString()
    assert model_flops(m, {"X": (4, 3)}).total == 2 * 4 * 2 * 3
    assert m.SerializeToString() == before
