"""Write a model with a Gradient node using onnx.helper, lower it, and run it in stock onnxruntime.

    python examples/gradient_of_mlp.py
"""
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import onnx_autodiff
from onnx_autodiff import gradcheck

rng = np.random.default_rng(0)
W = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W")
b = numpy_helper.from_array(np.zeros(3, np.float32), "b")
nodes = [
    helper.make_node("Gemm", ["x", "W", "b"], ["logits"], name="fc"),
    helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "label"], ["loss"], name="xent"),
    # d loss / d (W, b), at the current weights: the spec's Gradient operator
    helper.make_node("Gradient", ["W", "b"], ["W_grad", "b_grad"], name="grad",
                     domain="ai.onnx.preview.training", xs=["W", "b"], y="loss"),
]
graph = helper.make_graph(
    nodes, "mlp",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
     helper.make_tensor_value_info("label", TensorProto.INT64, ["N"])],
    [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
     helper.make_tensor_value_info("W_grad", TensorProto.FLOAT, [4, 3]),
     helper.make_tensor_value_info("b_grad", TensorProto.FLOAT, [3])],
    initializer=[W, b],
)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                helper.make_opsetid("ai.onnx.preview.training", 1)])

plain = onnx_autodiff.lower(model)  # standard ops only; passes onnx.checker full_check
print("ops after lowering:", sorted({n.op_type for n in plain.graph.node}))

sess = ort.InferenceSession(plain.SerializeToString(), providers=["CPUExecutionProvider"])
x = rng.standard_normal((8, 4)).astype(np.float32)
label = rng.integers(0, 3, 8)
loss, W_grad, b_grad = sess.run(None, {"x": x, "label": label})
print(f"loss {loss:.4f}, |dW| {np.linalg.norm(W_grad):.4f}, db {np.round(b_grad, 4)}")

# The same forward model, checked against float64 finite differences (the dot-product test).
forward = helper.make_model(
    helper.make_graph(nodes[:2], "forward", list(graph.input), [graph.output[0]], initializer=[W, b]),
    opset_imports=[helper.make_opsetid("", 17)],
)
print(gradcheck(forward, {"x": x, "label": label}))
