"""Gradients through bases quantized by onnxruntime's own tools: MatMulNBits (QOperator) and
blocked-int4 DequantizeLinear (QDQ), as ``onnxruntime.quantization.matmul_nbits_quantizer`` emits them."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.errors import GradientRuleError
from onnx_autodiff.gradcheck import gradcheck
from onnx_autodiff.partial.vjp import build_vjp

mq = pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")

K, N = 80, 48  # K is not a multiple of the block: the last block is short


def _quantized(fmt: str, symmetric: bool) -> onnx.ModelProto:
    """A [2, 3, K] @ W [K, N] model whose W onnxruntime's quantizer stores in 4 bits, blocks of 32."""
    from onnxruntime.quantization import QuantFormat

    w = np.random.default_rng(0).standard_normal((K, N)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["A", "W"], ["Y"], name="proj")], "g",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [2, 3, K])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3, N])], [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    fmt = {"QOperator": QuantFormat.QOperator, "QDQ": QuantFormat.QDQ}[fmt]
    config = mq.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=symmetric, quant_format=fmt)
    quantizer = mq.MatMulNBitsQuantizer(model, algo_config=config)
    quantizer.process()
    return quantizer.model.model


def _feeds():
    return {"A": np.random.default_rng(1).standard_normal((2, 3, K)).astype(np.float32)}


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero-points"])
def test_matmulnbits_from_onnxruntime_quantizer(symmetric):
    model = _quantized("QOperator", symmetric)
    assert [n.op_type for n in model.graph.node] == ["MatMulNBits"]
    # <Y, v> is linear in A: eps = 1 leaves only float32 rounding (see tests/rules/cases/quantized.py)
    report = gradcheck(model, _feeds(), wrt=["A"], float64=False, eps=1.0, rtol=1e-4, atol=1e-5)
    assert report.ok and report.checks
    vjp = build_vjp(model, wrt=["A"])
    assert {n.domain for n in vjp.backward.graph.node} <= {""}, "the backward must be standard ONNX"
    onnx.checker.check_model(vjp.backward, full_check=True)


def test_matmulnbits_quantized_weight_gets_no_gradient():
    model = _quantized("QOperator", False)
    scales = next(t.name for t in model.graph.initializer if t.name.endswith("scales"))
    with pytest.raises(GradientRuleError, match="get no gradient; freeze them"):
        gradcheck(model, _feeds(), wrt=["A", scales], float64=False)


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero-points"])
def test_blocked_int4_dequantizelinear_from_onnxruntime_quantizer(symmetric):
    model = _quantized("QDQ", symmetric)
    assert [n.op_type for n in model.graph.node] == ["DequantizeLinear", "MatMul"]
    codes = next(t for t in model.graph.initializer if t.name.endswith("Q4"))
    assert codes.data_type in (TensorProto.INT4, TensorProto.UINT4)
    scales = next(t.name for t in model.graph.initializer if t.name.endswith("scales"))
    report = gradcheck(model, _feeds(), wrt=["A", scales], float64=False, eps=1.0, rtol=1e-4, atol=1e-5)
    assert report.ok and len(report.checks) == 2
    vjp = build_vjp(model, wrt=["A"])
    onnx.checker.check_model(vjp.backward, full_check=True)
    assert vjp.backward.opset_import[0].version == 21


def test_shapes_are_known_past_matmulnbits():
    """onnx has no shape inference for the contrib op: ours sees through it (a MatMul by a [K, N] stand-in),
    so the nodes after it (a LoRA branch, the loss) have ranks for their gradient rules."""
    from onnx_autodiff.graph import infer_tensor_info

    model = _quantized("QOperator", True)
    model.graph.node.append(helper.make_node("Relu", ["Y"], ["Z"], name="after"))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("Z", TensorProto.UNDEFINED, None))
    assert infer_tensor_info(model)["Z"].shape == (2, 3, N)
