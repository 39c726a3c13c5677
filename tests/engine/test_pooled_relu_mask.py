"""MaxPool of a Relu: the Relu's mask of the backward is taken on the pooled side (``MaxUnpool(dz * (y > 0), I)``)
instead of over the whole input: the same gradient, bit for bit, ties and zeros included."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnx_autodiff import build_vjp
from onnx_autodiff.engine.builder import emit_options

F32 = TensorProto.FLOAT


def _model(nodes, shape, outputs):
    """Outputs typed by onnx's shape inference."""
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, shape)], [])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(m).graph.value_info}
    m.graph.output.extend(inferred[o] for o in outputs)
    return m


def _gradient(model, x, pooled: bool):
    """(dx of sum(outputs * dy), the backward's nodes)."""
    with emit_options(pooled_relu_mask=pooled):
        v = build_vjp(model, wrt=["x"])
    fwd = ort.InferenceSession(v.forward.SerializeToString(), providers=["CPUExecutionProvider"])
    values = dict(zip([o.name for o in fwd.get_outputs()], fwd.run(None, {"x": x})))
    rng = np.random.default_rng(3)
    feeds = {"x": x, **values, **{f"{o}_grad": rng.standard_normal(values[o].shape).astype(np.float32)
                                  for o in v.outputs}}
    back = ort.InferenceSession(v.backward.SerializeToString(), providers=["CPUExecutionProvider"])
    dx, = back.run(["x_grad"], {i.name: feeds[i.name] for i in back.get_inputs()})
    return dx, list(v.backward.graph.node)


def _full_size_masks(nodes) -> int:
    """Greater nodes that read the Relu's input x (over the whole input)."""
    return sum(n.op_type == "Greater" and "x" in n.input for n in nodes)


@pytest.mark.parametrize("shape,kernel", [((4, 3, 8, 6), [2, 2]), ((2, 5, 9, 6), [3, 2]), ((3, 2, 12), [3])])
def test_relu_then_max_pool_masks_on_the_pooled_side(shape, kernel):
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["y"], kernel_shape=kernel, strides=kernel)]
    model = _model(nodes, list(shape), ["y"])
    x = np.random.default_rng(0).integers(-3, 3, shape).astype(np.float32)  # ties, zeros, all-negative windows
    fast, fast_nodes = _gradient(model, x, True)
    plain, plain_nodes = _gradient(model, x, False)
    assert _full_size_masks(plain_nodes) == 1 and _full_size_masks(fast_nodes) == 0
    unpool = next(n for n in fast_nodes if n.op_type == "MaxUnpool")
    assert unpool.output[0] == "x_grad"
    np.testing.assert_array_equal(fast, plain)
    assert 0 < np.count_nonzero(fast) < x.size // int(np.prod(kernel)) + 1


def test_relu_output_read_elsewhere_keeps_the_full_mask():
    """The Relu's gradient is a Sum of the pool's and another reader's: the MaxUnpool is not its only term."""
    shape = [2, 3, 4, 4]
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["y"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Sigmoid", ["r"], ["s"])]
    model = _model(nodes, shape, ["y", "s"])
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    fast, fast_nodes = _gradient(model, x, True)
    plain, _ = _gradient(model, x, False)
    assert _full_size_masks(fast_nodes) == 1
    np.testing.assert_array_equal(fast, plain)


def test_max_pool_of_another_activation_is_left_alone():
    shape = [2, 3, 4, 4]
    nodes = [helper.make_node("LeakyRelu", ["x"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["y"], kernel_shape=[2, 2], strides=[2, 2])]
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    fast, fast_nodes = _gradient(_model(nodes, shape, ["y"]), x, True)
    plain, plain_nodes = _gradient(_model(nodes, shape, ["y"]), x, False)
    assert [n.op_type for n in fast_nodes] == [n.op_type for n in plain_nodes]
    np.testing.assert_array_equal(fast, plain)
