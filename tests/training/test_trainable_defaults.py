"""The default trainable set holds a model's parameters, not the constants exporters store as
initializers; Identity aliases from the TorchScript exporter's de-duplication train apart."""
from __future__ import annotations

import io
import logging
import warnings

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

import onnx_autodiff as oa
from onnx_autodiff.training import select_trainable
from onnx_autodiff.training.parameters import constant_initializers, untie_aliases


def _init(name, value):
    return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)


def exporter_like_model():
    """x @ W + b, GELU-tanh with a lifted Pow exponent and scalars, an attention-like scale, an
    additive mask, rotary cos/sin tables, a 1-output head with its [1] bias, a PRelu slope [1], a
    0-d learnable temperature through Exp: like the dynamo exporter's initializers."""
    rng = np.random.default_rng(0)
    ang = rng.uniform(0, 6, (1, 4, 3))
    inits = [
        _init("W", rng.standard_normal((3, 3))), _init("b", rng.standard_normal(3)),
        _init("val_3", 3.0), _init("val_4", 0.044715), _init("val_5", np.array([0.5])),
        _init("val_scale", 0.57), _init("val_mask", np.triu(np.full((4, 3), -np.inf), 1)[None]),
        _init("cos_t", np.cos(ang)), _init("sin_t", np.sin(ang)),
        _init("head_w", rng.standard_normal((1, 3))), _init("head_b", [0.1]),
        _init("slope", [0.25]), _init("temperature", 0.3),
    ]
    n = helper.make_node
    nodes = [
        n("MatMul", ["x", "W"], ["h0"]), n("Add", ["h0", "b"], ["h1"]),
        n("Pow", ["h1", "val_3"], ["p"]), n("Mul", ["p", "val_4"], ["p1"]), n("Add", ["h1", "p1"], ["g0"]),
        n("Mul", ["g0", "val_5"], ["g1"]), n("Mul", ["g1", "val_scale"], ["s"]), n("Add", ["s", "val_mask"], ["m"]),
        n("Mul", ["m", "cos_t"], ["r0"]), n("Mul", ["h1", "sin_t"], ["r1"]), n("Add", ["r0", "r1"], ["r"]),
        n("PRelu", ["r", "slope"], ["q"]), n("Gemm", ["q2", "head_w", "head_b"], ["o0"], transB=1),
        n("Exp", ["temperature"], ["t"]), n("Mul", ["o0", "t"], ["y"]),
        n("Reshape", ["q", "shape"], ["q2"]),
    ]
    nodes = nodes[:12] + [nodes[15]] + nodes[12:15]
    inits.append(numpy_helper.from_array(np.array([-1, 3], np.int64), "shape"))
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 1])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def test_exporter_constants_are_not_trained_by_default():
    m = exporter_like_model()
    assert constant_initializers(m) == {
        "val_3": "pow exponent", "val_4": "scalar constant", "val_5": "scalar constant",
        "val_scale": "scalar constant", "val_mask": "additive mask", "cos_t": "rotary table", "sin_t": "rotary table"}
    assert select_trainable(m) == ["W", "b", "head_w", "head_b", "slope", "temperature"]
    assert select_trainable(m, trainable=["val_scale", "W"]) == ["W", "val_scale"]  # still possible by name


def test_the_builder_says_what_it_trains_and_what_it_froze(caplog):
    with caplog.at_level(logging.INFO, logger="onnx_autodiff"):
        oa.make_training_model(exporter_like_model(), loss="mse")
    text = caplog.text
    assert ("training 6 initializers: W [3, 3], b [3], head_w [1, 3], head_b [1], slope [1], "
            "temperature [] (18 values)") in text
    assert "frozen by default (pow exponent): val_3 []" in text
    assert "frozen by default (additive mask): val_mask [1, 4, 3]" in text


def _two_layer_norms():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.lin, self.b = torch.nn.LayerNorm(4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)

        def forward(self, x):
            return self.b(self.lin(self.a(x)))

    torch.manual_seed(0)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(M().eval(), (torch.randn(3, 4),), buf, dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["y"])
    return onnx.load_from_string(buf.getvalue())


def test_torchscript_merged_parameters_are_untied_by_default():
    m = _two_layer_norms()
    aliases = {(n.output[0], n.input[0]) for n in m.graph.node if n.op_type == "Identity"}
    assert aliases == {("b.weight", "a.weight"), ("b.bias", "a.bias")}  # the exporter merged the fresh LayerNorms
    trained = oa.make_training_model(m, loss="mse")
    names = oa.training.builder_record(trained)["trainable"]
    assert {"a.weight", "a.bias", "b.weight", "b.bias"} <= set(names)
    assert not any(n.op_type == "Identity" for n in trained.graph.node)
    tied = oa.make_training_model(m, loss="mse", untie=False)
    assert not {"b.weight", "b.bias"} & set(oa.training.builder_record(tied)["trainable"])


