"""LoRA over a 4-bit base made by onnxruntime's own quantizer from a tiny Llama (transformers, random
weights, dynamo export): MatMulNBits (QOperator) and blocked-int4 DequantizeLinear (QDQ). Rank 4 on q/v,
causal_lm, 20 AdamW steps: the loss falls, the base's bytes do not change, and the merged model (a float
weight dequant(W) + delta in place of each adapted quantized layer) gives the adapted model's logits."""
import copy
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_autodiff.driver.session import TrainingSession
from onnx_autodiff.training.builder import make_training_model
from onnx_autodiff.training.lora import lora_record

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
mq = pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")

VOCAB, SEQ = 128, 16
NAME_SCOPES = "pkg.torch.onnx.name_scopes"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> onnx.ModelProto:
    from transformers import LlamaConfig, LlamaForCausalLM

    class LogitsOnly(LlamaForCausalLM):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids, use_cache=False).logits

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="eager")
    path = str(tmp_path_factory.mktemp("llama") / "llama.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(LogitsOnly(cfg).eval(), (torch.randint(0, VOCAB, (2, SEQ)),), dynamo=True,
                                    input_names=["input_ids"], output_names=["logits"],
                                    dynamic_shapes=({0: "B", 1: "S"},), verbose=False)
    program.save(path)
    return onnx.load(path)


def _quantize(model: onnx.ModelProto, fmt: str) -> onnx.ModelProto:
    """onnxruntime's 4-bit weight-only quantizer, blocks of 32 with zero points. It drops the exporter's
    module-path metadata from the nodes it replaces: carry it over (it names a MatMul's replacement
    ``<name>_Q4``, or ``<name>_matmul_Q4`` beside a DequantizeLinear) so the LoRA targets can say q_proj."""
    from onnxruntime.quantization import QuantFormat

    config = mq.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=False,
                                             quant_format=getattr(QuantFormat, fmt))
    quantizer = mq.MatMulNBitsQuantizer(copy.deepcopy(model), algo_config=config)
    quantizer.process()
    out = quantizer.model.model
    scopes = {n.name: [p for p in n.metadata_props if p.key == NAME_SCOPES] for n in model.graph.node}
    for n in out.graph.node:
        origin = next((k for k in (n.name.removesuffix("_matmul_Q4"), n.name.removesuffix("_Q4")) if scopes.get(k)),
                      None)
        if origin is not None and not any(p.key == NAME_SCOPES for p in n.metadata_props):
            n.metadata_props.extend(scopes[origin])
    return out


def _logits(model: onnx.ModelProto, ids: np.ndarray, extra: dict | None = None) -> np.ndarray:
    """The logits without graph optimizations: onnxruntime otherwise fuses DequantizeLinear + MatMul into
    MatMulNBits computing with int8 activations (its session.qdq_matmulnbits_accuracy_level, 4 by default),
    which moves the logits by ~1e-2 and would hide what the merge itself changes."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(["logits"], {"input_ids": ids, **(extra or {})})[0]


@pytest.mark.slow
@pytest.mark.parametrize("fmt, quantized_op", [("QOperator", "MatMulNBits"), ("QDQ", "DequantizeLinear")])
def test_lora_on_a_4bit_base_trains_and_merges(llama, fmt, quantized_op):
    base = _quantize(llama, fmt)
    assert sum(n.op_type == quantized_op for n in base.graph.node) == 15  # 7 projections x 2 layers, and lm_head
    before = {t.name: t.SerializeToString() for t in base.graph.initializer}
    model = make_training_model(base, loss="causal_lm", optimizer="adamw", lr=1e-2,
                                lora={"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]})
    record = lora_record(model)
    assert {layer["quant"] for layer in record["layers"]} == {"nbits" if fmt == "QOperator" else "dequantize_linear"}
    assert len(record["layers"]) == 4
    updated = {b.key for b in model.training_info[0].update_binding}
    assert not updated & set(before), "a base tensor is trained"

    session = TrainingSession(model, progress=False)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (4, SEQ)).astype(np.int64)
    losses = [float(session.step({"input_ids": ids})[session.loss_name]) for _ in range(20)]
    assert losses[-1] < losses[0] - 0.2, losses  # one batch, seen 20 times: about 4.87 -> 4.56

    adapted = session.inference_model(adapters="inputs")  # the base as it was, adapters fed beside it
    after = {t.name: t.SerializeToString() for t in adapted.graph.initializer if t.name in before}
    assert after == before, "the quantized base changed"
    trained = {layer[k]: session.get_state(layer[k]) for layer in record["layers"] for k in ("lora_A", "lora_B")}
    probe = rng.integers(0, VOCAB, (2, SEQ)).astype(np.int64)
    want = _logits(adapted, probe, trained)
    assert not np.allclose(want, _logits(base, probe), atol=1e-3), "the adapters did not move the logits"

    merged = session.inference_model()  # the merged export: q and v become float MatMuls of dequant(W) + delta
    assert not any(".lora_" in t.name for t in merged.graph.initializer)
    assert sum(n.op_type == quantized_op for n in merged.graph.node) == 11
    onnx.checker.check_model(merged, full_check=True)
    np.testing.assert_allclose(_logits(merged, probe), want, rtol=0, atol=1e-4)
