"""Gradients through bases quantized by onnxruntime's own tools: MatMulNBits (QOperator) and
blocked-int4 DequantizeLinear (QDQ), as ``onnxruntime.quantization.matmul_nbits_quantizer`` emits them."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.check.gradcheck import gradcheck
from onnx_autodiff.errors import GradientRuleError
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
    # <Y, v> is linear in A: eps = 1 leaves only float32 rounding (see onnx_autodiff/conformance/cases/quantized.py)
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


def _nbits_model(bits: int, zero_points, level: int, k: int = 64, n: int = 8, block: int = 32,
                 opset: int = 21) -> tuple[onnx.ModelProto, dict]:
    """[2, 3, k] @ dequant(B)^T at ``accuracy_level``; zero points packed (True), "float", or none."""
    rng = np.random.default_rng(3)
    blocks = -(-k // block)
    inits = [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, block * bits // 8)).astype(np.uint8), "B"),
             numpy_helper.from_array(rng.uniform(0.5, 1.5, (n, blocks)).astype(np.float32), "scales")]
    if zero_points == "float":
        inits.append(numpy_helper.from_array(rng.uniform(0, 2 ** bits - 1, (n, blocks)).astype(np.float32), "zp"))
    elif zero_points:
        inits.append(numpy_helper.from_array(rng.integers(0, 256, (n, -(-blocks * bits // 8))).astype(np.uint8), "zp"))
    node = helper.make_node("MatMulNBits", ["A", "B", "scales"] + (["zp"] if zero_points else []), ["Y"],
                            domain="com.microsoft", K=k, N=n, bits=bits, block_size=block, accuracy_level=level)
    graph = helper.make_graph([node], "nbits", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [2, 3, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model, {"A": rng.standard_normal((2, 3, k)).astype(np.float32)}


@pytest.mark.parametrize("bits,zero_points", [(4, False), (4, True), (8, True)])
def test_matmulnbits_accuracy_level_4_keeps_the_float_products_gradient(bits, zero_points):
    """At accuracy_level 4 onnxruntime rounds A to int8 per block of K (scale max|a| / 127) before the
    product. The rule differentiates the float product it approximates (the straight-through gradient;
    the rounded product is a step function of A): the backward is the same at every level, and the
    forward stays within that rounding of the float product (each of the K terms is off by at most half
    a step of A's block times |w|)."""
    import onnxruntime as ort

    outputs = {}
    for level in (0, 1, 4):
        model, feeds = _nbits_model(bits, zero_points, level)
        vjp = build_vjp(model, wrt=["A"])
        forward = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        backward = ort.InferenceSession(vjp.backward.SerializeToString(), providers=["CPUExecutionProvider"])
        dy = np.random.default_rng(4).standard_normal((2, 3, 8)).astype(np.float32)
        bfeeds = {i.name: feeds["A"] if i.name == "A" else dy for i in vjp.backward.graph.input}
        outputs[level] = (forward.run(None, feeds)[0], backward.run(None, bfeeds)[0])
    (y0, g0), (y1, g1), (y4, g4) = outputs[0], outputs[1], outputs[4]
    np.testing.assert_array_equal(g0, g1)
    np.testing.assert_array_equal(g0, g4)
    np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-4)
    a = feeds["A"].reshape(2, 3, 2, 32)
    step = np.abs(a).max(-1) / 127  # one int8 step of each block of A
    w = np.abs(_dequantized(model))  # [N, K]
    bound = 0.5 * np.einsum("xyb,nbk->xyn", step, w.reshape(8, 2, 32)) + 1e-4
    assert np.all(np.abs(y4 - y0) <= bound)


