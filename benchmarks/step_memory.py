"""RSS through a training step, split into its gradient and update halves (the issue 21 memory profile).

    python -m benchmarks.step_memory MODEL.onnx [--path docs|proto|lean] [--steps 3] [--batch 8 --seq 64]

Builds the training model of MODEL.onnx (token ids ``x`` [batch, seq] -> logits, cross entropy, Adam)
the way ``--path`` says (``docs``: ``make_training_model(path)``; ``proto``: from ``onnx.load``; ``lean``:
the carrier itself, ``open_model`` + ``build_training_model``, as the CLI's ``train`` opens a model), opens a
``TrainingSession`` and prints VmRSS / VmHWM and RssFile
after each stage and after every ``step`` (with ``--halves``: after each half, ``gradients`` and
``apply_gradients``, which allocate new gradients where ``step`` reuses one buffer per parameter).
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def memory() -> str:
    d = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:", "RssFile:")):
                d[line.split(":")[0]] = int(line.split()[1]) / 1024
    return f"rss {d['VmRSS']:.0f} MB (file {d['RssFile']:.0f}), peak {d['VmHWM']:.0f} MB"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--path", choices=("docs", "proto", "lean"), default="docs")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=30522)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--halves", action="store_true", help="run each step as gradients() + apply_gradients()")
    opts = ap.parse_args(argv)

    import onnx
    import onnxruntime as ort

    from onnx_autodiff import TrainingSession, make_training_model
    from onnx_autodiff.model.carrier import open_model
    from onnx_autodiff.training import build_training_model

    print("imports:", memory(), flush=True)
    t = time.perf_counter()
    if opts.path == "lean":
        training = build_training_model(open_model(opts.model), "cross_entropy", "adam")
    else:
        training = make_training_model(opts.model if opts.path == "docs" else onnx.load(opts.model),
                                       "cross_entropy", "adam")
    print(f"make_training_model ({time.perf_counter() - t:.1f} s):", memory(), flush=True)
    so = ort.SessionOptions()
    so.intra_op_num_threads = opts.threads
    sess = TrainingSession(training, session_options=so, progress=False)
    print(f"TrainingSession (set-up {time.perf_counter() - t:.1f} s):", memory(), flush=True)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.integers(0, opts.vocab, (opts.batch, opts.seq)), "labels": rng.integers(0, 2, opts.batch)}
    for k in range(opts.steps):
        t = time.perf_counter()
        if not opts.halves:
            sess.step(feeds)
            print(f"step {k + 1} ({time.perf_counter() - t:.2f} s):", memory(), flush=True)
            continue
        grads = sess.gradients(feeds)
        print(f"step {k + 1} gradients ({time.perf_counter() - t:.2f} s):", memory(), flush=True)
        t = time.perf_counter()
        sess.apply_gradients(grads, feeds)
        del grads
        print(f"step {k + 1} update ({time.perf_counter() - t:.2f} s):", memory(), flush=True)

if __name__ == "__main__":
    main()
