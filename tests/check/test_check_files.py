"""``check`` is never more pessimistic than the run: GatherBlockQuantized's float64 form
(onnx_autodiff/check/quantized_gather.py) against onnxruntime's kernel, the tied-int4 builder model (its embedding
a GatherBlockQuantized, its attention a GroupQueryAttention over an empty past) checked in float64 and float32, and an
op without a float64 reference named and checked in float32 instead."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.check.gradcheck import to_float64
from onnx_autodiff.check.quantized_gather import expand_gather_block_quantized
from onnx_autodiff.cli import main
from onnx_autodiff.engine.registry import override_rule
from onnx_autodiff.runtimes.reference import Float64Run

_ROWS, _INT4 = 6, {"int4": TensorProto.INT4, "uint4": TensorProto.UINT4}


def _packed(codes: np.ndarray) -> np.ndarray:
    """Two 4-bit codes a byte along the last axis, the low nibble first."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def _gbq(kind: str, bits: int, zero: bool, gather_axis=0, quantize_axis=1, k=72, block=16, seed=0):
    """One GatherBlockQuantized node over random codes; its data, zero points and scales are initializers."""
    rng = np.random.default_rng(seed)
    blocks = -(-k // block)
    shape, sshape = ([_ROWS, k], [_ROWS, blocks]) if quantize_axis == 1 else ([k, _ROWS], [blocks, _ROWS])
    inits = []
    if kind == "uint8":
        data = _packed(rng.integers(0, 16, shape)) if bits == 4 else rng.integers(0, 256, shape).astype(np.uint8)
        inits.append(numpy_helper.from_array(data, "data"))
        if zero:  # packed zero points: an odd count of blocks leaves a padding nibble
            zp = _packed(rng.integers(0, 16, [_ROWS, blocks + blocks % 2])) if bits == 4 else \
                rng.integers(0, 256, sshape).astype(np.uint8)
            inits.append(numpy_helper.from_array(zp, "zp"))
    else:
        low, high = (-8, 8) if kind == "int4" else (0, 16)
        inits.append(helper.make_tensor("data", _INT4[kind], shape, rng.integers(low, high, shape).ravel().tolist()))
        if zero:
            zp = rng.integers(low, high, sshape).ravel().tolist()
            inits.append(helper.make_tensor("zp", _INT4[kind], sshape, zp))
    inits.append(numpy_helper.from_array((rng.random(sshape) + 0.1).astype(np.float32), "scales"))
    node = helper.make_node("GatherBlockQuantized", ["data", "idx", "scales"] + (["zp"] if zero else []), ["y"],
                            domain="com.microsoft", name="gbq", bits=bits, block_size=block,
                            gather_axis=gather_axis, quantize_axis=quantize_axis)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("idx", TensorProto.INT64, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("kind,bits,zero,axes", [
    ("uint8", 4, False, (0, 1)), ("uint8", 4, True, (0, 1)), ("uint8", 8, False, (0, 1)), ("uint8", 8, True, (0, 1)),
    ("int4", 4, False, (0, 1)), ("int4", 4, True, (0, 1)), ("uint4", 4, True, (0, 1)), ("int4", 4, True, (1, 0)),
])
def test_the_float64_form_of_gather_block_quantized_is_onnxruntimes_kernel(kind, bits, zero, axes):
    model = _gbq(kind, bits, zero, *axes)
    idx = np.random.default_rng(1).integers(0, _ROWS, [2, 3])
    expected = ort.InferenceSession(model.SerializeToString()).run(None, {"idx": idx})[0]
    form = expand_gather_block_quantized(model)
    assert not any(n.domain == "com.microsoft" for n in form.graph.node)
    same = ort.InferenceSession(form.SerializeToString()).run(None, {"idx": idx})[0]
    np.testing.assert_array_equal(same, expected)  # the same float32 products
    y64 = Float64Run(to_float64(form)).run(None, {"idx": idx})[0]
    assert y64.dtype == np.float64
    np.testing.assert_allclose(y64, expected, rtol=1e-6)


def test_the_tied_int4_builder_model_passes_check(builder_models, capsys):
    """Before: "node '/model/embed_tokens/GatherBlockQuantized' ... no standard-ONNX form"; with --float32:
    "GroupQueryAttention ... total_sequence_length=5, past_sequence_length=0, kv_sequence_length=3"."""
    from onnx_autodiff.cli.checks import _check_inputs

    path = builder_models.get("llama", "int4", shared_embeddings="true")
    model = onnx.load(str(path))
    feeds = _check_inputs(model, 0)
    assert feeds["attention_mask"].shape == feeds["input_ids"].shape  # the past is empty
    assert feeds["past_key_values.0.key"].shape[2] == 0
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ok:" in out and "not judged" not in out
    assert main(["check", str(path), "--float32"]) == 0


def _fast_gelu_model():
    """x -> FastGelu (com.microsoft, no float64 form) -> MatMul by w: w's gradient does not pass the FastGelu."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("FastGelu", ["x"], ["h"], domain="com.microsoft", name="fast_gelu"),
             helper.make_node("MatMul", ["h", "w"], ["y"], name="mm")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])], [w],
                          value_info=[helper.make_tensor_value_info("h", TensorProto.FLOAT, ["batch", 4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def test_an_op_without_a_float64_reference_is_named_and_checked_in_float32(tmp_path, capsys):
    path = tmp_path / "fast_gelu.onnx"
    onnx.save(_fast_gelu_model(), str(path))
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "not judged in float64: node 'fast_gelu' (FastGelu, com.microsoft)" in out and "ok:" in out

    def wrong_matmul_grad(g, node, dy):  # dW = A^T dY, doubled
        a = node.inputs[0]
        return [None, g.Mul(g.MatMul(g.Transpose(a, perm=[1, 0]), dy[0]), g.const(2.0, like=a))]

    with override_rule("MatMul", wrong_matmul_grad):
        assert main(["check", str(path)]) == 1  # the float32 check still fails a wrong gradient
