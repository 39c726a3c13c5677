"""LoRA on a tiny Llama and a tiny Qwen2 (dynamo exports, float64) against PEFT on the same weights: the
causal-LM loss and the adapters' gradients from the same adapter values, 20 AdamW steps, and the adapters
written out for PEFT and for onnxruntime's multi-LoRA serving."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

from onnx_autodiff import TrainingSession  # noqa: E402
from onnx_autodiff.cli import main  # noqa: E402
from onnx_autodiff.driver.session import gradient_names  # noqa: E402
from onnx_autodiff.training import OptimizerSpec, make_training_model  # noqa: E402
from onnx_autodiff.training.lora import lora_record  # noqa: E402
from onnx_autodiff.training.lora.adapters import peft_names  # noqa: E402
from tests.integration.lora_models import VOCAB, causal_lm, export_dynamo, export_torchscript  # noqa: E402

LORA = {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}
ADAMW = {"weight_decay": 0.01}
LR = 1e-2


def _pair(kind: str, export, tmp_path_factory):
    """(onnx model, PEFT model with random lora_B, kind): the same base weights."""
    path = str(tmp_path_factory.mktemp(kind) / "model.onnx")
    hf = causal_lm(kind)
    model = export(hf, path)
    config = peft.LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                             target_modules=LORA["targets"])
    adapted = peft.get_peft_model(hf, config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)
    return model, adapted, kind


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request, tmp_path_factory):
    return _pair(request.param, export_dynamo, tmp_path_factory)


@pytest.fixture(params=["llama", "qwen2"])
def torchscript_pair(request, tmp_path_factory):
    return _pair(request.param, export_torchscript, tmp_path_factory)


def _session(model, adapted):
    training = make_training_model(model, "causal_lm", OptimizerSpec("adamw", ADAMW), lr=LR, lora=LORA)
    sess = TrainingSession(training)
    params = dict(adapted.named_parameters())
    names = peft_names(lora_record(training), adapter="default")
    assert len(names) == 8  # 2 layers x (q, v) x (A, B)
    for ours, theirs in names.items():
        sess.state[ours] = params[theirs].detach().numpy()
    return training, sess, names


def _batch(seed: int, pad: bool = False):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, (2, 8))
    mask = np.ones((2, 8), np.int64)
    if pad:
        mask[1, 5:] = 0
    return ids, mask


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / max(np.abs(np.asarray(b)).max(), 1e-300))


def test_loss_and_adapter_gradients_match_peft(pair):
    _check_loss_and_gradients(*pair[:2])


def test_torchscript_export_matches_peft_too(torchscript_pair):
    """TorchScript names the weights onnx::MatMul_N: the module path comes from the node names."""
    _check_loss_and_gradients(*torchscript_pair[:2])


def _check_loss_and_gradients(model, adapted):
    training, sess, names = _session(model, adapted)
    ids, mask = _batch(0)
    values = sess.gradients({"input_ids": ids, "attention_mask": mask})
    adapted.zero_grad()
    out = adapted(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(ids))
    out.loss.backward()
    assert _rel(values[sess.loss_name].numpy(), out.loss.item()) < 1e-5
    grads = gradient_names(training, 0)
    params = dict(adapted.named_parameters())
    assert sorted(grads["parameters"]) == sorted(names)
    for param, grad in zip(grads["parameters"], grads["gradients"]):
        theirs = params[names[param]].grad.numpy()
        assert np.abs(theirs).max() > 0
        assert _rel(values[grad].numpy(), theirs) < 1e-5, param


def test_twenty_adamw_steps_follow_peft(pair):
    model, adapted, _ = pair
    _, sess, names = _session(model, adapted)
    params = dict(adapted.named_parameters())
    trained = [params[n] for n in names.values()]
    assert {n for n, p in adapted.named_parameters() if p.requires_grad} == set(names.values())
    start = {n: p.detach().clone() for n, p in params.items() if n in set(names.values())}
    opt = torch.optim.AdamW(trained, lr=LR, **ADAMW)
    ours, theirs = [], []
    try:
        for step in range(20):
            ids, mask = _batch(100 + step % 2)  # two batches, so the loss falls
            ours.append(float(sess.step({"input_ids": ids, "attention_mask": mask})["loss"]))
            opt.zero_grad()
            loss = adapted(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                           labels=torch.tensor(ids)).loss
            loss.backward()
            opt.step()
            theirs.append(loss.item())
        final = {n: params[n].detach().numpy().copy() for n in start}
    finally:
        with torch.no_grad():  # the module-scoped PEFT model goes back to where it started
            for n, v in start.items():
                params[n].copy_(v)
    assert ours[-1] < ours[0] - 1e-3  # it learned something
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)
    for ours_name, theirs_name in names.items():
        assert _rel(sess.state[ours_name], final[theirs_name]) < 1e-4, ours_name


def test_adapters_out_for_plain_inference_peft_and_onnxruntime(pair, tmp_path):
    """After two steps: export merges the adapters (same logits as PEFT loading our export-adapter files); the
    unmerged export with an onnxruntime .onnx_adapter active gives them too, and without it the base model."""
    model, _, kind = pair
    training = make_training_model(model, "causal_lm", OptimizerSpec("adamw", ADAMW), lr=LR, lora=LORA)
    sess = TrainingSession(training)
    for step in range(2):
        ids, mask = _batch(step)
        sess.step({"input_ids": ids, "attention_mask": mask})
    assert np.abs(sess.state[names_of(training)[1]]).max() > 0  # B moved off zero
    ckpt = str(tmp_path / "ckpt.onnx")
    sess.save(ckpt)
    merged, inputs, peft_dir, ort_dir = (str(tmp_path / n) for n in ("merged.onnx", "inputs.onnx", "peft", "ort"))
    assert main(["export", ckpt, merged]) == 0
    assert main(["export", ckpt, inputs, "--adapters", "inputs"]) == 0
    assert main(["export-adapter", ckpt, peft_dir, "--format", "peft"]) == 0
    assert main(["export-adapter", ckpt, ort_dir, "--format", "onnxruntime"]) == 0

    ids, mask = _batch(7, pad=True)
    feeds = {"input_ids": ids, "attention_mask": mask}
    ours = ort.InferenceSession(merged).run(None, feeds)[0]
    loaded = peft.PeftModel.from_pretrained(causal_lm(kind), peft_dir)
    with torch.no_grad():
        theirs = loaded(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).numpy()
        base = causal_lm(kind)(torch.tensor(ids), torch.tensor(mask)).numpy()
    assert _rel(ours, theirs) < 1e-6
    assert _rel(ours, base) > 1e-4  # the adapters changed the logits

    serving = ort.InferenceSession(inputs)
    adapter = ort.LoraAdapter()
    adapter.Load(str(tmp_path / "ort" / "adapter.onnx_adapter"))
    options = ort.RunOptions()
    options.add_active_adapter(adapter)
    assert _rel(serving.run(None, feeds, options)[0], ours) < 1e-6
    assert _rel(serving.run(None, feeds)[0], base) < 1e-6


def names_of(training):
    return [n for layer in lora_record(training)["layers"] for n in (layer["lora_A"], layer["lora_B"])]


class _FixedDropout(torch.nn.Module):
    """Dropout with a given mask (as ONNX and torch scale it: kept values / (1 - p))."""

    def __init__(self, mask: np.ndarray, p: float):
        super().__init__()
        self.scale = torch.tensor(mask, dtype=torch.float64) / (1 - p)

    def forward(self, x):
        return x * self.scale


def test_lora_dropout_gradients_match_peft_with_the_same_masks(pair, tmp_path):
    """LoRA dropout 0.3: each adapter's Dropout hands its mask out (an output added to the node and the graph);
    PEFT, its lora_dropout modules replaced by those masks, gives the same loss and adapter gradients."""
    model, adapted, _ = pair
    p = 0.3
    training = make_training_model(model, "causal_lm", OptimizerSpec("adamw", ADAMW), lr=LR,
                                   lora={**LORA, "dropout": p})
    record = lora_record(training)
    masks = {}
    for layer in record["layers"]:
        node = next(n for n in training.graph.node if n.op_type == "Dropout" and n.name in layer["nodes"])
        assert len(node.output) == 1  # the mask is the rule's own: we name it to read it
        node.output.append(f"{node.output[0]}/mask")
        masks[layer["module"]] = node.output[1]
        training.graph.output.append(onnx.helper.make_tensor_value_info(node.output[1], onnx.TensorProto.BOOL,
                                                                        ["B", "S", layer["n_in"]]))
    sess = TrainingSession(training, progress=False)
    params = dict(adapted.named_parameters())
    names = peft_names(record, adapter="default")
    for ours, theirs in names.items():
        sess.state[ours] = params[theirs].detach().numpy()
    ids, mask = _batch(0)
    values = sess.gradients({"input_ids": ids, "attention_mask": mask})
    kept = {module: values[name].numpy() for module, name in masks.items()}
    assert all(0.1 < 1 - m.mean() < 0.5 for m in kept.values())  # random masks, about p dropped
    saved = {}
    try:
        for module, m in kept.items():
            lora_module = adapted.get_submodule(f"base_model.model.{module}")
            saved[module] = lora_module.lora_dropout["default"]
            lora_module.lora_dropout["default"] = _FixedDropout(m, p)
        adapted.zero_grad()
        out = adapted(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(ids))
        out.loss.backward()
    finally:
        for module, d in saved.items():
            adapted.get_submodule(f"base_model.model.{module}").lora_dropout["default"] = d
    assert _rel(values[sess.loss_name].numpy(), out.loss.item()) < 1e-5
    grads = gradient_names(training, 0)
    for param, grad in zip(grads["parameters"], grads["gradients"]):
        theirs = params[names[param]].grad.numpy()
        assert np.abs(theirs).max() > 0
        assert _rel(values[grad].numpy(), theirs) < 1e-5, param


def test_gpt2_conv1d_adapters_load_in_peft(tmp_path):
    """GPT-2's projections are Conv1D layers ([in, out] weights): the PEFT export says fan_in_fan_out, so PEFT
    loads it without correcting the config (a warning), and gives the merged export's logits. GPT-2's forward
    takes past_key_values second: the export passes the mask as a keyword (module paths transformer.h.N...,
    no --prefix)."""
    import warnings

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                    use_cache=False)).eval()
    hf.save_pretrained(tmp_path / "base")
    ids = torch.randint(0, VOCAB, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(hf, (ids,), kwargs={"attention_mask": torch.ones_like(ids)}, dynamo=True,
                          input_names=["input_ids", "attention_mask"], output_names=["logits"],
                          dynamic_shapes={"input_ids": {0: "B", 1: "S"}, "attention_mask": {0: "B", 1: "S"}},
                          verbose=False).save(str(tmp_path / "gpt2.onnx"))
    training = make_training_model(str(tmp_path / "gpt2.onnx"), "causal_lm", "adamw", lr=1e-2,
                                   lora={"rank": 4, "targets": ["all"]})
    assert [t["module"] for t in lora_record(training)["layers"]][:2] == ["transformer.h.0.attn.c_attn",
                                                                          "transformer.h.0.attn.c_proj"]
    sess = TrainingSession(training)
    batch = {"input_ids": ids.numpy(), "attention_mask": np.ones((2, 8), np.int64)}
    for _ in range(3):
        sess.step(batch)
    sess.save(tmp_path / "ckpt.onnx")
    assert main(["export-adapter", str(tmp_path / "ckpt.onnx"), str(tmp_path / "peft")]) == 0
    sess.export_inference(tmp_path / "merged.onnx")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = peft.PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(tmp_path / "base"),
                                                    str(tmp_path / "peft")).eval()
    assert not [w for w in caught if "fan_in_fan_out" in str(w.message) or "adapter" in str(w.message).lower()]
    with torch.no_grad():
        theirs = peft_model(**{k: torch.tensor(v) for k, v in batch.items()}).logits.numpy()
    ours = ort.InferenceSession(str(tmp_path / "merged.onnx"), providers=["CPUExecutionProvider"]).run(None, batch)[0]
    assert np.abs(theirs - ours).max() < 1e-4
