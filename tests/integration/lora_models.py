"""Tiny random-weight decoders (transformers' Llama and Qwen2, 2 layers, hidden 64) exported to ONNX, for
the LoRA and causal-LM tests and docs/llm.md. Nothing is downloaded: the models are built from configs."""
from __future__ import annotations

import warnings

import onnx
import torch

VOCAB = 128


def _config(kind: str):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[kind]
    return cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")


def causal_lm(kind: str, dtype=torch.float64, seed: int = 0):
    """A transformers causal LM whose forward returns only the logits (so the exporter's module paths are the
    model's own: ``model.layers.0.self_attn.q_proj``)."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    base = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}[kind]

    class LogitsOnly(base):
        def forward(self, input_ids, attention_mask=None, labels=None, **kw):
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                                  use_cache=False, **kw)
            return out if labels is not None else out.logits

    torch.manual_seed(seed)
    return LogitsOnly(_config(kind)).to(dtype).eval()


def export_dynamo(model, path: str, seq: int = 8) -> onnx.ModelProto:
    ids = torch.randint(0, VOCAB, (2, seq))
    mask = torch.ones(2, seq, dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.onnx.export(model, (ids, mask), dynamo=True, input_names=["input_ids", "attention_mask"],
                               output_names=["logits"], dynamic_shapes=({0: "B", 1: "S"}, {0: "B", 1: "S"}),
                               verbose=False)
    ep.save(path)
    return onnx.load(path)


def export_torchscript(model, path: str, seq: int = 8) -> onnx.ModelProto:
    """The TorchScript exporter (opset 17): weights ``onnx::MatMul_N`` (transposed), module paths only in the
    node names (``/model/layers.0/self_attn/q_proj/MatMul``)."""
    ids = torch.randint(0, VOCAB, (2, seq))
    mask = torch.ones(2, seq, dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (ids, mask), path, dynamo=False, opset_version=17,
                          input_names=["input_ids", "attention_mask"], output_names=["logits"],
                          dynamic_axes={"input_ids": {0: "B", 1: "S"}, "attention_mask": {0: "B", 1: "S"}})
    return onnx.load(path)
