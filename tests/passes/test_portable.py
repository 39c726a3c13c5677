"""graph.make_portable (run by finalize on every model we write): no empty trailing optional input; node
names unique, distinct from tensor names and from the part before a dot of a tensor name."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.graph import finalize, tensor_names


def _model():
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Gemm", ["x", "conv1.weight", ""], ["g"], name="conv1"),       # tract: conv1.bias
             helper.make_node("ReduceSum", ["g", ""], ["s"], name="s", keepdims=0),          # named like a tensor
             helper.make_node("Relu", ["s"], ["y"], name="relu"),
             helper.make_node("Identity", ["y"], ["z"], name="relu")]                        # a duplicate
    inits = [numpy_helper.from_array(np.ones((2, 2), np.float32), "conv1.weight"),
             numpy_helper.from_array(np.ones(2, np.float32), "conv1.bias")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [2, 2])],
                          [helper.make_tensor_value_info("z", f, [])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_finalize_makes_names_and_inputs_portable():
    m = _model()
    finalize(m)
    onnx.checker.check_model(m, full_check=True)
    names = [n.name for n in m.graph.node]
    assert names == ["conv1_node", "s_node", "relu", "relu_node"]
    tensors = tensor_names(m)
    assert not set(names) & tensors and not any(t.startswith(n + ".") for t in tensors for n in names)
    assert [list(n.input) for n in m.graph.node[:2]] == [["x", "conv1.weight"], ["g"]]


def test_portable_model_computes_the_same():
    """onnx.reference runs the model as written; onnxruntime refuses it (two nodes named 'relu') until
    finalize has renamed one, and then gives the same value."""
    import onnxruntime as ort
    from onnx.reference import ReferenceEvaluator

    before, after = _model(), _model()
    finalize(after)
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    want = ReferenceEvaluator(before).run(None, {"x": x})[0]
    got = ort.InferenceSession(after.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)
