"""onnxruntime's contrib ops of the model builder beyond the sweep's finite differences: the GroupQueryAttention
variants the rule does not model are refused by name, a non-empty KV cache stops the backward, what the rules
emit is standard ONNX, and SimplifiedLayerNormalization has its rule in both domains.

A window-sized KV cache (``sliding_window_cache=1``, the model builder's default for Gemma2/Gemma3's local
layers): onnxruntime's kernel and our float64 form give the documented formula over a fresh sequence (a past
buffer of capacity C >= local_window_size holding no position, its rows not read); the rule's gradient agrees
with finite differences of that form in float64; its present reaching the loss is refused, and a buffer that
holds positions (seqlens_k + 1 > S) stops the backward."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnx_autodiff.check.contrib_forms import group_query_attention
from onnx_autodiff.check.gradcheck import to_float64
from onnx_autodiff.engine.registry import find_rule
from onnx_autodiff.errors import GradientRuleError
from onnx_autodiff.partial.vjp import build_vjp
from onnx_autodiff.testing import In, RuleCase
from onnx_autodiff.testing.rule_cases import check_rule_case, rule_case_model, substitute
from tests.rules.test_gqa_window_softcap import _rotate, reference

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
    present = None if attrs.get("sliding_window_cache") else past + S  # a windowed cache's: its capacity
    out_infos = [helper.make_tensor_value_info("out", f, [B, S, N * H]),
                 helper.make_tensor_value_info("present_key", f, [B, NKV, present, H]),
                 helper.make_tensor_value_info("present_value", f, [B, NKV, present, H]),
                 helper.make_tensor_value_info("qk", f, None)][:outputs]
    graph = helper.make_graph([node], "gqa", graph_inputs, out_infos, initializer=inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model


@pytest.mark.parametrize("attr,value", [("smooth_softmax", 1),
                                        ("sliding_window_cache", 1),  # without a local window
                                        ("k_quant_type", "PER_TENSOR"),
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


def _run_vjp(model, past: int, B: int = B, known: int | None = None):
    """The backward of ``model``'s out w.r.t. qkv on a past of ``past`` rows (random) and ``known`` tokens after
    the step (default past + S: all of the past's rows hold positions)."""
    known = past + S if known is None else known
    vjp = build_vjp(model, wrt=["qkv"], outputs=["out"])
    assert {n.domain for n in vjp.backward.graph.node} <= {""}, "the backward must be standard ONNX"
    onnx.checker.check_model(vjp.backward, full_check=True)
    rng = np.random.default_rng(1)
    feeds = {"qkv": rng.standard_normal((B, S, (N + 2 * NKV) * H)).astype(np.float32),
             "past_key": rng.standard_normal((B, NKV, past, H)).astype(np.float32),
             "past_value": rng.standard_normal((B, NKV, past, H)).astype(np.float32),
             "seqlens_k": np.full(B, known - 1, np.int32), "total": np.array(known, np.int32)}
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


# ---- a window-sized KV cache (sliding_window_cache=1) --------------------------------------------------------------
WINDOW, SEQ = 3, 7  # a window shorter than the sequence, so it masks and the cache evicts


def _windowed_case(capacity: int, outputs: int = 1, **attrs) -> RuleCase:
    """One packed, rotary GroupQueryAttention over a fresh sequence of SEQ tokens (seqlens_k = SEQ - 1) with a
    past buffer of ``capacity`` rows (zeros: what the driver feeds), the form of contrib_forms in its place."""
    f, b = dict(dtype="float32"), 2
    angles = np.random.default_rng(3).uniform(0.0, 3.0, (16, 8))
    empty = In(value=np.zeros((b, NKV, capacity, H)), **f)
    inputs = [In((b, SEQ, (N + 2 * NKV) * H), **f), None, None, empty, empty,
              In(value=np.full(b, SEQ - 1), dtype="int32"), In(value=np.array(SEQ), dtype="int32"),
              In(value=np.cos(angles), **f), In(value=np.sin(angles), **f)]
    return RuleCase("GroupQueryAttention", inputs, domain="com.microsoft", opset=21, outputs=outputs,
                    attrs={"num_heads": N, "kv_num_heads": NKV, "do_rotary": 1, "local_window_size": WINDOW,
                           "sliding_window_cache": 1, **attrs},
                    id=f"windowed-cache-{capacity}", reference=group_query_attention(H, 8))


def _resident(known: int, capacity: int) -> int:
    """L(T): the rows a windowed cache holds after T tokens (onnxruntime's operator documentation)."""
    grain = capacity - WINDOW + 1
    return known if known <= capacity else known - grain * -(-(known - capacity) // grain)


@pytest.mark.parametrize("capacity", [WINDOW, WINDOW + 2, SEQ + 2])
def test_a_windowed_cache_over_a_fresh_sequence_gives_the_documented_formula(capacity):
    model, feeds, _ = rule_case_model(_windowed_case(capacity, outputs=3, softcap=2.0))
    values = {t.name: onnx.numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    q, k, v = np.split(feeds["x0"].astype(np.float64), [N * H, (N + NKV) * H], axis=-1)
    attrs = {a.name: helper.get_attribute_value(a) for a in model.graph.node[0].attribute}
    want = reference(attrs, q, k, v, np.full(2, SEQ - 1), values["x7"], values["x8"])
    keys = _rotate(k.reshape(2, SEQ, NKV, H), values["x7"], values["x8"], False).transpose(0, 2, 1, 3)
    rows = _resident(SEQ, capacity)
    assert rows < SEQ or capacity > SEQ
    for name, t in list(values.items()):  # the buffer's rows hold no position: onnxruntime does not read them
        if name in ("x3", "x4"):
            model.graph.initializer.remove(next(i for i in model.graph.initializer if i.name == name))
            model.graph.initializer.append(onnx.numpy_helper.from_array(np.full(t.shape, 7.0, np.float32), name))
    out, present_k, present_v = ort.InferenceSession(model.SerializeToString(),
                                                     providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert present_k.shape == (2, NKV, capacity, H)
    np.testing.assert_allclose(present_k[:, :, :rows], keys[:, :, SEQ - rows:], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(present_v[:, :, :rows], v.reshape(2, SEQ, NKV, H).transpose(0, 2, 1, 3)[:, :,
                               SEQ - rows:], rtol=1e-6)
    form64 = to_float64(substitute(_windowed_case(capacity, outputs=3, softcap=2.0).reference)(model))
    got = ort.InferenceSession(form64.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x0": feeds["x0"].astype(np.float64)})
    np.testing.assert_allclose(got[0], want, rtol=1e-12, atol=1e-12)
    assert got[1].shape == (2, NKV, capacity, H)
    np.testing.assert_allclose(got[1][:, :, :rows], keys[:, :, SEQ - rows:], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("capacity,softcap", [(WINDOW, 2.0), (SEQ, 0.0)])
def test_a_windowed_cache_gradient_agrees_with_finite_differences_in_float64(capacity, softcap):
    """The kernel's outputs (the presents too: onnxruntime needs them, and with L(SEQ) = capacity here every row
    is specified) agree with the form's first; then the output's gradient with finite differences."""
    case = _windowed_case(capacity, outputs=3, softcap=softcap)
    case.check_outputs = [0]
    report = check_rule_case(case)
    assert report.ok and report.checks, report


def test_a_windowed_caches_present_on_the_loss_is_refused():
    model, _, wrt = rule_case_model(_windowed_case(WINDOW, outputs=3))
    with pytest.raises(GradientRuleError, match="sliding_window_cache=1 and its present key/value reach the loss"):
        build_vjp(model, wrt=wrt, outputs=["y0", "y1"])


def test_a_windowed_buffer_that_holds_positions_stops_the_backward():
    model = _gqa_model(past=WINDOW, b=1, sliding_window_cache=1, local_window_size=WINDOW)
    grads = _run_vjp(model, past=WINDOW, B=1, known=S)  # fresh: the buffer's rows hold no position
    assert grads[0].shape == (1, S, (N + 2 * NKV) * H) and np.abs(grads[0]).max() > 0
    with pytest.raises(Exception, match=r"attn/grad/Reshape.*cannot be reshaped"):
        _run_vjp(model, past=WINDOW, B=1, known=S + 2)  # two positions cached before the step
