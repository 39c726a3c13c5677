"""A LoRA fine-tune of an onnxruntime-genai builder model served where people run it: onnxruntime-genai
itself (``export-adapter --format genai``: an adapter-ready copy of the folder + ``adapter.onnx_adapter``)
and PEFT (a packed qkv_proj split into q/k/v). Also PEFT parity of the training step on the fp32 builder
Llama with separate q/k/v: loss within 1e-5 and adapter gradients within 1e-4 of transformers + PEFT from
the same adapter values (the Hugging Face model the builder model was made from).

Tolerances. fp32, and int4 at accuracy_level 1 (the kernel multiplies in float): genai's logits with the
adapter equal our merged export's within 1e-4 (float32 sums in another order; measured <= 9e-6). int4 at
accuracy_level 4 (the builder's default): MatMulNBits rounds its input to int8 per block, where the merged
export multiplies dequant(W) + B A in float, so the two differ by that rounding. There genai's logits equal
onnxruntime's own run of the adapter-ready model with the same adapter (1e-5: the same kernels), and differ
from the merged export's by at most twice what the rounding does to the base model on the same prompt
(its logits against the float product's; measured: 0.160 against 0.163 for the tiny Llama)."""
import json
import os
import shutil
import warnings

import numpy as np
import onnxruntime as ort
import pytest

from onnx_autodiff import TrainingSession, make_training_model
from onnx_autodiff.cli import main
from onnx_autodiff.driver.session import gradient_names
from onnx_autodiff.ort_options import session_options
from onnx_autodiff.training.lora import lora_record
from onnx_autodiff.training.lora.adapters import export_adapter, peft_names

og = pytest.importorskip("onnxruntime_genai")

PROMPT = [1, 5, 9, 33, 7, 101, 400, 12]


def trained(path, tmp_path, targets=("all",), steps=5):
    """A LoRA training model of ``path`` after ``steps`` AdamW steps, and its checkpoint's path."""
    model = make_training_model(str(path), "causal_lm", "adamw", lr=1e-2, lora={"rank": 4, "targets": list(targets)})
    sess = TrainingSession(model)
    ids = np.random.default_rng(0).integers(3, 1000, (4, 16))
    for _ in range(steps):
        sess.step({"input_ids": ids, "attention_mask": np.ones_like(ids)})
    sess.save(tmp_path / "checkpoint.onnx")
    return sess, tmp_path / "checkpoint.onnx"


def feeds(prompt=PROMPT):
    out = {"input_ids": np.array([prompt]), "attention_mask": np.ones((1, len(prompt)), np.int64)}
    for layer in range(2):
        for kv in ("key", "value"):
            out[f"past_key_values.{layer}.{kv}"] = np.zeros((1, 2, 0, 16), np.float32)
    return out


def ort_logits(path, adapter=None) -> np.ndarray:
    sess = ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])
    options = None
    if adapter is not None:
        options = ort.RunOptions()
        lora = ort.LoraAdapter()
        lora.Load(str(adapter))
        options.add_active_adapter(lora)
    return sess.run(["logits"], feeds(), options)[0]


def generate(folder, adapter: str | None = None, new: int = 16):
    """(tokens, logits of the prompt) of greedy generation by onnxruntime-genai, with ``adapter`` active."""
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(PROMPT) + new, do_sample=False)
    gen = og.Generator(model, params)
    if adapter is not None:
        adapters = og.Adapters(model)
        adapters.load(adapter, "fine-tune")
        gen.set_active_adapter(adapters, "fine-tune")
    gen.append_tokens([PROMPT])
    logits = gen.get_output("logits")
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)], logits


@pytest.mark.parametrize("precision,extra", [("fp32", {}), ("int4", {"accuracy_level": "1"}), ("int4", {})],
                         ids=["fp32", "int4-level1", "int4-level4"])
def test_genai_generates_with_the_exported_adapter(builder_models, tmp_path, precision, extra, capsys):
    path = builder_models.get("llama", precision, **extra)
    sess, checkpoint = trained(path, tmp_path)
    ready = tmp_path / "ready"
    assert main(["export-adapter", str(checkpoint), str(ready), "--format", "genai", "--genai-folder",
                 str(path.parent)]) == 0
    assert "og.Adapters" in capsys.readouterr().out
    assert sorted(os.listdir(ready)) == ["adapter.onnx_adapter", "genai_config.json", "model.onnx",
                                         "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((ready / "genai_config.json").read_text()) == json.loads(
        (path.parent / "genai_config.json").read_text())
    sess.export_inference(tmp_path / "merged.onnx")
    merged = ort_logits(tmp_path / "merged.onnx")

    tuned, tuned_logits = generate(ready, str(ready / "adapter.onnx_adapter"))
    plain, plain_logits = generate(ready)
    original, original_logits = generate(path.parent)
    assert plain == original  # no adapter active: the original model
    assert np.abs(plain_logits - original_logits).max() <= 1e-5
    assert tuned != original
    err = float(np.abs(tuned_logits - merged).max())
    if precision == "fp32" or extra:  # the product in float on both sides
        assert err <= 1e-4, err
        return
    ours = ort_logits(ready / "model.onnx", ready / "adapter.onnx_adapter")
    assert np.abs(tuned_logits - ours).max() <= 1e-5
    fresh = TrainingSession(make_training_model(str(path), "causal_lm", "adamw", lora={"rank": 4, "targets": ["all"]}))
    fresh.export_inference(tmp_path / "base_float.onnx")  # B = 0: the base's product in float
    rounding = float(np.abs(ort_logits(path) - ort_logits(tmp_path / "base_float.onnx")).max())
    assert 0 < err <= 2 * rounding, (err, rounding)


