"""Where's gradient: zeros, not 0 * dz, in the branch that was not chosen."""
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

import onnx_autodiff as oa


def test_non_finite_gradient_does_not_leak_into_the_other_branch():
    # y = sum(log(where(c, a, b))): at the position where c picks a == 0, dz is inf; b's gradient
    # there must stay exactly 0 (0 * inf would be NaN).
    nodes = [helper.make_node("Where", ["c", "a", "b"], ["z"], name="where"),
             helper.make_node("Log", ["z"], ["l"], name="log"),
             helper.make_node("ReduceSum", ["l"], ["y"], name="sum", keepdims=0),
             helper.make_node("Gradient", ["a", "b"], ["da", "db"], name="g",
                              domain="ai.onnx.preview.training", xs=["a", "b"], y="y")]
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "w", [vi("c", TensorProto.BOOL, [3]), vi("a", TensorProto.FLOAT, [3]),
                                           vi("b", TensorProto.FLOAT, [3])],
                              [vi("y", TensorProto.FLOAT, []), vi("da", TensorProto.FLOAT, [3]),
                               vi("db", TensorProto.FLOAT, [3])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                helper.make_opsetid("ai.onnx.preview.training", 1)])
    m.ir_version = 10
    sess = ort.InferenceSession(oa.lower(m).SerializeToString(), providers=["CPUExecutionProvider"])
    c = np.array([True, False, True])
    a = np.array([0.0, 5.0, 2.0], np.float32)
    b = np.array([7.0, 4.0, 9.0], np.float32)
    _, da, db = sess.run(None, {"c": c, "a": a, "b": b})
    np.testing.assert_array_equal(db, [0.0, 0.25, 0.0])
    assert np.isinf(da[0]) and da[1] == 0 and da[2] == np.float32(0.5)
