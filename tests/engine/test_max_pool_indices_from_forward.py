"""A training step's MaxPool gives its Indices from the forward (``engine/peephole_cnn.py``) instead of the backward
recomputing the pooling: the same step bit for bit, one MaxPool per pool, and an exported inference model pools
without Indices."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import TrainingSession
from onnx_autodiff.engine.builder import emit_options
from onnx_autodiff.engine.peephole_cnn import drop_unread_max_pool_indices, max_pool_indices_from_forward
from onnx_autodiff.passes.pipeline import lower
from onnx_autodiff.training import LossSpec, make_training_model

F32 = TensorProto.FLOAT


def _cnn(kernel: int, stride: int, relu: bool = True, opset: int = 17) -> onnx.ModelProto:
    """Conv (3x3, pad 1) -> [Relu] -> MaxPool -> Flatten -> Gemm, batch 4, 2x8x8 -> 3 channels -> 5 logits."""
    rng = np.random.default_rng(0)
    out = (8 - kernel) // stride + 1
    w = numpy_helper.from_array(rng.standard_normal([3, 2, 3, 3]).astype(np.float32), "w")
    fc = numpy_helper.from_array(rng.standard_normal([3 * out * out, 5]).astype(np.float32) * 0.1, "fc")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv")]
    nodes += [helper.make_node("Relu", ["c"], ["r"], name="relu")] if relu else []
    nodes += [helper.make_node("MaxPool", ["r" if relu else "c"], ["p"], kernel_shape=[kernel] * 2,
                               strides=[stride] * 2, name="pool"),
              helper.make_node("Flatten", ["p"], ["f"], name="flat"),
              helper.make_node("MatMul", ["f", "fc"], ["y"], name="fc")]
    g = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", F32, [4, 2, 8, 8])],
                          [helper.make_tensor_value_info("y", F32, [4, 5])], [w, fc])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _pools(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    return [n for n in graph.node if n.op_type == "MaxPool"]


def _steps(model: onnx.ModelProto, on: bool, steps: int = 3):
    """(losses and weights after ``steps`` SGD steps, the lowered model, the session) with the rewrite on or off."""
    with emit_options(max_pool_indices_from_forward=on):
        tm = make_training_model(model, LossSpec("mse", outputs="y"), optimizer="sgd", lr=0.1)
        low = lower(tm)
        sess = TrainingSession(tm, progress=False)
    rng = np.random.default_rng(1)
    x = rng.integers(-2, 3, [4, 2, 8, 8]).astype(np.float32)  # ties inside windows
    label = rng.standard_normal([4, 5]).astype(np.float32)
    losses = [float(sess.step({"x": x, "labels": label})[sess.loss_name]) for _ in range(steps)]
    return losses, {k: sess.get_state(k).copy() for k in ("w", "fc")}, low, sess


@pytest.mark.parametrize("kernel,stride,relu,opset", [(2, 2, True, 17), (2, 2, False, 17), (3, 2, True, 17),
                                                      (2, 2, True, 12)])
def test_the_step_is_the_same_with_one_pool(kernel, stride, relu, opset):
    model = _cnn(kernel, stride, relu, opset)
    fast_losses, fast_w, fast, sess = _steps(model, True)
    plain_losses, plain_w, plain, _ = _steps(model, False)
    assert fast_losses == plain_losses
    assert fast_w.keys() == plain_w.keys()
    for k in fast_w:
        np.testing.assert_array_equal(fast_w[k], plain_w[k])
    # plain: the forward's pool and the backward's recomputation with Indices; now one pool that writes them
    assert len(_pools(plain.training_info[0].algorithm)) == 1 and len(_pools(fast.training_info[0].algorithm)) == 0
    pool, = _pools(fast.graph)
    read = {i for n in fast.training_info[0].algorithm.node for i in n.input}
    assert len(pool.output) == 2 and pool.output[1] in read
    # the exported inference model pools without Indices
    exported, = _pools(sess.inference_model().graph)
    assert list(exported.output) == ["p"]


def _graph(nodes, outputs=("dx",)) -> onnx.GraphProto:
    return helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, [1, 1, 4, 4]),
                                          helper.make_tensor_value_info("dz", F32, [1, 1, 2, 2])],
                             [helper.make_tensor_value_info(o, F32, None) for o in outputs])


def _pool(name, outputs, **attrs):
    return helper.make_node("MaxPool", ["x"], outputs, name=name, **{"kernel_shape": [2, 2], "strides": [2, 2],
                                                                      **attrs})


def _unpool(indices="i"):
    return helper.make_node("MaxUnpool", ["dz", indices], ["dx"], kernel_shape=[2, 2], strides=[2, 2], name="u")


def test_only_a_recomputation_of_the_same_pool_is_merged():
    other = _graph([_pool("f", ["y"]), _pool("b", ["y2", "i"], strides=[1, 1]), _unpool()])
    assert not max_pool_indices_from_forward(other, {"f"})  # another geometry
    ordered = _graph([_pool("f", ["y"], storage_order=1), _pool("b", ["y2", "i"]), _unpool()])
    assert not max_pool_indices_from_forward(ordered, {"f"})  # the forward's Indices would be column-major
    shown = _graph([_pool("f", ["y"]), _pool("b", ["y2", "i"]), _unpool()], outputs=("dx", "y2"))
    assert not max_pool_indices_from_forward(shown, {"f"})  # its pooled output is a graph output
    same = _graph([_pool("f", ["y"]), _pool("b", ["y2", "i"]), _unpool(),
                   helper.make_node("Greater", ["y2", "y"], ["m"], name="m")], outputs=("dx", "m"))
    assert max_pool_indices_from_forward(same, {"f"})
    assert [list(n.output) for n in _pools(same)] == [["y", "i"]]
    assert list(same.node[-1].input) == ["y", "y"]
    with emit_options(max_pool_indices_from_forward=False):
        again = _graph([_pool("f", ["y"]), _pool("b", ["y2", "i"]), _unpool()])
        assert not max_pool_indices_from_forward(again, {"f"})


def test_unread_indices_are_dropped_and_read_ones_kept():
    read = _graph([_pool("f", ["y", "i"]), _unpool()])
    assert not drop_unread_max_pool_indices(read)
    unread = _graph([_pool("f", ["y", "i"]), helper.make_node("Identity", ["y"], ["dx"], name="id")])
    assert drop_unread_max_pool_indices(unread)
    assert list(_pools(unread)[0].output) == ["y"]
