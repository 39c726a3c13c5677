"""Integer arithmetic on frozen weights folded once in numpy (``driver/prefold.py``): the same values onnxruntime
computes, the folded nodes gone, and nothing folded that is not rooted in a stored weight."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.driver.prefold import fold_weight_arithmetic
from onnx_autodiff.model.weights import attach_weights, is_detached, placeholder

N, BYTES = 6, 16  # packed uint8 [N, BYTES]: 2 codes a byte


def _const(name, arr):
    return helper.make_node("Constant", [], [name], name=f"{name}/node", value=numpy_helper.from_array(arr, name))


def unpack_model(extra_reader: bool = False) -> tuple[onnx.ModelProto, dict]:
    """x [1, N] -> x @ dequant(codes of packed) as MatMulNBits' gradient unpacks them (Unsqueeze, BitShift, Mod,
    Reshape, DequantizeLinear); ``extra_reader``: the shifted codes are read by a second output too."""
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (N, BYTES)).astype(np.uint8)
    nodes = [_const("axes", np.array([2], np.int64)), _const("shifts", np.array([0, 4], np.uint8)),
             _const("sixteen", np.array([16], np.uint8)), _const("shape", np.array([N, 2 * BYTES], np.int64)),
             helper.make_node("Unsqueeze", ["packed", "axes"], ["u"], name="u"),
             helper.make_node("BitShift", ["u", "shifts"], ["s"], name="s", direction="RIGHT"),
             helper.make_node("Mod", ["s", "sixteen"], ["m"], name="m"),
             helper.make_node("Reshape", ["m", "shape"], ["codes"], name="r"),
             helper.make_node("DequantizeLinear", ["codes", "scale", "zp"], ["w"], name="dq"),
             helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2 * BYTES])]
    if extra_reader:
        nodes.append(helper.make_node("Cast", ["s"], ["s_float"], name="cast", to=TensorProto.FLOAT))
        outputs.append(helper.make_tensor_value_info("s_float", TensorProto.FLOAT, [N, BYTES, 2]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, N])], outputs,
                              [placeholder("packed", packed), numpy_helper.from_array(np.float32(0.25), "scale"),
                               numpy_helper.from_array(np.uint8(8), "zp")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    return model, {"packed": packed}


def run(model: onnx.ModelProto, arrays: dict) -> list[np.ndarray]:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    attach_weights(m, arrays)
    x = np.arange(N, dtype=np.float32).reshape(1, N)
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


@pytest.mark.parametrize("extra_reader", [False, True])
def test_the_unpacked_codes_are_computed_once_and_the_outputs_are_the_same(extra_reader):
    model, arrays = unpack_model(extra_reader)
    expected = run(model, arrays)
    folded = fold_weight_arithmetic(model, arrays)
    ops = [n.op_type for n in model.graph.node]
    assert "BitShift" not in ops and "Mod" not in ops and "Constant" not in ops
    assert set(folded) == ({"codes", "s"} if extra_reader else {"codes"})
    assert all(is_detached(t) for t in model.graph.initializer if t.name in folded)
    assert folded["codes"].dtype == np.uint8 and folded["codes"].max() < 16
    if extra_reader:  # Mod did not overwrite the shifted codes the Cast still reads
        assert folded["s"].max() > 15
    got = run(model, {**arrays, **folded})
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a, b)


def test_views_alone_and_graphs_without_stored_weights_are_left_as_they_are():
    model, arrays = unpack_model()
    g = model.graph
    shifted = next(n for n in g.node if n.op_type == "BitShift")
    shifted.input[1] = "x_shift"  # not a constant: BitShift stays, and the Unsqueeze before it (a view) too
    g.input.append(helper.make_tensor_value_info("x_shift", TensorProto.UINT8, [2]))
    before = [n.name for n in g.node]
    assert fold_weight_arithmetic(model, arrays) == {}
    assert [n.name for n in g.node] == before
    state, _ = unpack_model()  # a weight the step updates (a graph input, here a state tensor): not a constant
    state.graph.input.append(helper.make_tensor_value_info("packed", TensorProto.UINT8, [N, BYTES]))
    assert fold_weight_arithmetic(state, arrays) == {}
    inline, _ = unpack_model()
    packed = next(t for t in inline.graph.initializer if t.name == "packed")
    packed.CopyFrom(numpy_helper.from_array(arrays["packed"], "packed"))  # inline: onnxruntime's to fold
    assert fold_weight_arithmetic(inline, {}) == {}
