"""RSS through a training step, split into its gradient and update halves (the issue 21 memory profile).

    python -m benchmarks.step_memory MODEL.onnx [--path docs|proto|lean] [--steps 3] [--batch 8 --seq 64]
    python -m benchmarks.step_memory tiny --steps 1      # a tiny token classifier built here, to see that it runs

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


def tiny_model(folder: str, vocab: int) -> str:
    """A token classifier small enough for a smoke run: embedding [vocab, 8], mean over the sequence, 2 logits."""
    import os

    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gather", ["emb", "x"], ["e"], axis=0),
             helper.make_node("ReduceMean", ["e"], ["m"], axes=[1], keepdims=0),
             helper.make_node("Gemm", ["m", "w", "b"], ["logits"])]
    inits = [numpy_helper.from_array(rng.standard_normal((vocab, 8)).astype(np.float32), "emb"),
             numpy_helper.from_array(rng.standard_normal((8, 2)).astype(np.float32), "w"),
             numpy_helper.from_array(np.zeros(2, np.float32), "b")]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.INT64, ["N", "S"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 2])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = os.path.join(folder, "tiny.onnx")
    onnx.save(model, path)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="the .onnx file (token ids x [batch, seq] -> logits [batch, 2]), or 'tiny': a tiny "
                    "one built in a temporary folder (its vocabulary is --vocab, at most 1000)")
    ap.add_argument("--path", choices=("docs", "proto", "lean"), default="docs",
                    help="how the training model is built (module docstring)")
    ap.add_argument("--steps", type=int, default=3, help="training steps")
    ap.add_argument("--batch", type=int, default=8, help="sequences per batch")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--vocab", type=int, default=30522, help="token ids are drawn below this")
    ap.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads")
    ap.add_argument("--halves", action="store_true", help="run each step as gradients() + apply_gradients()")
    opts = ap.parse_args(argv)
    if opts.model == "tiny":
        import tempfile

        with tempfile.TemporaryDirectory(prefix="step-memory-") as folder:
            opts.vocab = min(opts.vocab, 1000)
            opts.model = tiny_model(folder, opts.vocab)
            run(opts)
    else:
        run(opts)


def run(opts) -> None:
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