def test_untied_aliases_train_apart():
    m = _two_layer_norms()
    sess = oa.TrainingSession(oa.make_training_model(m, loss="mse", optimizer="sgd", lr=0.5))
    rng = np.random.default_rng(0)
    sess.step({"x": rng.standard_normal((3, 4)).astype(np.float32),
               "labels": rng.standard_normal((3, 4)).astype(np.float32)})
    assert not np.allclose(sess.get_state("a.weight"), sess.get_state("b.weight"))


def test_real_tying_stays():
    m = _two_layer_norms()
    pairs = untie_aliases(m)
    assert sorted(pairs) == [("b.bias", "a.bias"), ("b.weight", "a.weight")]
    readers = [n for n in m.graph.node if "a.weight" in n.input]
    assert len(readers) == 1  # one initializer read directly by two nodes would stay one


def test_constants_folded_for_the_example_batch_are_frozen_but_layers_with_batch_many_channels_train():
    # (2, 5, 3): the dynamo exporter's folded token-type lookup for a batch of 2; a Conv with 2 output
    # channels has a weight of leading dim 2 too, but a Conv reads it as its weight
    rng = np.random.default_rng(0)
    n = helper.make_node
    nodes = [n("Add", ["x", "folded"], ["h"]), n("Unsqueeze", ["h", "one"], ["h4"]),
             n("Conv", ["h4", "w"], ["y"])]
    inits = [_init("folded", rng.standard_normal((2, 5, 3))), _init("w", rng.standard_normal((2, 5, 1, 1))),
             numpy_helper.from_array(np.array([2], np.int64), "one")]
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2, 3, 1])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assert constant_initializers(m) == {"folded": "folded from the example input"}
    assert select_trainable(m) == ["w"]


def _toeplitz(rng, heads, t, s):
    """[1, heads, t, s] whose values depend on key minus query position only (a relative position bias)."""
    table = rng.standard_normal((heads, t + s - 1))
    return np.stack([[[table[h, j - i + t - 1] for j in range(s)] for i in range(t)] for h in range(heads)])[None]


def attention_model():
    """softmax(q k^T * scale + folded + learned + shared) v + shared v + offset, heads 2, T 3, S 5: ``folded``
    a relative position bias for these lengths (the dynamo exporter's T5 lookups), ``learned`` a full
    learned bias, ``shared`` relative-position-like but read by a MatMul too, ``offset`` relative-position-
    like added to the output, not to scores."""
    rng = np.random.default_rng(0)
    n = helper.make_node
    nodes = [n("MatMul", ["q", "kt"], ["scores"]), n("Mul", ["scores", "scale"], ["s0"]),
             n("Add", ["s0", "folded"], ["s1"]), n("Add", ["s1", "learned"], ["s2"]),
             n("Add", ["s2", "shared"], ["s3"]),
             n("Softmax", ["s3"], ["p"], axis=-1), n("MatMul", ["p", "v"], ["o"]), n("MatMul", ["shared", "v"], ["o2"]),
             n("Add", ["o", "o2"], ["o3"]), n("Add", ["o3", "offset"], ["y"])]
    inits = [_init("scale", 0.5), _init("folded", _toeplitz(rng, 2, 3, 5)),
             _init("learned", rng.standard_normal((1, 2, 3, 5))), _init("shared", _toeplitz(rng, 2, 3, 5)),
             _init("offset", _toeplitz(rng, 2, 3, 4))]
    f = TensorProto.FLOAT
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("q", f, [2, 2, 3, 4]),
                                       helper.make_tensor_value_info("kt", f, [2, 2, 4, 5]),
                                       helper.make_tensor_value_info("v", f, [2, 2, 5, 4])],
                          [helper.make_tensor_value_info("y", f, [2, 2, 3, 4])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m, full_check=True)
    return m


def test_a_relative_position_bias_folded_for_the_example_lengths_is_frozen(caplog):
    m = attention_model()
    assert constant_initializers(m) == {"scale": "scalar constant",
                                        "folded": "position bias folded for the example lengths"}
    with caplog.at_level(logging.INFO, logger="onnx_autodiff"):
        assert select_trainable(m) == ["learned", "shared", "offset"]
    assert "frozen by default (position bias folded for the example lengths): folded [1, 2, 3, 5]" in caplog.text


def test_the_position_bias_rule_needs_the_scores_lengths_and_two_activations():
    m = attention_model()
    # a bias of the scores' lengths added to x @ W (a layer, not attention scores) trains
    m.graph.initializer.append(_init("wk", np.ones((4, 5))))
    m.graph.node[0].input[1] = "wk"
    del m.graph.input[1]
    assert constant_initializers(m) == {"scale": "scalar constant"}
    # one of query length 1 (T = 1: any row is "equal along its diagonals") trains
    m = attention_model()
    m.graph.input[0].type.tensor_type.shape.dim[2].dim_value = 1
    m.graph.output[0].type.tensor_type.shape.dim[2].dim_value = 1
    for t in m.graph.initializer:
        if t.name in ("folded", "learned", "shared", "offset"):
            t.CopyFrom(_init(t.name, numpy_helper.to_array(t)[:, :, :1]))
    onnx.checker.check_model(m, full_check=True)
    assert constant_initializers(m) == {"scale": "scalar constant"}
