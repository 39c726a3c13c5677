"""Real onnxruntime-genai model-builder output for tests: tiny random Llama, Qwen2 and Phi-3 (hidden 64,
2 layers, 4 heads / 2 kv heads, vocab 1000) made with transformers from a config (no downloads), saved with
a word-level tokenizer, then converted by ``onnxruntime_genai.models.builder`` (``-p int4|fp32 -e cpu``):
``onnx_autodiff.testing.genai_models``, which ships in the package (docs/llm.md's section 6 uses it).

The builder runs in this process (its import is about 3 s, each conversion well under a second); each
model is built once per test session under the session's temporary directory. ``build`` is usable without
pytest (``python -m tests.genai_models OUT``)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from onnx_autodiff.testing.genai_models import FAMILIES, VOCAB, build, hf_model  # noqa: E402, F401 - the tests' names


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
