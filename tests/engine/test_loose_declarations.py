"""Gradient outputs declared as people write them by hand (no type, or no shape) lower: they get the
type and shape of their x."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnx_autodiff as oa
from tests.models import model_of

vi = helper.make_tensor_value_info


@pytest.mark.parametrize("decl", [helper.make_empty_tensor_value_info("da"), vi("da", TensorProto.FLOAT, None),
                                  vi("da", TensorProto.UNDEFINED, None)], ids=["empty", "float-no-shape", "undefined"])
def test_gradient_output_without_type_or_shape_lowers(decl):
    nodes = [helper.make_node("Exp", ["a"], ["y"]), helper.make_node("ReduceSum", ["y"], ["s"], keepdims=0),
             helper.make_node("Gradient", ["a"], ["da"], domain="ai.onnx.preview.training", xs=["a"], y="s")]
    m = model_of(helper.make_graph(nodes, "m", [vi("a", TensorProto.FLOAT, [2, "N"])],
                                   [vi("s", TensorProto.FLOAT, []), decl]), training=True, ir_version=8)
    lowered = oa.lower(m)
    tt = lowered.graph.output[1].type.tensor_type
    assert tt.elem_type == TensorProto.FLOAT and [d.dim_value or d.dim_param for d in tt.shape.dim] == [2, "N"]
    a = np.array([[0.5, -1.0, 2.0], [0.0, 1.0, -2.0]], np.float32)
    got = ort.InferenceSession(lowered.SerializeToString()).run(["da"], {"a": a})[0]
    np.testing.assert_allclose(got, np.exp(a), rtol=1e-6)
