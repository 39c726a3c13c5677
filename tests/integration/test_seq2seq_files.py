"""The encoder and decoder files Optimum and transformers.js export of Whisper and BART (GELU through Erf), built from
tiny random configs with torch.onnx (TorchScript, opset 17, Optimum's input and output names and dynamic axes): LoRA
steps train with a falling loss and ``onnx-autodiff check FILE`` exits 0 on each file as exported. Before the float64
Erf reference (issue 37), check said "disagrees" on all three (Whisper's decoder 2.5e-2, encoder 1.6e-2, BART's
decoder 8.5e-2) while they trained."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from onnx_autodiff import TrainingSession, make_training_model
from onnx_autodiff.cli import main

tf = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

VOCAB = 64
D = 32
MELS = 8
FRAMES = 16  # 2 * max_source_positions: Whisper's convolution halves the frames
ENCODED = 5  # the encoder states a decoder attends to


def _config(name: str):
    if not hasattr(tf, name):
        pytest.skip(f"transformers {tf.__version__} has no {name}")
    common = dict(vocab_size=VOCAB, d_model=D, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                  decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, pad_token_id=1,
                  bos_token_id=0, eos_token_id=2, decoder_start_token_id=0)
    if name == "WhisperConfig":
        return tf.WhisperConfig(**common, num_mel_bins=MELS, max_source_positions=FRAMES // 2,
                                max_target_positions=32)
    return tf.BartConfig(**common, max_position_embeddings=32, activation_function="gelu")


def _export(module, args, out: Path, inputs: list[str], output: str, axes: dict) -> Path:
    from tests.optimum_models import _quietly

    out.parent.mkdir(parents=True, exist_ok=True)
    _quietly(torch.onnx.export, module.eval(), args, str(out), input_names=inputs, output_names=[output],
             dynamic_axes=axes, opset_version=17, dynamo=False)
    return out


def _seed(model, seed: int = 0):
    torch.manual_seed(seed)
    with torch.no_grad():  # weights of std 0.2 (the configs' 0.02 leave the outputs near constant)
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if ("norm" in name or name.endswith("bias")) else 0.2)
    return model.eval()


class _Decoder(torch.nn.Module if torch else object):
    """Optimum's ``decoder_model.onnx``: input_ids, encoder_attention_mask, encoder_hidden_states -> logits."""

    def __init__(self, model, head, bias=None):
        super().__init__()
        self.decoder, self.head, self.bias = model.get_decoder(), head, bias

    def forward(self, input_ids, encoder_attention_mask, encoder_hidden_states):
        # a decoder mask of ones: without one, transformers' mask code looks for packed rows (aten::diff, which
        # TorchScript cannot export); Optimum's decoder files take none
        kw = {"attention_mask": torch.ones_like(input_ids)}
        if encoder_attention_mask is not None:
            kw["encoder_attention_mask"] = encoder_attention_mask
        hidden = self.decoder(input_ids=input_ids, encoder_hidden_states=encoder_hidden_states, use_cache=False,
                              **kw).last_hidden_state
        logits = self.head(hidden)
        return logits + self.bias if self.bias is not None else logits


def whisper_encoder(root: Path) -> tuple[Path, dict]:
    model = _seed(tf.WhisperForConditionalGeneration(_config("WhisperConfig")))
    path = _export(model.get_encoder(), (torch.randn(1, MELS, FRAMES),), root / "whisper" / "encoder_model.onnx",
                   ["input_features"], "last_hidden_state",
                   {"input_features": {0: "batch_size"}, "last_hidden_state": {0: "batch_size"}})
    rng = np.random.default_rng(0)
    feeds = {"input_features": rng.standard_normal((4, MELS, FRAMES)).astype(np.float32),
             "labels": rng.standard_normal((4, FRAMES // 2, D)).astype(np.float32)}
    return path, feeds


def _decoder_feeds(rng, with_mask: bool) -> dict:
    ids = rng.integers(3, VOCAB, (4, 6))
    # causal_lm's labels are the ids, shifted: no feed of their own
    feeds = {"input_ids": ids, "encoder_hidden_states": rng.standard_normal((4, ENCODED, D)).astype(np.float32)}
    if with_mask:
        feeds["encoder_attention_mask"] = np.ones((4, ENCODED), np.int64)
    return feeds


def _decoder_axes(names):
    axes = {"input_ids": {0: "batch_size", 1: "decoder_sequence_length"},
            "encoder_hidden_states": {0: "batch_size", 1: "encoder_sequence_length"},
            "encoder_attention_mask": {0: "batch_size", 1: "encoder_sequence_length"},
            "logits": {0: "batch_size", 1: "decoder_sequence_length"}}
    return {n: axes[n] for n in [*names, "logits"]}


def whisper_decoder(root: Path) -> tuple[Path, dict]:
    model = _seed(tf.WhisperForConditionalGeneration(_config("WhisperConfig")))
    rng = np.random.default_rng(1)
    names = ["input_ids", "encoder_hidden_states"]

    class Wrap(torch.nn.Module):  # Whisper's decoder file takes no encoder mask
        def __init__(self):
            super().__init__()
            self.d = _Decoder(model, model.proj_out)

        def forward(self, input_ids, encoder_hidden_states):
            return self.d(input_ids, None, encoder_hidden_states)

    path = _export(Wrap(), (torch.randint(3, VOCAB, (1, 4)), torch.randn(1, ENCODED, D)),
                   root / "whisper" / "decoder_model.onnx", names, "logits", _decoder_axes(names))
    return path, _decoder_feeds(rng, with_mask=False)


def bart_decoder(root: Path) -> tuple[Path, dict]:
    model = _seed(tf.BartForConditionalGeneration(_config("BartConfig")))
    rng = np.random.default_rng(2)
    names = ["input_ids", "encoder_attention_mask", "encoder_hidden_states"]
    args = (torch.randint(3, VOCAB, (1, 4)), torch.ones(1, ENCODED, dtype=torch.int64), torch.randn(1, ENCODED, D))
    path = _export(_Decoder(model, model.lm_head, model.final_logits_bias), args, root / "bart" / "decoder_model.onnx",
                   names, "logits", _decoder_axes(names))
    return path, _decoder_feeds(rng, with_mask=True)


CASES = {  # the file, its loss, the LoRA targets (self- and cross-attention q/v, the first MLP layer)
    "whisper-encoder": (whisper_encoder, "mse", ["q_proj", "v_proj", "fc1"]),
    "whisper-decoder": (whisper_decoder, "causal_lm", ["q_proj", "v_proj", "fc1"]),
    "bart-decoder": (bart_decoder, "causal_lm", ["q_proj", "v_proj", "fc1"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_seq2seq_file_trains_and_passes_check(tmp_path, case, capsys):
    make, loss, targets = CASES[case]
    path, feeds = make(tmp_path)
    assert main(["check", str(path)]) == 0, capsys.readouterr().out
    sess = TrainingSession(make_training_model(str(path), loss, "adamw", lr=1e-2,
                                               lora={"rank": 4, "targets": targets}), progress=False)
    assert sorted(sess.feed_names) == sorted(feeds)
    losses = [float(sess.step(feeds)["loss"]) for _ in range(6)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] * 0.98, losses
