"""Kernel time per op type of a BERT-base-wide step with few layers: the small ops of its backward, before vs after.

    python -m benchmarks.profile_layers --layers 2 --against /work/main [--rounds 3] [--steps 2] [--threads 1]
    python -m benchmarks.profile_layers --tiny                     # a smoke run: this checkout alone, seconds

BERT-base's layer (hidden 768, 12 heads, intermediate 3072, GELU as the TorchScript exporter writes it at opset 17),
``--layers`` of them, batch 8 x 64 tokens, a vocabulary of ``--vocab`` (default 1024: the embedding's gradient is not
what this measures, and the full 30522 would triple the memory), cross-entropy and Adam on the docs' path
(``make_training_model`` -> ``lower`` -> ``build_step_model``). The model is exported once; each side (this checkout
and ``--against``) builds its step in its own process, alternating ``--rounds`` times; the table is
``benchmarks.profile``'s comparison (medians per op type and part, process CPU, load at each run).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np


def export_model(workdir: str, layers: int, vocab: int, batch: int, seq: int, tiny: bool = False) -> None:
    import onnx
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from .large_models import Logits
    from .run import export

    torch.manual_seed(0)
    width = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64, max_position_embeddings=64) if tiny \
        else {}
    cfg = BertConfig(vocab_size=vocab, num_hidden_layers=layers, num_labels=2, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, **width)
    module = Logits(BertForSequenceClassification(cfg))
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, (batch, seq)).astype(np.int64)
    np.savez(os.path.join(workdir, "data.npz"), x=x, labels=rng.integers(0, 2, batch).astype(np.int64))
    onnx.save(export(module, torch.from_numpy(x), constant_folding=False, dynamic_batch=True),
              os.path.join(workdir, "model.onnx"))


def worker(workdir: str, code: str, threads: int, steps: int) -> None:
    sys.path.insert(0, os.path.abspath(code))
    import onnx

    import onnx_autodiff
    from onnx_autodiff import build_step_model, lower, make_training_model

    from .profile import aggregate, profile

    training = make_training_model(onnx.load(os.path.join(workdir, "model.onnx")), loss="cross_entropy",
                                   optimizer="adam", lr=1e-4)
    step = build_step_model(lower(training))
    with np.load(os.path.join(workdir, "data.npz")) as f:
        feeds = {"x": f["x"], "labels": f["labels"]}
    kernels, wall, cpu = profile(step, feeds, threads, steps)
    print(json.dumps(dict(aggregate(kernels, steps), wall=wall, cpu=cpu, load=os.getloadavg()[0],
                          code=os.path.dirname(os.path.dirname(onnx_autodiff.__file__)))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--against", metavar="DIR", required=False, help="the checkout to compare with (its onnx_autodiff)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--match", action="append", default=[], metavar="TEXT",
                   help="also print the backward kernel time of the forward nodes whose name holds TEXT (repeatable)")
    p.add_argument("--tiny", action="store_true", help="hidden 32, 1 layer, vocab 64, 2x8 tokens, 1 round of 1 step")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--code", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.code, args.threads, args.steps)
        return 0
    from .profile import comparison_table

    if args.tiny:
        args.layers, args.vocab, args.batch, args.seq, args.rounds, args.steps = 1, 64, 2, 8, 1, 1

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sides = [("before", args.against), ("after", here)] if args.against else [("after", here)]
    runs = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="oa-layers-") as workdir:
        export_model(workdir, args.layers, args.vocab, args.batch, args.seq, args.tiny)
        for _ in range(args.rounds):
            for side, code in sides:
                cmd = [sys.executable, "-m", "benchmarks.profile_layers", "--worker", workdir, "--code", code,
                       "--threads", str(args.threads), "--steps", str(args.steps)]
                out = subprocess.run(cmd, cwd=here, capture_output=True, text=True, check=True).stdout
                runs[side].append(json.loads(out.splitlines()[-1]))
    if not args.against:
        runs["before"] = runs["after"]
    before = f"; before: {args.against}" if args.against else ""
    width = "BERT (tiny width)" if args.tiny else "BERT-base width"
    print(f"{width}, {args.layers} layer(s), {args.batch}x{args.seq}, vocab {args.vocab}, Adam, "
          f"{args.threads} thread(s), {args.steps} steps per run{before}")
    print(comparison_table(runs, args.top))
    for text in args.match:
        ms = {side: [sum(v for k, v in r["grad_of"].items() if text in k) for r in runs[side]] for side in runs}
        print(f"backward of nodes named *{text}*, ms/step per run: before {ms['before']}, after {ms['after']} "
              f"(medians {np.median(ms['before']):.1f} / {np.median(ms['after']):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
