"""Real onnxruntime-genai model-builder output for tests: tiny random Llama, Qwen2 and Phi-3 (hidden 64,
2 layers, 4 heads / 2 kv heads, vocab 1000) made with transformers from a config (no downloads), saved with
a word-level tokenizer, then converted by ``onnxruntime_genai.models.builder`` (``-p int4|fp32 -e cpu``):
``onnx_autodiff.testing.genai_models``, which ships in the package (docs/llm.md's section 6 uses it).

The builder runs in this process (its import is about 3 s, each conversion well under a second); each
model is built once per test session under the session's temporary directory. ``build`` is usable without
pytest (``python -m tests.genai_models OUT``)."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from onnx_autodiff.testing.genai_models import (  # noqa: E402, F401 - the tests' names
    FAMILIES,
    VOCAB,
    build,
    builder_entry_points,
    hf_model,
)


class BuilderModels:
    """Builder models made on first request and kept for the session: ``get("llama", "int4")`` ->
    the path of its ``model.onnx`` (the folder holds ``model.onnx.data``, ``genai_config.json`` and the
    tokenizer)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def get(self, family: str, precision: str, **extra: str) -> Path:
        tag = "-".join([family, precision] + [f"{k}={v}" for k, v in sorted(extra.items())])
        return build(family, precision, self.root / tag, hf=None, **extra)

    def hf(self, family: str, tie: bool = False) -> Path:
        """The folder of the Hugging Face model the builder models of ``family`` are made from."""
        return hf_model(family, self.root / f"hf-{family}{'-tied' if tie else ''}", tie=tie)


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "genai-models")
    for fam in FAMILIES:
        for prec in ("int4", "fp32"):
            print(BuilderModels(root).get(fam, prec))


# ---- Gemma2 / Gemma3: softcapped and sliding-window attention (GroupQueryAttention softcap, local_window_size) ----

GEMMA_FAMILIES = ("gemma2", "gemma3")


def gemma_build(family: str, precision: str, root: Path, **extra: str) -> Path:
    """``root/<family>-<precision>/model.onnx``: the model builder's conversion of a random tiny ``family`` model
    (hidden 64, 2 layers, 4 heads / 2 kv heads of 16, vocab 1000) whose sliding window (4 tokens) is shorter than
    the tests' sequences; Gemma2 with its attention softcap 50.0 and final logit softcap 30.0, Gemma3 with local and
    global layers alternating. The 0.18 builder reads Gemma3's ``rope_parameters["rope_type"]``, which transformers
    5 nests per layer type (given at the top as well), and ``rope_local_base_freq`` (``_gemma3_local_theta``).
    ``extra``: the builder's ``--extra_options``; without any, the local layers keep a window-sized KV cache
    (GroupQueryAttention ``sliding_window_cache=1``, past ``[batch, kv heads, past_sliding_length, head]``);
    ``windowed_kv_cache="false"``: their KV cache as long as the global ones', no ``sliding_window_cache``."""
    import torch
    import transformers as tf

    root = Path(root)
    out = root / "-".join([family, precision] + [f"{k}={v}" for k, v in sorted(extra.items())])
    if (out / "model.onnx").exists():
        return out / "model.onnx"
    hf = root / f"hf-{family}"
    if not (hf / "config.json").exists():
        common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2, sliding_window=4)
        if family == "gemma2":
            cfg, cls = tf.Gemma2Config(attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **common), \
                tf.Gemma2ForCausalLM
        elif family == "gemma3":
            cfg, cls = tf.Gemma3TextConfig(sliding_window_pattern=2, **common), tf.Gemma3ForCausalLM
        else:
            raise ValueError(f"unknown family {family!r}; one of {GEMMA_FAMILIES}")
        torch.manual_seed(0)
        with contextlib.redirect_stderr(io.StringIO()):
            cls(cfg).save_pretrained(hf)
        if family == "gemma3":
            config = json.loads((hf / "config.json").read_text())
            config["rope_parameters"]["rope_type"] = "default"
            (hf / "config.json").write_text(json.dumps(config, indent=2))
    create_model, parse_extra_options = builder_entry_points()
    quiet = logging.getLogger("onnxruntime.quantization")
    level, quiet.level = quiet.level, logging.WARNING
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            _gemma3_local_theta(tf):
        parsed = parse_extra_options(None, str(hf), str(out), precision, "cpu", str(root / "builder-cache"),
                                     ["hf_token=false"] + [f"{k}={v}" for k, v in extra.items()])
        create_model(None, str(hf), str(out), precision, "cpu", str(root / "builder-cache"), **parsed)
    quiet.setLevel(level)
    if not (out / "model.onnx").exists():
        raise RuntimeError(f"the model builder wrote no {out / 'model.onnx'}")
    return out / "model.onnx"


@contextlib.contextmanager
def _gemma3_local_theta(tf):
    """The 0.18 builder reads Gemma3's ``config.rope_local_base_freq``, which transformers 5 keeps in
    ``rope_parameters["sliding_attention"]`` (and refuses as an attribute): given for the build, then taken away."""
    cls = tf.Gemma3TextConfig
    cls.rope_local_base_freq = property(lambda self: self.rope_parameters["sliding_attention"]["rope_theta"])
    try:
        yield
    finally:
        del cls.rope_local_base_freq
