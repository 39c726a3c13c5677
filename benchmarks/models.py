"""The benchmark models, written in plain torch (torchvision is not a dependency).

Each entry builds a module and says the shape of one input sample and the number of classes:
the loss is cross entropy on the logits, at batch 64, float32.
"""
from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                                 nn.Linear(512, 10))

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    """LeNet-sized: two conv/BN/ReLU/max-pool stages and two linear layers on 1x28x28."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        return self.head(self.features(x))


class Transformer(nn.Module):
    """One TransformerEncoderLayer (d_model 128, 4 heads, batch_first, dropout 0) and a mean-pooled head."""

    def __init__(self, d_model=128, heads=4, classes=10):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=512, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x):
        return self.head(self.layer(x).mean(dim=1))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class Bottleneck(nn.Module):
    def __init__(self, cin, mid, stride):
        super().__init__()
        cout = mid * 4
        self.conv1 = nn.Conv2d(cin, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """The ResNet layout (stem conv 7x7/2 + max-pool, four stages, global average pool, linear)."""

    def __init__(self, block, layers, widths=(64, 128, 256, 512), classes=10, stem=64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, stem, 7, 2, 3, bias=False), nn.BatchNorm2d(stem), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], stem
        for i, (n, w) in enumerate(zip(layers, widths)):
            for k in range(n):
                blocks.append(block(cin, w, 2 if (k == 0 and i > 0) else 1))
                cin = w * (4 if block is Bottleneck else 1)
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


def resnet18():
    return ResNet(BasicBlock, [2, 2, 2, 2])


def resnet18_tiny():
    """ResNet-18's graph (stem, BasicBlocks with down-sampling, pooling, head) at a size that runs in a second."""
    return ResNet(BasicBlock, [1, 1, 1, 1], widths=(8, 8, 16, 16), stem=8)


class GPT2LM(nn.Module):
    """A GPT-2 decoder with its language-model head (transformers, random weights, dropout 0, eager attention):
    ``forward(tokens [B, T]) -> next-token logits [B * T, vocab]``, flat so that cross entropy takes them as a
    classifier's (labels [B * T]: the tokens shifted by one). The head is not tied to the embedding: the
    exporter's constant folding would make a tied weight two initializers, and both sides must train the same
    parameters. An explicit all-ones mask: without one the causal-mask code calls aten::diff, which the
    TorchScript exporter cannot export."""

    def __init__(self, layers=12, d=768, heads=12, vocab=50257, positions=1024):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=layers, n_embd=d, n_head=heads, vocab_size=vocab, n_positions=positions,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
                         bos_token_id=vocab - 1, eos_token_id=vocab - 1, attn_implementation="eager")
        self.lm = GPT2LMHeadModel(cfg)
        self.vocab = vocab

    def forward(self, x):
        return self.lm(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits.reshape(-1, self.vocab)


def gpt2_small():
    """GPT-2 small's size: 12 layers, d 768, 12 heads, vocab 50257, 1024 positions (163M parameters untied)."""
    return GPT2LM()


def gpt2_tiny():
    return GPT2LM(layers=2, d=32, heads=2, vocab=97, positions=32)


def resnet50():
    return ResNet(Bottleneck, [3, 4, 6, 3])


# name -> (constructor, sample shape, classes, label)
MODELS = {
    "mlp": (MLP, (1, 28, 28), 10, "MLP 784-512-512-10"),
    "cnn": (SmallCNN, (1, 28, 28), 10, "small CNN 1x28x28"),
    "transformer": (Transformer, (64, 128), 10, "TransformerEncoderLayer d128 h4 s64"),
    "resnet18": (resnet18, (3, 64, 64), 10, "ResNet-18 3x64x64"),
}
# models only benchmarks.public_path runs, as MODELS: its smoke test's ResNet-18
PATH_ONLY = {"resnet18-tiny": (resnet18_tiny, (3, 32, 32), 10, "tiny ResNet-18 3x32x32")}
# language models (token input, next-token labels): name -> (constructor, sequence length, vocab, label)
LMS = {
    "gpt2s": (gpt2_small, 128, 50257, "GPT-2 small LM (12 x d768, vocab 50257)"),
    "gpt2s-tiny": (gpt2_tiny, 16, 97, "tiny GPT-2 LM (2 x d32, vocab 97)"),
}
# lowering-time only
RESNET50 = (resnet50, (3, 64, 64), 10, "ResNet-50-shaped (bottleneck 3,4,6,3)")


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    ctor = RESNET50[0] if name == "resnet50" else MODELS[name][0]
    return ctor()
