"""Tiny onnxruntime-genai model-builder folders, made offline: a random Llama, Qwen2 or Phi-3 (hidden 64, 2 layers,
4 heads / 2 kv heads, vocab 1000) from a transformers config, saved with a word-level tokenizer (``w3`` ..
``w999``), then converted by ``onnxruntime_genai.models.builder`` (``-p int4|fp32 -e cpu``) in this process.

For trying docs/llm.md's section 6 without a download, and for the tests (``tests/genai_models.py``)::

    from onnx_autodiff.testing.genai_models import build
    build("llama", "int4", "llama-int4")   # llama-int4/model.onnx, genai_config.json, tokenizer.json, ...

Needs the ``llm`` extra (onnxruntime-genai, tokenizers) and the builder's own torch and transformers
(``pip install 'onnx-autodiff[llm,torch]' transformers``); a missing one is a ``MissingExtraError``.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
from pathlib import Path

from ..errors import MissingExtraError

FAMILIES = ("llama", "qwen2", "phi3")
VOCAB = 1000


def _needs(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(f"a tiny model-builder folder needs {module.split('.')[0]}, which is not installed "
                                f"({e})", hint="pip install 'onnx-autodiff[llm,torch]' transformers") from None


def _hf_config(family: str, tie: bool):
    tf = _needs("transformers")

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=tie, initializer_range=0.2)
    if family == "llama":
        return tf.LlamaConfig(**common), tf.LlamaForCausalLM
    if family == "qwen2":
        return tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    if family == "phi3":  # max == original positions: the builder's Phi-3 mini path (no LongRoPE)
        return tf.Phi3Config(original_max_position_embeddings=256, **common), tf.Phi3ForCausalLM
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def hf_model(family: str, folder: str | os.PathLike, tie: bool = False, seed: int = 0) -> Path:
    """A random ``family`` model and a word-level tokenizer (``w3`` .. ``w999``) saved in ``folder``.
    Weights are drawn with a standard deviation of 0.2 (transformers' 0.02 gives near-uniform logits, a loss
    of ln(1000) that a model without weights would give too); biases and norm weights are drawn as well
    (transformers starts them at 0 and 1, and the builder leaves a zero bias out)."""
    torch, tf = _needs("torch"), _needs("transformers")
    tokenizers = _needs("tokenizers")
    Tokenizer, models, pre_tokenizers = tokenizers.Tokenizer, tokenizers.models, tokenizers.pre_tokenizers

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    cfg, cls = _hf_config(family, tie)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
    with contextlib.redirect_stderr(io.StringIO()):  # its progress bar
        model.save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                               unk_token="<unk>").save_pretrained(folder)
    return folder


def builder_entry_points():
    """The builder's two entry points. Importing it calls ``logging.basicConfig(level=INFO)`` (onnxruntime's
    quantizer does): the root logger's level and handlers are put back, so other tests' logs stay as they were."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        builder = _needs("onnxruntime_genai.models.builder")
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers
    return builder.create_model, builder.parse_extra_options


def build(family: str, precision: str, out: str | os.PathLike, hf: str | os.PathLike | None = None,
          **extra: str) -> Path:
    """``out/model.onnx`` made by the model builder from a random ``family`` model (built in ``hf`` or
    ``out/hf``); ``extra``: the builder's ``--extra_options`` (``fuse_qkv="false"``, ``is_symmetric="false"``,
    ``accuracy_level="1"``, ``shared_embeddings="true"`` with a tied model, ...)."""
    create_model, parse_extra_options = builder_entry_points()
    out = Path(out)
    model = out / "model.onnx"
    if model.exists():
        return model
    tie = extra.get("shared_embeddings") == "true"
    hf = hf_model(family, hf or out.parent / f"hf-{family}{'-tied' if tie else ''}", tie=tie)
    options = ["hf_token=false"] + [f"{k}={v}" for k, v in extra.items()]
    cache = out.parent / "builder-cache"
    quiet = logging.getLogger("onnxruntime.quantization")
    level, quiet.level = quiet.level, logging.WARNING
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        parsed = parse_extra_options(None, str(hf), str(out), precision, "cpu", str(cache), options)
        create_model(None, str(hf), str(out), precision, "cpu", str(cache), **parsed)
    quiet.setLevel(level)
    if not model.exists():
        raise RuntimeError(f"the model builder wrote no {model}")
    return model


__all__ = ["FAMILIES", "VOCAB", "build", "hf_model", "builder_entry_points"]