def _dequantized(model: onnx.ModelProto) -> np.ndarray:
    """(code - zero point) * scale of the model's MatMulNBits weight as [N, K] (the spec's packing)."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    attrs = {a.name: a.i for a in model.graph.node[0].attribute}
    bits, n = attrs["bits"], attrs["N"]
    per = 8 // bits
    codes = (inits["B"][..., None] >> (bits * np.arange(per))) & (2 ** bits - 1)
    codes = codes.reshape(n, -1, attrs["block_size"]).astype(np.float64)
    if "zp" in inits and inits["zp"].dtype != np.uint8:
        zp = inits["zp"][..., None].astype(np.float64)
    elif "zp" in inits:
        zp = ((inits["zp"][..., None] >> (bits * np.arange(per))) & (2 ** bits - 1)).reshape(n, -1)
        zp = zp[:, :codes.shape[1], None]
    else:
        zp = 2 ** (bits - 1)
    return ((codes - zp) * inits["scales"][..., None]).reshape(n, -1)[:, :attrs["K"]]


@pytest.mark.parametrize("opset", [13, 17, 21])
@pytest.mark.parametrize("bits,zero_points,k,block", [(4, False, 64, 32), (4, True, 80, 32), (4, "float", 40, 16),
                                                      (8, True, 48, 16), (2, True, 48, 16), (2, False, 40, 16)])
def test_matmulnbits_backward_multiplies_by_the_specs_weight(bits, zero_points, k, block, opset, tmp_path):
    """dA = dY @ dequant(B) in float32, the weight as the spec packs it (low bits first, a short last block,
    zero points packed, in float or 2^(bits-1)); onnxruntime dequantizes it when the backward runs, not while
    it makes the session (no float [N, K] initializer in the optimized backward: a folded weight cost a
    Qwen2.5-0.5B-shaped model 18 GB while its session was made)."""
    import onnxruntime as ort

    model, feeds = _nbits_model(bits, zero_points, 0, k=k, n=6, block=block, opset=opset)
    backward = build_vjp(model, wrt=["A"]).backward
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    sess = ort.InferenceSession(backward.SerializeToString(), so, providers=["CPUExecutionProvider"])
    dy = np.random.default_rng(4).standard_normal((2, 3, 6)).astype(np.float32)
    got = sess.run(None, {i.name: feeds["A"] if i.name == "A" else dy for i in backward.graph.input})[0]
    np.testing.assert_allclose(got, dy.astype(np.float64) @ _dequantized(model), rtol=1e-5, atol=1e-5)
    optimized = onnx.load(str(tmp_path / "optimized.onnx"))
    assert "DequantizeLinear" in {n.op_type for n in optimized.graph.node}
    assert not [t.name for t in optimized.graph.initializer
                if t.data_type == TensorProto.FLOAT and np.prod(t.dims) >= 6 * k]


@pytest.mark.parametrize("per_column,signed,zero_point", [(False, True, True), (True, True, True),
                                                          (True, False, False), (False, False, False)])
def test_dynamic_int8_backward_multiplies_by_the_dequantized_weight(per_column, signed, zero_point, tmp_path):
    """dA = dY @ ((W - zero point) * scale)^T in float32 for DynamicQuantizeMatMul's weight, per tensor or per
    column; dequantized by one DequantizeLinear when the backward runs, which onnxruntime does not fold into a
    float copy of W."""
    import onnxruntime as ort

    rng = np.random.default_rng(5)
    k, n = 24, 10
    dtype, low, high = (np.int8, -127, 127) if signed else (np.uint8, 0, 255)
    w = rng.integers(low, high + 1, (k, n)).astype(dtype)
    shape = (n,) if per_column else ()
    scale = rng.uniform(0.005, 0.02, shape).astype(np.float32)
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(scale, "s")]
    zp = rng.integers(low // 8, high // 8 + 1, shape).astype(dtype) if zero_point else None
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "zp"))
    node = helper.make_node("DynamicQuantizeMatMul", ["A", "W", "s"] + (["zp"] if zp is not None else []), ["Y"],
                            domain="com.microsoft")
    graph = helper.make_graph([node], "dq", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [2, 3, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    backward = build_vjp(model, wrt=["A"]).backward
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    sess = ort.InferenceSession(backward.SerializeToString(), so, providers=["CPUExecutionProvider"])
    a = rng.standard_normal((2, 3, k)).astype(np.float32)
    dy = rng.standard_normal((2, 3, n)).astype(np.float32)
    got = sess.run(None, {i.name: a if i.name == "A" else dy for i in backward.graph.input})[0]
    weight = (w.astype(np.float64) - (zp if zp is not None else 0)) * scale
    np.testing.assert_allclose(got, dy.astype(np.float64) @ weight.T, rtol=1e-5, atol=1e-5)
    optimized = onnx.load(str(tmp_path / "optimized.onnx"))
    assert "DequantizeLinear" in {n.op_type for n in optimized.graph.node}
    assert not [t.name for t in optimized.graph.initializer
                if t.data_type == TensorProto.FLOAT and np.prod(t.dims) >= k * n]
