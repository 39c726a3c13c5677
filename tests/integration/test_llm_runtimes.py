"""Tiny GPT-2 (TorchScript through a wrapper, and dynamo), Llama and Phi-3 (transformers, random weights, hidden 64,
2 layers) with LoRA on the attention projections and ``causal_lm``: ``check --target R`` says each trains on
onnx.reference, OpenVINO, tract and onnxruntime-node, and then its step bundle for R trains there within 1e-4 of
``TrainingSession`` (loss of each step, every state tensor after them). Issue 29: ``check --target openvino`` said
fine, then training failed (NegativeLogLikelihoodLoss with ignore_index; reduction axes computed at run time).

Slow (six exports, then 24 checks and trainings: about 2 minutes on 2 busy cores); .ci/run runs it.
"""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from onnx_autodiff import TrainingSession  # noqa: E402
from onnx_autodiff.driver.bundle import export_step  # noqa: E402
from onnx_autodiff.runtimes import BundleTrainer  # noqa: E402
from onnx_autodiff.runtimes.check import check_target  # noqa: E402
from onnx_autodiff.training import LossSpec, OptimizerSpec, make_training_model  # noqa: E402
from tests.integration.test_runtimes import rel  # noqa: E402
from tests.js_runtime import read_result, train_bundles, write_batches  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB, STEPS, LR, RTOL = 128, 2, 1e-2, 1e-4
LORA = {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": ["attention"]}
MODELS = ["gpt2-torchscript", "gpt2-dynamo", "llama-torchscript", "llama-dynamo", "phi3-torchscript", "phi3-dynamo"]
RUNTIMES = ["reference", "openvino", "tract", "onnxruntime-node"]


def _decoder(kind: str):
    import transformers as tf

    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
    if kind == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                 attn_implementation="eager"))
    elif kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**small))
    else:
        model = tf.Phi3ForCausalLM(tf.Phi3Config(original_max_position_embeddings=64, pad_token_id=0, **small))
    return model.float().eval()


class Logits(torch.nn.Module):
    """The wrapper a user writes for the TorchScript exporter: positional inputs, the logits out."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def export(name: str, path) -> onnx.ModelProto:
    kind, route = name.split("-")
    module = Logits(_decoder(kind))
    args = (torch.randint(0, VOCAB, (2, 8)), torch.ones(2, 8, dtype=torch.int64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if route == "dynamo":
            torch.onnx.export(module, args, dynamo=True, input_names=["input_ids", "attention_mask"],
                              output_names=["logits"], dynamic_shapes=({0: "B", 1: "S"}, {0: "B", 1: "S"}),
                              verbose=False).save(str(path))
        else:
            torch.onnx.export(module, args, str(path), dynamo=False, opset_version=17,
                              input_names=["input_ids", "attention_mask"], output_names=["logits"],
                              dynamic_axes={"input_ids": {0: "B", 1: "S"}, "attention_mask": {0: "B", 1: "S"}})
    return onnx.load(str(path))


def _batches() -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        mask = np.ones((2, 8), np.int64)
        mask[1, 6:] = 0  # a padded row: ignored labels
        out.append({"input_ids": rng.integers(0, VOCAB, (2, 8)), "attention_mask": mask})
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """name -> (training model, TrainingSession's losses and state after the steps), built on first use."""
    built = {}

    def get(name):
        if name not in built:
            work = tmp_path_factory.mktemp(name)
            training = make_training_model(export(name, work / "model.onnx"),
                                           LossSpec("causal_lm", options={"mask": "attention_mask"}),
                                           OptimizerSpec("adamw", {"weight_decay": 0.01}), lr=LR, lora=LORA)
            rng = np.random.default_rng(1)
            for t in training.graph.initializer:  # B off zero (as test_lora_runtimes.py): A's gradients are not ~0
                if t.name.endswith(".lora_B"):
                    b = (rng.standard_normal(tuple(t.dims)) * 0.1).astype(np.float32)
                    t.CopyFrom(onnx.numpy_helper.from_array(b, t.name))
            sess = TrainingSession(training, progress=False)
            losses = [float(np.asarray(sess.step(b)[sess.loss_name]).reshape(-1)[0]) for b in _batches()]
            built[name] = training, losses, {k: np.asarray(sess.state[k]) for k in sess.state}, work
        return built[name]
    return get


def _installed(runtime: str) -> None:
    if runtime == "onnxruntime-node":
        from tests.js_runtime import node

        node()
    else:
        pytest.importorskip({"reference": "onnx", "openvino": "openvino", "tract": "tract"}[runtime])


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("name", MODELS)
def test_check_says_it_trains_and_it_trains(cases, name, runtime, tmp_path):
    _installed(runtime)
    training, ref_losses, ref_state, _ = cases(name)
    result = check_target(training, runtime)
    print(f"\ncheck --target {runtime} {name}:\n  " + "\n  ".join(result.lines))
    assert result.ok, "\n".join(result.lines)
    bundle = tmp_path / "bundle"
    export_step(training, bundle, target=runtime)
    if runtime == "onnxruntime-node":
        write_batches(tmp_path / "batches", _batches(), {"learning_rate": [LR] * STEPS})
        train_bundles("node", [{"bundle": str(bundle), "batches": str(tmp_path / "batches"),
                                "out": str(tmp_path / "node.json")}])
        losses, state = read_result(tmp_path / "node.json")
    else:
        trainer = BundleTrainer(bundle, runtime)
        losses = [trainer.step(b) for b in _batches()]
        state = trainer.state
    loss_err = max(rel(a, b) for a, b in zip(losses, ref_losses))
    errs = {k: rel(state[k], ref_state[k]) for k in ref_state}
    worst = max(errs, key=errs.get)
    print(f"LLM PARITY {name} {runtime}: loss {loss_err:.1e}, state {errs[worst]:.1e} ({worst})")
    assert loss_err <= RTOL and errs[worst] <= RTOL, (losses, ref_losses, worst, errs[worst])
