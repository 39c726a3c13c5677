"""The causal_lm loss against transformers' own (ForCausalLMLoss, what LlamaForCausalLM(labels=...) computes):
shifted by one, -100 ignored, the mean over counted tokens, an attention mask; and cross-entropy on [B, S, V]
logits, which must be told the class axis."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import TrainingBuilderError, TrainingSession
from onnx_autodiff.training import LossSpec, make_training_model

V, H = 11, 6
D = TensorProto.DOUBLE


def tiny_lm(seed: int = 0) -> onnx.ModelProto:
    """input_ids [B, S] -> embedding [V, H] -> head [H, V] -> logits [B, S, V], float64."""
    rng = np.random.default_rng(seed)
    emb, head = rng.normal(size=(V, H)), rng.normal(size=(H, V))
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["h"]),
             helper.make_node("MatMul", ["h", "head"], ["logits"])]
    graph = helper.make_graph(nodes, "lm", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["B", "S"]),
                                            helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                                                          ["B", "S"])],
                              [helper.make_tensor_value_info("logits", D, ["B", "S", V])],
                              [numpy_helper.from_array(emb, "emb"), numpy_helper.from_array(head, "head")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _torch(model, ids, labels):
    from transformers.loss.loss_utils import ForCausalLMLoss

    inits = {t.name: torch.tensor(numpy_helper.to_array(t), requires_grad=True) for t in model.graph.initializer}
    logits = inits["emb"][torch.tensor(ids)] @ inits["head"]
    loss = ForCausalLMLoss(logits, torch.tensor(labels), vocab_size=V)
    loss.backward()
    return loss.item(), inits["head"].grad.numpy()


def _ours(training, feeds):
    sess = TrainingSession(training)
    values = sess.gradients(feeds)
    grad = next(k for k in values if k.endswith("head_grad"))
    return float(values[sess.loss_name].numpy()), values[grad].numpy()


def test_labels_default_to_the_token_ids():
    model = tiny_lm()
    training = make_training_model(model, "causal_lm", "sgd", trainable=["head"])
    assert [i.name for i in training.training_info[0].algorithm.input] == ["learning_rate"]
    ids = np.random.default_rng(1).integers(0, V, (3, 7))
    loss, grad = _ours(training, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    ref_loss, ref_grad = _torch(model, ids, ids)
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)  # transformers computes the loss in float32
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_mask_and_ignore_index():
    """Padded positions (mask 0) and labels of -100 do not count; the mean is over the counted tokens."""
    model = tiny_lm()
    ids = np.random.default_rng(2).integers(0, V, (3, 7))
    mask = np.ones_like(ids)
    mask[1, 4:] = 0
    mask[2, 2:] = 0
    labels = ids.copy()
    labels[0, 3] = -100
    loss = LossSpec("causal_lm", label="labels", options={"mask": "attention_mask"})
    training = make_training_model(model, loss, "sgd", trainable=["head"])
    loss, grad = _ours(training, {"input_ids": ids, "attention_mask": mask, "labels": labels})
    ref_loss, ref_grad = _torch(model, ids, np.where(mask == 0, -100, labels))
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)  # transformers computes the loss in float32
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)
    unmasked, _ = _torch(model, ids, labels)
    assert abs(unmasked - ref_loss) > 1e-3  # the mask changed the value


def test_cross_entropy_on_bsv_logits_needs_the_axis(caplog):
    caplog.set_level("INFO", logger="onnx_autodiff")
    model = tiny_lm()
    with pytest.raises(TrainingBuilderError, match="causal_lm") as err:
        make_training_model(model, "cross_entropy", "sgd")
    assert "axis" in str(err.value)
    training = make_training_model(model, LossSpec("cross_entropy", options={"axis": -1}), "sgd", trainable=["head"])
    assert "the classes are on axis -1" in caplog.text
    label = next(i for i in training.training_info[0].algorithm.input if i.name == "labels")
    assert [d.dim_param or d.dim_value for d in label.type.tensor_type.shape.dim] == ["B", "S"]
    ids = np.random.default_rng(3).integers(0, V, (2, 5))
    labels = np.random.default_rng(4).integers(0, V, (2, 5))
    loss, _ = _ours(training, {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": labels})
    emb, head = (numpy_helper.to_array(t) for t in model.graph.initializer)
    ref = torch.nn.functional.cross_entropy(torch.tensor(emb[ids] @ head).reshape(-1, V),
                                            torch.tensor(labels).reshape(-1))
    assert abs(loss - ref.item()) <= 1e-12 * ref.item()


@pytest.mark.parametrize("kwargs, words", [
    ({"options": {"mask": "nope"}}, "not an input"),
    ({"options": {"axis": 1}}, "no option 'axis'"),
    ({"label": "logits"}, "already a name"),
])
def test_causal_lm_errors(kwargs, words):
    with pytest.raises(TrainingBuilderError, match=words):
        make_training_model(tiny_lm(), LossSpec("causal_lm", **kwargs), "sgd")


def test_causal_lm_without_token_input_needs_a_label():
    model = tiny_lm()
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT  # no integer [B, S] input named input_ids
    model.graph.input[1].type.tensor_type.elem_type = TensorProto.FLOAT
    with pytest.raises(TrainingBuilderError, match="token-id input"):
        make_training_model(model, "causal_lm", "sgd", check=False)


def test_the_loss_gradient_makes_few_vocabulary_sized_values():
    """The gradient reads the forward's log_prob and writes c * (softmax - one_hot) with one ScatterElements:
    besides the logits, their flattening, log_prob and reshapes, only Exp, the scaling Mul
    and the ScatterElements are [B * S, V] (no second log-softmax, no [B * S, V] one-hot or mask). The
    forward's log_prob is a LogSoftmax over the last axis, not SoftmaxCrossEntropyLoss (whose function body
    onnxruntime runs with two more [B * S, V] transposes: ``passes/loss_forms.py``)."""
    from onnx_autodiff.graph import infer_tensor_info

    step = onnx.ModelProto.FromString(TrainingSession(
        make_training_model(tiny_lm(), "causal_lm", "sgd", trainable=["head"])).step_model.SerializeToString())
    for inp in step.graph.input:
        if inp.name in ("input_ids", "attention_mask"):
            for d, size in zip(inp.type.tensor_type.shape.dim, (3, 7)):
                d.dim_value = size
    producer = {o: n.op_type for n in step.graph.node for o in n.output}
    big = sorted(producer[k] for k, t in infer_tensor_info(step).items()
                 if k in producer and t.shape is not None and tuple(t.shape) in ((21, V), (3, 7, V)))
    big = [op for op in big if op != "Reshape"]  # views in onnxruntime (here also the head gradient's [21, V])
    assert big == ["Exp", "Flatten", "LogSoftmax", "MatMul", "Mul", "ScatterElements"]
    assert "SoftmaxCrossEntropyLoss" not in producer.values()
