"""Samples per second of data-parallel training: 1 process against N under torchrun, same global batch.

    python -m benchmarks.distributed prepare DIR              # mlp.onnx, bert.onnx (+ .data) and their batches
    python -m benchmarks.distributed prepare DIR --models mlp # the MLP alone (seconds)
    python -m benchmarks.distributed run DIR mlp --threads 2  # one process
    torchrun --nproc-per-node 2 -m benchmarks.distributed run DIR mlp --threads 1

Each process opens a path-based ``TrainingSession`` (onnxruntime with ``--threads`` intra-op threads), runs
one untimed step, then ``--steps`` timed steps of the global batch through ``accumulate.SplitStep`` (its
slice of each batch, gradients summed with ``DataParallel.reduce``); rank 0 prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

MODELS = {"mlp": 256, "bert": 8}  # name -> global batch


def prepare(directory: str, models=tuple(MODELS)) -> None:
    import sys

    import onnx

    from onnx_autodiff.model.carrier import open_model
    from onnx_autodiff.training import build_training_model, make_training_model

    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(0)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.cli_models import mlp  # the MLP of the CLI tests: 128 -> 384 -> 10

    onnx.save(make_training_model(mlp(), "cross_entropy", "adam", lr=1e-3), os.path.join(directory, "mlp.onnx"))
    np.savez(os.path.join(directory, "mlp.npz"), x=rng.standard_normal((MODELS["mlp"], 128)).astype(np.float32),
             labels=rng.integers(0, 10, MODELS["mlp"]))
    if "bert" not in models:
        return
    import torch

    from .large_models import VOCAB, build_large
    from .run import export

    x = rng.integers(0, VOCAB["bert"], (MODELS["bert"], 64)).astype(np.int64)
    inference = export(build_large("bert"), torch.from_numpy(x), constant_folding=False, dynamic_batch=True)
    training = build_training_model(open_model(inference), "cross_entropy", "adam", lr=1e-4)
    training.save(os.path.join(directory, "bert.onnx"))  # streamed: the 440 MB never sit in one protobuf
    np.savez(os.path.join(directory, "bert.npz"), x=x, labels=rng.integers(0, 2, MODELS["bert"]))


def run(directory: str, name: str, steps: int, threads: int) -> None:
    import onnxruntime as ort

    from onnx_autodiff.driver.accumulate import SplitStep
    from onnx_autodiff.driver.distributed import DataParallel
    from onnx_autodiff.driver.session import TrainingSession

    group = DataParallel.from_environment(timeout=1800)
    rank, world = (group.rank, group.world) if group else (0, 1)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    start = time.perf_counter()
    sess = TrainingSession(os.path.join(directory, f"{name}.onnx"), session_options=opts, progress=False)
    with np.load(os.path.join(directory, f"{name}.npz")) as z:
        data = {k: z[k] for k in z.files}
    feeds = {"x" if "x" in sess.feed_names else sess.feed_names[0]: data["x"], "labels": data["labels"]}
    step = SplitStep(sess, list(feeds), 1, rank, world, group.reduce if group else None)
    setup = time.perf_counter() - start
    step.step(feeds)
    start = time.perf_counter()
    for _ in range(steps):
        step.step(feeds)
    took = time.perf_counter() - start
    batch = len(data["labels"])
    if rank == 0:
        print(json.dumps({"model": name, "processes": world, "threads_per_process": threads, "global_batch": batch,
                          "steps": steps, "step_s": round(took / steps, 4),
                          "samples_per_s": round(batch * steps / took, 2), "setup_s": round(setup, 1)}))
    if group:
        group.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("prepare", help="write the training models and their batches")
    s.add_argument("dir")
    s.add_argument("--models", default=",".join(MODELS),
                   help="comma-separated, of mlp (seconds) and bert (BERT-base, 440 MB, minutes); default both")
    s = sub.add_parser("run", help="time the steps of one model (under torchrun: each rank its slice)")
    s.add_argument("dir")
    s.add_argument("model", choices=sorted(MODELS))
    s.add_argument("--steps", type=int, default=20, help="timed steps, after one untimed step")
    s.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads per process")
    args = p.parse_args(argv)
    if args.command == "prepare":
        prepare(args.dir, [m for m in args.models.split(",") if m])
    else:
        run(args.dir, args.model, args.steps, args.threads)


if __name__ == "__main__":
    main()
