"""onnxruntime-genai model-builder output (tests/genai_models.py: tiny random Llama, Qwen2, Phi-3, int4 and
fp32) loads, checks and trains with LoRA on every projection: the first step's loss is the base model's
(onnxruntime's own run of the builder's model.onnx), the loss falls, the base's bytes do not change, and a
training model saved to a file trains the same as in memory (int4 from its file once trained against a base
of zeros: the quantization constants of MatMulNBits were fed as run-time inputs)."""
import hashlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_autodiff import TrainingSession, make_training_model, save_model
from onnx_autodiff.model.io import load_checked
from onnx_autodiff.model.weights import check_model
from onnx_autodiff.training.lora import lora_record

BATCH, SEQ, KV_HEADS, HEAD = 4, 16, 2, 16
PROJECTIONS = ["qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(3, 1000, (BATCH, SEQ)).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for layer in range(2):
        for kv in ("key", "value"):  # an empty KV cache (the driver will feed it itself: issue 28)
            feeds[f"past_key_values.{layer}.{kv}"] = np.zeros((BATCH, KV_HEADS, 0, HEAD), np.float32)
    return feeds


def base_loss(path, feeds) -> float:
    """The causal-LM loss of the builder's own model on ``feeds``, by onnxruntime (next-token cross-entropy).
    Basic graph optimizations only: the extended ones fuse Qwen2's qkv bias into MatMulNBits, which changes
    the int4 product's int8 rounding (the loss by 3e-4), and a LoRA branch between the two keeps them apart."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    logits = sess.run(["logits"], feeds)[0][:, :-1].astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, feeds["input_ids"][:, 1:, None], -1).mean())


def _digest(folder) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(folder.glob("model.onnx*")))).hexdigest()


@pytest.mark.parametrize("precision", ["int4", "fp32"])
def test_builder_model_loads_and_checks(builder_models, precision):
    light, _ = load_checked(builder_models.get("llama", precision))
    check_model(light)  # what onnx.checker's full check says of it, the builder's quirks set aside
    assert [n.domain for n in light.graph.node if n.op_type == "SimplifiedLayerNormalization"] == [""]


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
@pytest.mark.parametrize("precision", ["int4", "fp32"])
def test_lora_on_every_projection_trains(builder_models, family, precision, tmp_path):
    path = builder_models.get(family, precision)
    before = _digest(path.parent)
    model = make_training_model(str(path), "causal_lm", "adamw", lr=1e-2, lora={"rank": 4, "targets": ["all"]})
    layers = lora_record(model)["layers"]
    assert sorted({t["module"].rsplit(".", 1)[-1] for t in layers}) == sorted(PROJECTIONS)
    assert len(layers) == 2 * len(PROJECTIONS)
    assert {t["quant"] for t in layers} == ({"nbits"} if precision == "int4" else {""})
    feeds = _batch()
    sess = TrainingSession(model)
    losses = [float(sess.step(feeds)["loss"]) for _ in range(5)]
    # int4: the kernel rounds activations to int8 at accuracy_level 4, so the step's product rounds as the
    # builder's model does only when its quantization constants reach onnxruntime as constants
    assert losses[0] == pytest.approx(base_loss(path, feeds), rel=1e-6)
    assert losses[-1] < losses[0] - 0.5, losses
    assert _digest(path.parent) == before


def test_int4_training_model_from_its_file_trains_against_the_base(builder_models, tmp_path):
    """make_training_model -> save -> TrainingSession(file): the first loss is the base's, not ln(1000)."""
    path = builder_models.get("llama", "int4")
    feeds = _batch()
    saved = tmp_path / "train.onnx"
    save_model(make_training_model(str(path), "causal_lm", "adamw", lr=1e-2, lora={"rank": 4, "targets": ["all"]}),
               saved)
    assert onnx.load(str(saved), load_external_data=False).graph.node  # a model, not just data
    sess = TrainingSession(str(saved))
    losses = [float(sess.step(feeds)["loss"]) for _ in range(3)]
    assert abs(losses[0] - np.log(1000)) > 0.5, "the base computed zeros"
    assert losses[0] == pytest.approx(base_loss(path, feeds), rel=1e-6)
    assert losses[-1] < losses[0]


def test_fit_takes_the_empty_kv_cache(builder_models):
    """fit's data fingerprint once failed on the zero-length past arrays (a memoryview cast of an empty view)."""
    path = builder_models.get("llama", "int4")
    model = make_training_model(str(path), "causal_lm", "adamw", lr=1e-2, lora={"rank": 4, "targets": ["attention"]})
    data = {k: np.concatenate([v, _batch(1)[k]]) for k, v in _batch(0).items()}
    state = TrainingSession(model).fit(data, batch_size=4, epochs=3, progress=False)
    assert state.epochs_done == 3 and state.losses[-1] < state.losses[0], state.losses


@pytest.mark.parametrize("family,precision,extra,targets", [
    ("llama", "fp32", {"fuse_qkv": "false"}, ["q_proj", "k_proj", "v_proj", "o_proj"]),  # q, k, v apart into GQA
    ("llama", "int4", {"is_symmetric": "false"}, ["all"]),  # zero points
    ("qwen2", "int4", {"accuracy_level": "1"}, ["all"]),  # float products
    ("llama", "int4", {"shared_embeddings": "true"}, ["mlp"]),  # a GatherBlockQuantized embedding tied to lm_head
], ids=["separate-qkv", "zero-points", "accuracy-level-1", "quantized-embedding"])
def test_builder_variants_train(builder_models, family, precision, extra, targets):
    path = builder_models.get(family, precision, **extra)
    model = make_training_model(str(path), "causal_lm", "adamw", lr=1e-2, lora={"rank": 4, "targets": targets})
    feeds = _batch()
    sess = TrainingSession(model)
    losses = [float(sess.step(feeds)["loss"]) for _ in range(4)]
    assert losses[0] == pytest.approx(base_loss(path, feeds), rel=1e-6)
    assert losses[-1] < losses[0] - 0.5, losses
