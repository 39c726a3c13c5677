"""Tiny random transformers models built from config objects (no downloads), their inputs, and the
two torch export routes, for tests/integration/test_transformers_export.py."""
from __future__ import annotations

import io
import logging
import os
import warnings

import onnx
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _text(n=2, t=5, vocab=64):
    # an explicit all-ones mask: without one the causal-mask code calls aten::diff (no TorchScript symbolic)
    # ids from 1: torch gives the padding_idx row (0) of an embedding no gradient, which ONNX cannot express
    return {"input_ids": torch.randint(1, vocab, (n, t)), "attention_mask": torch.ones(n, t, dtype=torch.int64)}


def build(name: str, seed: int = 0):
    """(module returning one float tensor, example inputs as a dict) for a tiny ``name`` model."""
    import transformers as tf

    torch.manual_seed(seed)
    small = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    if name == "bert":
        m, x = tf.BertModel(tf.BertConfig(vocab_size=64, max_position_embeddings=16, **small)), _text()
    elif name == "distilbert":
        m, x = tf.DistilBertModel(tf.DistilBertConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, hidden_dim=32,
                                                      max_position_embeddings=16)), _text()
    elif name == "albert":
        m, x = tf.AlbertModel(tf.AlbertConfig(vocab_size=64, embedding_size=8, max_position_embeddings=16,
                                              **small)), _text()
    elif name == "gpt2":
        m, x = tf.GPT2Model(tf.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=16)), _text()
    elif name == "llama":
        m, x = tf.LlamaModel(tf.LlamaConfig(vocab_size=64, num_key_value_heads=2, max_position_embeddings=16,
                                            **small)), _text()
    elif name == "t5":
        # eager attention: through the default sdpa path torch 2.13's dynamo exporter fails ("Cannot view a
        # tensor with shape [2, 5, 2, 8] and strides (80, 8, 40, 1) as (2, 5, 16)": a view after a transpose)
        m = tf.T5Model(tf.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                   attn_implementation="eager"))
        x = {**_text(), "decoder_input_ids": torch.randint(1, 64, (2, 4))}
    elif name == "vit":
        m = tf.ViTModel(tf.ViTConfig(image_size=16, patch_size=8, num_channels=3, **small))
        x = {"pixel_values": torch.randn(2, 3, 16, 16)}
    elif name == "convnext":
        m = tf.ConvNextModel(tf.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2,
                                                    image_size=32))
        x = {"pixel_values": torch.randn(2, 3, 32, 32)}
    elif name == "resnet":
        m = tf.ResNetModel(tf.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1]))
        x = {"pixel_values": torch.randn(2, 3, 32, 32)}
    elif name == "wav2vec2":
        m = tf.Wav2Vec2Model(tf.Wav2Vec2Config(vocab_size=32, conv_dim=[8, 8], conv_stride=[5, 2], conv_kernel=[10, 3],
                                               num_feat_extract_layers=2, num_conv_pos_embeddings=4,
                                               num_conv_pos_embedding_groups=2, **small))
        x = {"input_values": torch.randn(2, 200)}
    else:
        raise KeyError(name)
    with torch.no_grad():  # distinct values everywhere: fresh LayerNorms would all be ones
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return Wrapper(m, list(x)).eval(), x


class Wrapper(torch.nn.Module):
    """Positional inputs in a fixed order; the first output (last hidden state) as a plain tensor."""

    def __init__(self, model, names):
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *args):
        kw = dict(zip(self.names, args))
        if "input_ids" in kw or "decoder_input_ids" in kw:
            kw["use_cache"] = False
        out = self.model(**kw, return_dict=True)
        return out[0]


def export(module, inputs: dict, route: str) -> onnx.ModelProto:
    """``route``: "ts14", "ts17" (TorchScript, constant folding), "ts17-nofold", "dynamo" (its default)."""
    args = tuple(inputs.values())
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if route == "dynamo":
            logging.disable(logging.WARNING)
            try:
                prog = torch.onnx.export(module, args, dynamo=True, verbose=False)
            finally:
                logging.disable(logging.NOTSET)
            return prog.model_proto
        opset = 14 if route == "ts14" else 17
        # PRESERVE (module in eval mode) keeps BatchNormalization a node of its own; EVAL would fold it
        # into the Conv before it, and the folded weights are no parameter of the torch model
        torch.onnx.export(module, args, buf, dynamo=False, opset_version=opset, input_names=list(inputs),
                          output_names=["out"], do_constant_folding=route != "ts17-nofold",
                          training=torch.onnx.TrainingMode.PRESERVE)
    return onnx.load_from_string(buf.getvalue())
