"""Real-size benchmark models: BERT-base, GPT-2 small (transformers, random weights) and ResNet-50.

Each is built from a config with a fixed seed (no downloads: ``HF_HUB_OFFLINE=1``), dropout 0 so the
exported eval graph and torch's ``train()`` compute the same function, and wrapped so that
``forward(x)`` returns the logits alone. Entries say the input (shape without batch, dtype, value
range), the classes, the batch, the optimizer and learning rate, and a label.
"""
from __future__ import annotations

import os

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VOCAB = {"bert": 30522, "gpt2": 50257, "bert-tiny": 128}
SEQ = 64


class Logits(nn.Module):
    """A transformers sequence classifier with ``forward(input_ids) -> logits``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(input_ids=x).logits


class GPT2Classifier(nn.Module):
    """GPT-2 small (12 layers, d 768) with a mean-pooled linear head: a classification head without the
    last-non-pad-token lookup of ``GPT2ForSequenceClassification``, so the batch needs no pad token."""

    def __init__(self, classes: int = 2):
        super().__init__()
        from transformers import GPT2Config, GPT2Model

        cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.body = GPT2Model(cfg)
        self.head = nn.Linear(cfg.n_embd, classes)

    def forward(self, x):
        return self.head(self.body(input_ids=x).last_hidden_state.mean(dim=1))


def bert_base(classes: int = 2) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(num_labels=classes, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return Logits(BertForSequenceClassification(cfg))


def bert_tiny(classes: int = 2) -> nn.Module:
    """BERT's graph at a size that runs in seconds (2 layers, hidden 32, 2 heads): the benchmarks' smoke runs."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=VOCAB["bert-tiny"], hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, num_labels=classes, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return Logits(BertForSequenceClassification(cfg))


def resnet50_imagenet() -> nn.Module:
    from .models import Bottleneck, ResNet

    return ResNet(Bottleneck, [3, 4, 6, 3], classes=1000)


# name -> (constructor, sample shape, input kind, classes, batch, optimizer, lr, label)
LARGE = {
    "bert": (bert_base, (SEQ,), "tokens", 2, 8, "adam", 1e-4, "BERT-base 8x64 tokens, Adam"),
    "gpt2": (GPT2Classifier, (SEQ,), "tokens", 2, 8, "adam", 1e-4, "GPT-2 small 8x64 tokens, Adam"),
    "bert-tiny": (bert_tiny, (16,), "tokens", 2, 4, "adam", 1e-4, "tiny BERT (2 layers, d 32) 4x16 tokens, Adam"),
    "resnet50": (resnet50_imagenet, (3, 224, 224), "image", 1000, 8, "adam", 1e-4, "ResNet-50 8x3x224x224, Adam"),
}


def build_large(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return LARGE[name][0]()
