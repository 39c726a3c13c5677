"""onnxruntime-genai model-builder output (tests/genai_models.py: tiny random Llama, Qwen2, Phi-3, int4 and
fp32) loads, checks and trains with LoRA on every projection: the first step's loss is the base model's
(onnxruntime's own run of the builder's model.onnx), the loss falls, the base's bytes do not change, and a
training model saved to a file trains the same as in memory (int4 from its file once trained against a base
of zeros: the quantization constants of MatMulNBits were fed as run-time inputs; the first step's forward
check now stops that, planted below). The user gives token data only: the KV cache is fed empty by the
driver; ``onnx-autodiff check`` passes on every builder model."""
import hashlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnx_autodiff.driver.runs
from onnx_autodiff import TrainingSession, make_training_model, save_model
from onnx_autodiff.cli import main
from onnx_autodiff.errors import ForwardMismatchError
from onnx_autodiff.model.io import load_checked
from onnx_autodiff.model.weights import check_model
from onnx_autodiff.training.lora import lora_record

BATCH, SEQ, KV_HEADS, HEAD = 4, 16, 2, 16
PROJECTIONS = ["qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tokens(seed: int = 0) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(3, 1000, (BATCH, SEQ)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
    """Token data and an empty KV cache, as base_loss's onnxruntime run needs it (the driver makes the cache
    itself when it is not given: test_token_data_is_all_a_step_and_fit_take)."""
    feeds = _tokens(seed)
    for layer in range(2):
        for kv in ("key", "value"):
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
    """fit's data fingerprint once failed on the zero-length past arrays (a memoryview cast of an empty view);
    a KV cache the user gives is still taken."""
    path = builder_models.get("llama", "int4")
    model = make_training_model(str(path), "causal_lm", "adamw", lr=1e-2, lora={"rank": 4, "targets": ["attention"]})
    data = {k: np.concatenate([v, _batch(1)[k]]) for k, v in _batch(0).items()}
    state = TrainingSession(model).fit(data, batch_size=4, epochs=3, progress=False)
    assert state.epochs_done == 3 and state.losses[-1] < state.losses[0], state.losses


def test_token_data_is_all_a_step_and_fit_take(builder_models):
    """past_key_values.* are fed empty by the driver ([batch from the data, 2 kv heads, 0, head size 16 from
    shape inference: the builder declares it as kv_cache_dim]); present.* are not returned."""
    path = builder_models.get("qwen2", "int4")
    model = make_training_model(str(path), "causal_lm", "adamw", lr=1e-2, lora={"rank": 4, "targets": ["all"]})
    sess = TrainingSession(model)
    assert sess.feed_names == ["input_ids", "attention_mask"]
    out = sess.step(_tokens())
    assert sorted(out) == ["logits", "loss"]
    assert float(out["loss"]) == pytest.approx(base_loss(path, _batch()), rel=1e-6)
    data = {k: np.concatenate([v, _tokens(1)[k][:2]]) for k, v in _tokens(0).items()}  # 6 rows: a last batch of 2
    state = sess.fit(data, batch_size=4, epochs=3, progress=False)
    assert state.losses[-1] < state.losses[0], state.losses
    with_present = TrainingSession(model, outputs=["loss", "present.0.key"]).step(_tokens())
    assert with_present["present.0.key"].shape == (BATCH, KV_HEADS, SEQ, HEAD)


def test_a_zero_base_stops_at_the_first_step(builder_models, tmp_path, monkeypatch):
    """The old behaviour planted: MatMulNBits' quantization constants fed as run-time inputs, which made
    onnxruntime compute a base of zeros from the file (a loss of ln(1000)). The first step's forward check
    stops it, naming the logits, before any weight changes; without the check it trains against zeros."""
    path = builder_models.get("llama", "int4")
    saved = tmp_path / "train.onnx"
    save_model(make_training_model(str(path), "causal_lm", "adamw", lr=1e-2, lora={"rank": 4, "targets": ["all"]}),
               saved)
    monkeypatch.setattr(onnx_autodiff.driver.runs, "constant_inputs", lambda graph: set())
    sess = TrainingSession(str(saved))
    b_before = sess.get_state("model.layers.0.attn.qkv_proj.MatMul.weight_Q4.lora_B")
    with pytest.raises(ForwardMismatchError, match=r"'logits' differs .* by up to [0-9.]+") as e:
        sess.step(_tokens())
    assert sess.steps == 0
    np.testing.assert_array_equal(sess.get_state("model.layers.0.attn.qkv_proj.MatMul.weight_Q4.lora_B"), b_before)
    unchecked = TrainingSession(str(saved), check_forward=False)
    assert float(unchecked.step(_tokens())["loss"]) == pytest.approx(np.log(1000), abs=1e-3)  # what it was
    assert "report it" in e.value.hint


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
@pytest.mark.parametrize("precision", ["int4", "fp32"])
def test_check_passes(builder_models, family, precision, capsys):
    """onnx-autodiff check: float64 through the standard forms of the contrib ops, an empty KV cache, token ids
    over the vocabulary; the quantization constants and rotary tables are left out of wrt, by declaration."""
    assert main(["check", str(builder_models.get(family, precision))]) == 0
    out = capsys.readouterr().out
    assert "ok:" in out and "rotary table" in out
    assert ("quantization constant" in out) == (precision == "int4")


@pytest.mark.parametrize("precision", ["int4", "fp32"])
def test_check_target_runs_the_probe_on_the_batch_the_driver_feeds(builder_models, precision, capsys):
    """check --target's probe once fed random tensors with every symbolic dim 2, and onnxruntime refused the
    builder's GroupQueryAttention ("Input 'past_key' dimension 3 should match the packed KV head dimension, got 2
    expected 16"), for the file and its training model alike, while the model trains. Its batch is now the
    driver's (input_dims.probe_feeds): token ids over the vocabulary, the past empty at the head size the model
    declares as kv_cache_dim. On tract, which has no com.microsoft op, the check names the node and its op before
    anything runs."""
    from onnx_autodiff.check.input_dims import probe_feeds
    from onnx_autodiff.runtimes.check import check_target

    path = builder_models.get("llama", precision)
    feeds = probe_feeds(onnx.load(str(path), load_external_data=False))
    assert feeds["past_key_values.0.key"].shape == (feeds["input_ids"].shape[0], KV_HEADS, 0, HEAD)
    assert feeds["attention_mask"].shape == feeds["input_ids"].shape and feeds["input_ids"].max() > 1
    assert main(["check", str(path), "--target", "onnxruntime"]) == 0
    assert capsys.readouterr().out.strip().endswith("ok: the model runs on onnxruntime")
    training = make_training_model(str(path), "causal_lm", "adamw", lr=1e-2, lora={"rank": 4, "targets": ["all"]})
    result = check_target(training, "onnxruntime")
    assert result.ok and result.lines[-1] == "ok: the model trains on onnxruntime", result.lines
    if precision == "fp32":
        pytest.importorskip("tract")
        refused = check_target(training, "tract")
        assert not refused.ok
        assert any(line.startswith("tract lacks com.microsoft.GroupQueryAttention: needed by node "
                                   "'/model/layers.0/attn/GroupQueryAttention'") and "MISSING" in line
                   for line in refused.lines), refused.lines


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


def test_text_past_the_vocabulary_is_refused(builder_models):
    """Token ids the model's embedding does not have (a tokenizer that is not the model's) are named, not
    left to fail inside onnxruntime's Gather."""
    from onnx_autodiff.driver.text import pack
    from onnx_autodiff.errors import DataError

    model = make_training_model(str(builder_models.get("llama", "int4")), "causal_lm", "adamw",
                                lora={"rank": 4, "targets": ["attention"]})
    with pytest.raises(DataError, match="reach 1000, past the model's vocabulary of 1000"):
        TrainingSession(model).fit(pack([[1, 5, 1000, 2]], seq_len=4, pad=0), batch_size=1, progress=False)