def test_export_genai_refuses_another_base(builder_models, tmp_path, capsys):
    _, checkpoint = trained(builder_models.get("llama", "int4"), tmp_path, targets=["attention"], steps=1)
    assert main(["export-adapter", str(checkpoint), str(tmp_path / "out"), "--format", "genai", "--genai-folder",
                 str(builder_models.get("qwen2", "fp32").parent)]) == 2
    assert "not the model the adapters were trained on" in capsys.readouterr().err
    assert main(["export-adapter", str(checkpoint), str(tmp_path / "out"), "--format", "genai"]) == 2
    assert "no onnxruntime-genai folder" in capsys.readouterr().err  # the one it records is elsewhere: not read


def test_peft_loads_a_packed_qkv_adapter(builder_models, tmp_path):
    """The builder's qkv_proj becomes q_proj, k_proj, v_proj (same A, row blocks of B) and attn self_attn: PEFT
    loads every adapter with no warning and computes our merged export's logits."""
    import torch
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    sess, checkpoint = trained(builder_models.get("llama", "fp32"), tmp_path)
    export_adapter(str(checkpoint), str(tmp_path / "peft"), format="peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["fan_in_fan_out"] is False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(builder_models.hf("llama")),
                                               str(tmp_path / "peft")).eval()
    assert not [w for w in caught if "adapter" in str(w.message).lower()], [str(w.message) for w in caught]
    params = dict(peft_model.named_parameters())
    b = sess.get_state("model.layers.1.attn.qkv_proj.MatMul.weight.lora_B")
    k_rows = params["base_model.model.model.layers.1.self_attn.k_proj.lora_B.default.weight"].detach().numpy()
    np.testing.assert_array_equal(k_rows, b[64:96])  # 4 heads x 16, then 2 kv heads x 16
    sess.export_inference(tmp_path / "merged.onnx")
    with torch.no_grad():
        theirs = peft_model(input_ids=torch.tensor([PROMPT])).logits.numpy()
    assert np.abs(theirs - ort_logits(tmp_path / "merged.onnx")).max() <= 1e-4


def test_training_step_matches_peft(builder_models):
    """fp32 builder Llama with q, k, v apart (fuse_qkv=false): our loss and adapter gradients against
    transformers + PEFT on the model the builder read, from the same (random) adapter values."""
    import peft
    import torch
    from transformers import LlamaForCausalLM

    path = builder_models.get("llama", "fp32", fuse_qkv="false")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    training = make_training_model(str(path), "causal_lm", "adamw", lr=1e-2,
                                   lora={"rank": 4, "alpha": 8, "targets": targets})
    sess = TrainingSession(training)
    hf = LlamaForCausalLM.from_pretrained(builder_models.hf("llama"), attn_implementation="eager")
    adapted = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    gen = torch.Generator().manual_seed(1)
    params = dict(adapted.named_parameters())
    names = peft_names(lora_record(training), adapter="default")
    assert len(names) == 2 * 2 * len(targets)
    with torch.no_grad():
        for ours, theirs in names.items():
            if "lora_B" in theirs:
                params[theirs].copy_(torch.randn(params[theirs].shape, generator=gen) * 0.1)
            sess.set_state(ours, params[theirs].detach().numpy())
    ids = np.random.default_rng(3).integers(3, 1000, (2, 12))
    values = sess.gradients({"input_ids": ids, "attention_mask": np.ones_like(ids)})
    out = adapted(input_ids=torch.tensor(ids), labels=torch.tensor(ids))
    out.loss.backward()
    assert abs(float(values[sess.loss_name].numpy()) - out.loss.item()) <= 1e-5
    recorded = gradient_names(training, 0)
    grads = dict(zip(recorded["parameters"], recorded["gradients"]))
    for ours, theirs in names.items():
        expected = params[theirs].grad.numpy()
        assert np.abs(expected).max() > 0
        assert np.abs(values[grads[ours]].numpy() - expected).max() <= 1e-4, ours


def test_cli_from_text_to_genai(builder_models, tmp_path, capsys):
    """make-training -> train on a .jsonl (tokenized by the builder folder's tokenizer.json, found through the
    model the training model was made from, in the training model's folder) -> export-adapter --format genai
    (the folder found the same way, through the base the checkpoint's command names) -> generation."""
    path = shutil.copytree(builder_models.get("llama", "int4").parent, tmp_path / "llama-int4") / "model.onnx"
    rng = np.random.default_rng(0)
    (tmp_path / "corpus.jsonl").write_text("".join(
        json.dumps({"text": " ".join(f"w{t}" for t in rng.integers(3, 60, rng.integers(5, 30)))}) + "\n"
        for _ in range(40)))
    train = str(tmp_path / "train.onnx")
    assert main(["make-training", str(path), train, "--loss", "causal_lm", "--loss-option", "mask=attention_mask",
                 "--optimizer", "adamw", "--lr", "1e-2", "--lora-rank", "4", "--lora-targets", "all"]) == 0
    assert main(["train", train, "--data", str(tmp_path / "corpus.jsonl"), "--seq-len", "32", "--epochs", "3",
                 "--batch-size", "4", "--checkpoint", str(tmp_path / "ckpt"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"tokenizer {path.parent / 'tokenizer.json'}" in out and "40 documents" in out
    losses = [float(line.split("loss ")[1].split()[0]) for line in out.splitlines() if line.startswith("epoch ")]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5, losses
    ready = tmp_path / "ready"  # the checkpoint's base (train.onnx) is outside ckpt/: named, and with it its source
    assert main(["export-adapter", str(tmp_path / "ckpt" / "checkpoint.onnx"), str(ready), "--format", "genai",
                 "--base", train]) == 0
    tuned, _ = generate(ready, str(ready / "adapter.onnx_adapter"))
    assert tuned != generate(path.parent)[0]
