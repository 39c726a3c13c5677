"""passes/loss_forms.py: SoftmaxCrossEntropyLoss on [N, C] scores becomes LogSoftmax + NegativeLogLikelihoodLoss
in lowering; the loss, log_prob and the gradient are the values the node gives, scores of another rank keep it."""
from __future__ import annotations

import importlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnx_autodiff.passes import LoweringContext
from onnx_autodiff.passes.loss_forms import split_cross_entropy
from onnx_autodiff.training import make_training_model

F = TensorProto.FLOAT


def sce_model(shape, reduction="mean", ignore_index=None, weights=False, log_prob=True, opset=17):
    attrs = {"reduction": reduction}
    if ignore_index is not None:
        attrs["ignore_index"] = ignore_index
    inputs = [helper.make_tensor_value_info("x", F, shape),
              helper.make_tensor_value_info("t", TensorProto.INT64, [shape[0], *shape[2:]])]
    names = ["x", "t"]
    if weights:
        inputs.append(helper.make_tensor_value_info("w", F, [shape[1]]))
        names.append("w")
    outs = ["loss", "lp"] if log_prob else ["loss"]
    node = helper.make_node("SoftmaxCrossEntropyLoss", names, outs, name="xent", **attrs)
    loss_shape = [shape[0], *shape[2:]] if reduction == "none" else []
    g = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info(o, F, s)
                                                for o, s in zip(outs, [loss_shape, shape])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {k: v for k, v in feeds.items() if k in {i.name for i in sess.get_inputs()}})


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index,weights", [(None, False), (-100, False), (2, True), (None, True)])
@pytest.mark.parametrize("opset", [13, 17])
def test_split_gives_the_nodes_values(reduction, ignore_index, weights, opset):
    rng = np.random.default_rng(0)
    t = rng.integers(0, 7, 12)
    if ignore_index is not None:
        t[[1, 5]] = ignore_index
    feeds = {"x": rng.standard_normal((12, 7)).astype(np.float32), "t": t.astype(np.int64),
             "w": rng.uniform(0.5, 2.0, 7).astype(np.float32)}
    model = sce_model([12, 7], reduction, ignore_index, weights, opset=opset)
    want = run(model, feeds)
    split = onnx.ModelProto.FromString(model.SerializeToString())
    assert split_cross_entropy(split, LoweringContext(split))
    onnx.checker.check_model(split, full_check=True)
    assert [n.op_type for n in split.graph.node] == ["LogSoftmax", "NegativeLogLikelihoodLoss"]
    got = run(split, feeds)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_without_log_prob_output_and_other_ranks():
    no_lp = sce_model([4, 5], log_prob=False)
    assert split_cross_entropy(no_lp, LoweringContext(no_lp))
    assert [n.op_type for n in no_lp.graph.node] == ["LogSoftmax", "NegativeLogLikelihoodLoss"]
    onnx.checker.check_model(no_lp, full_check=True)
    for shape in ([4, 5, 3], None):  # rank 3, and unknown rank: the node stays
        m = sce_model([4, 5, 3])
        if shape is None:
            m.graph.input[0].type.tensor_type.ClearField("shape")
        assert not split_cross_entropy(m, LoweringContext(m))
        assert [n.op_type for n in m.graph.node] == ["SoftmaxCrossEntropyLoss"]


def test_lowered_training_step_is_split_and_its_gradient_unchanged():
    """A cross_entropy training model lowered with and without the pass: no SoftmaxCrossEntropyLoss left, the
    loss and the weight's gradient the same."""
    lowering = importlib.import_module("onnx_autodiff.passes.pipeline")  # the package's lower is the function

    x = helper.make_tensor_value_info("x", F, [6, 4])
    y = helper.make_tensor_value_info("y", F, [6, 3])
    w = onnx.numpy_helper.from_array(np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32), "w")
    model = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "m",
                                                [x], [y], [w]), opset_imports=[helper.make_opsetid("", 17)])
    training = make_training_model(model, "cross_entropy", "sgd", check=False)
    feeds = {"x": np.random.default_rng(2).standard_normal((6, 4)).astype(np.float32),
             "labels": np.array([0, 2, 1, 1, 0, 2], np.int64)}

    def step_values(m):
        from onnx_autodiff.driver.session import TrainingSession
        sess = TrainingSession(m, progress=False)
        vals = sess.gradients(feeds)
        return {k: v.numpy() for k, v in vals.items()}, sess.step_model

    split_vals, split_step = step_values(training)
    ops = {n.op_type for n in split_step.graph.node}
    assert "SoftmaxCrossEntropyLoss" not in ops and {"LogSoftmax", "NegativeLogLikelihoodLoss"} <= ops
    kept = tuple(p for p in lowering.PIPELINE if p is not split_cross_entropy)
    old, lowering.PIPELINE = lowering.PIPELINE, kept
    try:
            whole_vals, whole_step = step_values(training)
    finally:
        lowering.PIPELINE = old
        assert "SoftmaxCrossEntropyLoss" in {n.op_type for n in whole_step.graph.node}
    assert split_vals.keys() == whole_vals.keys()
    for k in split_vals:
        np.testing.assert_allclose(split_vals[k], whole_vals[k], rtol=1e-6, atol=1e-7, err_msg=k)
