"""PEFT export of builder models whose Hugging Face modules the builder split: Phi-3's ``mlp.gate_up_proj`` (the
builder's gate_proj and up_proj) and, with ``fuse_qkv=false``, ``self_attn.qkv_proj`` (its q_proj, k_proj, v_proj).
The adapters of the parts become one LoRA of the fused module (A stacked, B block-diagonal, rank and alpha scaled
together), so ``PeftModel.from_pretrained`` on the transformers model the builder read puts every adapter on a
module it has and computes our merged export's logits (fp32, 1e-4). A builder Llama (nothing fused in
transformers) guards the common path. Before, PEFT loaded Phi-3's adapters with no warning on o_proj and
down_proj only."""
import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest

from onnx_autodiff import TrainingSession
from onnx_autodiff.cli import main
from onnx_autodiff.errors import AdapterError
from onnx_autodiff.training.lora.adapters import export_adapter

pytest.importorskip("onnxruntime_genai")
peft = pytest.importorskip("peft")
PROMPT = [1, 5, 9, 33, 7, 101, 400, 12]


def _trained(path, tmp_path, targets, steps=3):
    """As people do it: the builder folder copied beside the training model, trained from the file, a checkpoint
    in ckpt/; returns the session and the training model's path."""
    folder = tmp_path / "builder"
    shutil.copytree(path.parent, folder)
    training = tmp_path / "training.onnx"
    assert main(["make-training", str(folder / "model.onnx"), str(training), "--loss", "causal_lm", "--optimizer",
                 "adamw", "--lr", "1e-2", "--lora-rank", "4", "--lora-alpha", "8",
                 "--lora-targets", ",".join(targets)]) == 0
    sess = TrainingSession(str(training), progress=False)
    ids = np.random.default_rng(0).integers(3, 1000, (4, 16))
    losses = [float(sess.step({"input_ids": ids, "attention_mask": np.ones_like(ids)})["loss"]) for _ in range(steps)]
    assert losses[-1] < losses[0]
    (tmp_path / "ckpt").mkdir()
    sess.save(str(tmp_path / "ckpt" / "checkpoint.onnx"))
    return sess, training


def _merged_logits(sess, tmp_path) -> np.ndarray:
    sess.export_inference(str(tmp_path / "merged.onnx"))
    s = ort.InferenceSession(str(tmp_path / "merged.onnx"), providers=["CPUExecutionProvider"])
    ids = np.array([PROMPT], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in s.get_inputs():
        if i.name.startswith("past_key_values."):
            feeds[i.name] = np.zeros((1, 2, 0, 16), np.float32)  # 2 kv heads of 16
    return s.run(["logits"], feeds)[0]


def _peft_logits(hf_folder, adapter_dir, cls_name):
    import torch
    import transformers

    base = getattr(transformers, cls_name).from_pretrained(str(hf_folder)).eval()
    model = base if adapter_dir is None else peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    loaded = {k for k in model.state_dict() if ".lora_" in k}
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT])).logits.numpy()
    return logits, loaded


@pytest.mark.parametrize("family,extra,targets,fused", [
    ("phi3", {}, ["all"], ["gate_up_proj"]),
    ("phi3", {"fuse_qkv": "false"}, ["gate_up_proj", "qkv_proj", "o_proj"], ["gate_up_proj", "qkv_proj"]),
    ("phi3", {"fuse_qkv": "false"}, ["up_proj", "q_proj", "k_proj", "v_proj"], ["qkv_proj"]),
    ("llama", {"fuse_qkv": "false"}, ["all"], []),
])
def test_peft_puts_every_adapter_on_the_transformers_model(builder_models, tmp_path, family, extra, targets, fused):
    from safetensors.numpy import load_file

    sess, training = _trained(builder_models.get(family, "fp32", **extra), tmp_path, targets)
    assert main(["export-adapter", str(tmp_path / "ckpt" / "checkpoint.onnx"), str(tmp_path / "peft"),
                 "--format", "peft", "--base", str(training)]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    parts = {"gate_up_proj": {"gate_proj", "up_proj"}, "qkv_proj": {"q_proj", "k_proj", "v_proj"}}
    for name in fused:
        assert name in config["target_modules"] and not parts[name] & set(config["target_modules"])
    written = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    ours, loaded = _peft_logits(builder_models.hf(family), tmp_path / "peft",
                                "Phi3ForCausalLM" if family == "phi3" else "LlamaForCausalLM")
    keys = {k.replace("base_model.model.", "").replace(".weight", "") for k in written}
    assert keys == {k.replace("base_model.model.", "").replace(".default.weight", "") for k in loaded}  # none lost
    merged = _merged_logits(sess, tmp_path)
    assert np.abs(ours - merged).max() <= 1e-4
    base, _ = _peft_logits(builder_models.hf(family), None, "Phi3ForCausalLM" if family == "phi3" else
                           "LlamaForCausalLM")
    assert np.abs(base - merged).max() > 1e-2  # the fine-tune moved the logits: the comparison can fail


def test_a_fused_qkv_with_a_part_missing_and_no_heads_is_refused():
    from onnx_autodiff.training.lora.adapters import peft_tensors

    layer = {"module": "model.layers.0.attn.q_proj", "weight": "model.layers.0.attn.q_proj.MatMul.weight",
             "lora_A": "a", "lora_B": "b", "n_out": 64, "output": "q"}
    record = {"rank": 2, "alpha": 4, "dropout": 0.0, "layers": [layer]}
    with pytest.raises(AdapterError, match=r"'model.layers.0.self_attn.qkv_proj'.*\['q_proj'\]"):
        peft_tensors(record, {"a": np.zeros((2, 8)), "b": np.zeros((64, 2))}, family="phi3")


def test_export_adapter_api_matches_the_cli(builder_models, tmp_path):
    _, training = _trained(builder_models.get("phi3", "fp32"), tmp_path, ["mlp"], steps=2)
    export_adapter(str(tmp_path / "ckpt" / "checkpoint.onnx"), str(tmp_path / "api"), format="peft", base=str(training))
    config = json.loads((tmp_path / "api" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert set(config["rank_pattern"].values()) == {8} and set(config["alpha_pattern"].values()) == {16}
