"""onnxruntime's contrib ops of the model builder beyond the sweep's finite differences: the GroupQueryAttention
variants the rule does not model are refused by name, a non-empty KV cache stops the backward, what the rules
emit is standard ONNX, and SimplifiedLayerNormalization has its rule in both domains."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnx_autodiff.engine.registry import find_rule
from onnx_autodiff.errors import GradientRuleError
from onnx_autodiff.partial.vjp import build_vjp

B, S, N, NKV, H = 2, 4, 4, 2, 16


def _gqa_model(past: int = 0, inputs: dict | None = None, outputs: int = 3, b: int = B,
               **attrs) -> onnx.ModelProto:
    """One packed GroupQueryAttention over a past of ``past`` tokens (graph inputs), rotary caches as
    initializers; ``inputs``: extra inputs by position (name -> (dtype, shape))."""
    f, B = TensorProto.FLOAT, b
    names = ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total", "cos", "sin"]
    graph_inputs = [helper.make_tensor_value_info("qkv", f, [B, S, (N + 2 * NKV) * H]),
                    helper.make_tensor_value_info("past_key", f, [B, NKV, past, H]),
                    helper.make_tensor_value_info("past_value", f, [B, NKV, past, H]),
                    helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [B]),
                    helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    for pos, (name, dtype, shape) in sorted((inputs or {}).items()):
        names += [""] * (pos + 1 - len(names))
        names[pos] = name
        graph_inputs.append(helper.make_tensor_value_info(name, dtype, shape))
    angles = np.random.default_rng(0).uniform(0, 3, (32, H // 2))
    inits = [onnx.numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
             onnx.numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin")]
    outs = ["out", "present_key", "present_value", "qk"][:outputs]
    node = helper.make_node("GroupQueryAttention", names, outs, name="attn", domain="com.microsoft",
                            num_heads=N, kv_num_heads=NKV, do_rotary=1, **attrs)
    out_infos = [helper.make_tensor_value_info("out", f, [B, S, N * H]),
                 helper.make_tensor_value_info("present_key", f, [B, NKV, past + S, H]),
                 helper.make_tensor_value_info("present_value", f, [B, NKV, past + S, H]),
                 helper.make_tensor_value_info("qk", f, None)][:outputs]
    graph = helper.make_graph([node], "gqa", graph_inputs, out_infos, initializer=inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model


@pytest.mark.parametrize("attr,value", [("smooth_softmax", 1),
                                        ("sliding_window_cache", 1), ("k_quant_type", "PER_TENSOR"),
                                        ("v_quant_type", "PER_CHANNEL"), ("kv_cache_bit_width", 8)])
def test_unsupported_attributes_are_refused_by_name(attr, value):
    with pytest.raises(GradientRuleError, match=f"{attr}="):
        build_vjp(_gqa_model(**{attr: value}), wrt=["qkv"], outputs=["out"])


@pytest.mark.parametrize("pos,name,dtype,shape", [(9, "position_ids", TensorProto.INT64, [B, S]),
                                                  (10, "attention_bias", TensorProto.FLOAT, [B, N, S, S]),
                                                  (11, "head_sink", TensorProto.FLOAT, [N])])
def test_unsupported_inputs_are_refused_by_name(pos, name, dtype, shape):
    with pytest.raises(GradientRuleError, match=name):
        build_vjp(_gqa_model(inputs={pos: (name, dtype, shape)}), wrt=["qkv"], outputs=["out"])


def test_qk_output_is_refused():
    with pytest.raises(GradientRuleError, match="qk_output"):
        build_vjp(_gqa_model(outputs=4, qk_output=1), wrt=["qkv"], outputs=["out"])


def test_the_kv_cache_and_rotary_caches_get_no_gradient():
    with pytest.raises(GradientRuleError, match="past_key gets no gradient"):
        build_vjp(_gqa_model(), wrt=["qkv", "past_key"], outputs=["out"])
    with pytest.raises(GradientRuleError, match="cos_cache gets no gradient"):
        build_vjp(_gqa_model(), wrt=["qkv", "cos"], outputs=["out"])


def _run_vjp(model, past: int, B: int = B):
    vjp = build_vjp(model, wrt=["qkv"], outputs=["out"])
    assert {n.domain for n in vjp.backward.graph.node} <= {""}, "the backward must be standard ONNX"
    onnx.checker.check_model(vjp.backward, full_check=True)
    rng = np.random.default_rng(1)
    feeds = {"qkv": rng.standard_normal((B, S, (N + 2 * NKV) * H)).astype(np.float32),
             "past_key": rng.standard_normal((B, NKV, past, H)).astype(np.float32),
             "past_value": rng.standard_normal((B, NKV, past, H)).astype(np.float32),
             "seqlens_k": np.full(B, past + S - 1, np.int32), "total": np.array(past + S, np.int32)}
    forward = ort.InferenceSession(vjp.forward.SerializeToString(), providers=["CPUExecutionProvider"])
    saved = dict(zip([o.name for o in vjp.forward.graph.output], forward.run(None, feeds)))
    backward = ort.InferenceSession(vjp.backward.SerializeToString(), providers=["CPUExecutionProvider"])
    bfeeds = {i.name: (saved | feeds).get(i.name, np.ones((B, S, N * H), np.float32))
              for i in vjp.backward.graph.input}
    return backward.run(None, bfeeds)


def test_an_empty_past_trains_and_a_filled_one_stops_the_backward():
    grads = _run_vjp(_gqa_model(past=0), past=0)
    assert grads[0].shape == (B, S, (N + 2 * NKV) * H) and np.abs(grads[0]).max() > 0
    past = 3  # onnxruntime runs a multi-token step over a past for one sequence only
    assert _run_vjp(_gqa_model(past=0, b=1), past=0, B=1)[0].shape == (1, S, (N + 2 * NKV) * H)
    with pytest.raises(Exception, match=r"attn/grad/Reshape.*cannot be reshaped"):
        _run_vjp(_gqa_model(past=past, b=1), past=past, B=1)


def test_simplified_layer_normalization_has_its_rule_in_both_domains():
    default, ms = find_rule("", "SimplifiedLayerNormalization", 22), find_rule("com.microsoft",
                                                                                "SimplifiedLayerNormalization", 1)
    assert default is not None and ms is not None and default.fn is ms.fn


def test_the_quantized_embeddings_scales_get_no_gradient():
    from onnx import numpy_helper

    node = helper.make_node("GatherBlockQuantized", ["data", "ids", "scales"], ["y"], name="embed",
                            domain="com.microsoft", bits=4, block_size=32, quantize_axis=1)
    graph = helper.make_graph([node], "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 64])],
                              [numpy_helper.from_array(np.zeros((10, 32), np.uint8), "data"),
                               numpy_helper.from_array(np.ones((10, 2), np.float32), "scales")])
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    with pytest.raises(GradientRuleError, match="scales and zero points get no gradient"):
        build_vjp(model, wrt=["scales"])
