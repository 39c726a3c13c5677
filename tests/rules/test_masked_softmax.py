"""A Softmax whose rows may be fully masked, behind the exporters' NaN guard (``Where(IsNaN(y), 0, y)``, what
torch's sdpa export writes for attention; left padding makes such rows): a fully masked row is NaN in the
forward and replaced by zeros, so its scores get a zero gradient, and NaN must not reach the backward."""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.check.gradcheck import gradcheck, gradient_model
from onnx_autodiff.passes.pipeline import lower


def _model() -> onnx.ModelProto:
    keep = np.ones((2, 3, 4), bool)
    keep[0, 1] = False  # one fully masked row
    keep[1, 2, 2:] = False  # and a partly masked one
    bias = np.where(keep, 0.0, -np.inf)
    nodes = [helper.make_node("Add", ["x", "bias"], ["z"]), helper.make_node("Softmax", ["z"], ["p"], axis=-1),
             helper.make_node("IsNaN", ["p"], ["nan"]), helper.make_node("Where", ["nan", "zero", "p"], ["q"]),
             helper.make_node("MatMul", ["q", "v"], ["y"])]
    graph = helper.make_graph(nodes, "masked", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3, 4]),
                                                helper.make_tensor_value_info("v", TensorProto.DOUBLE, [2, 4, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [2, 3, 5])],
                              [numpy_helper.from_array(bias, "bias"), numpy_helper.from_array(np.array(0.0), "zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


def test_fully_masked_rows_get_a_zero_gradient_and_no_nan():
    import onnxruntime as ort

    model = _model()
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3, 4)), "v": rng.standard_normal((2, 4, 5))}
    shapes = {"y": [2, 3, 5], "x": [2, 3, 4], "v": [2, 4, 5]}
    grads = lower(gradient_model(model, ["y"], ["x", "v"], shapes))
    out = ort.InferenceSession(grads.SerializeToString()).run(
        ["x__gradcheck_grad", "v__gradcheck_grad"], {**feeds, "gradcheck/v0": rng.standard_normal((2, 3, 5))})
    dx, dv = out
    assert np.all(np.isfinite(dx)) and np.all(np.isfinite(dv))
    assert np.all(dx[0, 1] == 0) and np.all(dx[1, 2, 2:] == 0) and np.abs(dx[1, 2, :2]).max() > 0
    assert gradcheck(model, feeds, wrt=["x", "v"]).ok
