"""What forward mode costs (issue 31): the JVP model against the forward, the HVP model against a gradient.

    python -m benchmarks.forward_mode [--models mlp,cnn,transformer,lstm] [--runs 30] [--threads 1] [--cpu-time]
    python -m benchmarks.forward_mode --models cnn --profile jvp    # kernel time per op type of one model

Per model (batch 64, float32, the benchmark models of benchmarks/models.py in eval mode, plus an LSTM
classifier on 28 steps of 28 features), four models built by the public API and run in stock onnxruntime:
the forward (logits), ``jvp`` of it along a random direction of every weight, the gradient of the
cross-entropy loss with respect to every weight (a Gradient node lowered by ``lower``: forward + backward,
the gradient part of a training step) and ``hvp`` of that loss with respect to every weight. Node counts,
and the median time of ``--runs`` runs of each, the four interleaved run by run so a burst of load from
elsewhere hits them alike. The load average is printed before and after.
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
import warnings

import numpy as np
import onnx
from onnx import TensorProto, helper

if __package__ in (None, ""):  # python benchmarks/forward_mode.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

BATCH = 64
TRAIN = "ai.onnx.preview.training"


def lstm_classifier():
    import torch
    from torch import nn

    class LSTMClassifier(nn.Module):
        """One LSTM layer (28 -> 128) over 28 steps, a linear head on the last hidden state."""

        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(28, 128, batch_first=True)
            self.head = nn.Linear(128, 10)

        def forward(self, x):
            _, (h, _) = self.rnn(x)
            return self.head(h[0])

    torch.manual_seed(0)
    return LSTMClassifier(), (28, 28), "LSTM 28x28 -> 128, linear head"


def models():
    from benchmarks.models import MODELS, build

    out = {name: (lambda n=name: (build(n), MODELS[n][1], MODELS[n][3])) for name in ("mlp", "cnn", "transformer")}
    out["lstm"] = lstm_classifier
    return out


def export(module, shape) -> onnx.ModelProto:
    import torch

    module.eval()
    x = torch.randn((BATCH,) + tuple(shape))
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), buf, dynamo=False, opset_version=17, input_names=["x"],
                          output_names=["logits"], training=torch.onnx.TrainingMode.EVAL, do_constant_folding=False)
    return onnx.load_from_string(buf.getvalue())


def with_loss(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its cross-entropy loss as the only output (labels an int64 input)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    g.input.append(helper.make_tensor_value_info("labels", TensorProto.INT64, [BATCH]))
    g.node.append(helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"]))
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    return m


def gradient_model(loss_model: onnx.ModelProto, wrt: list[str]) -> onnx.ModelProto:
    import onnx_autodiff as oa

    m = onnx.ModelProto()
    m.CopyFrom(loss_model)
    grads = [f"{w}.grad" for w in wrt]
    m.graph.node.append(helper.make_node("Gradient", wrt, grads, domain=TRAIN, xs=wrt, y="loss", name="grad"))
    dims = {t.name: list(t.dims) for t in m.graph.initializer}
    m.graph.output.extend(helper.make_tensor_value_info(g, TensorProto.FLOAT, dims[w]) for g, w in zip(grads, wrt))
    m.opset_import.append(helper.make_opsetid(TRAIN, 1))
    return oa.lower(m)


def build(name: str):
    """(label, {kind: (model, feeds)}, seconds to build each) for one model."""
    import onnx_autodiff as oa

    module, shape, label = models()[name]()
    fwd = export(module, shape)
    wrt = [t.name for t in fwd.graph.initializer if t.data_type == TensorProto.FLOAT]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH,) + tuple(shape)).astype(np.float32)
    labels = rng.integers(0, 10, BATCH)
    dims = {t.name: tuple(t.dims) for t in fwd.graph.initializer}
    tangents = {f"{w}.tangent": rng.standard_normal(dims[w]).astype(np.float32) for w in wrt}
    loss = with_loss(fwd)
    built, seconds = {}, {}
    for kind, make, feeds in (
            ("forward", lambda: fwd, {"x": x}),
            ("jvp", lambda: oa.jvp(fwd, wrt), {"x": x, **tangents}),
            ("gradient", lambda: gradient_model(loss, wrt), {"x": x, "labels": labels}),
            ("hvp", lambda: oa.hvp(loss, wrt), {"x": x, "labels": labels, **tangents})):
        t = time.perf_counter()
        built[kind] = (make(), feeds)
        seconds[kind] = time.perf_counter() - t
    return label, built, seconds


def session(model: onnx.ModelProto, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def measure(built: dict, runs: int, threads: int, clock=time.perf_counter) -> dict[str, float]:
    """Median seconds per run of each model, the models interleaved run by run (after 3 warm-up runs); the
    inputs are OrtValues made once, so copying the tangents in is not timed. ``clock``: wall time, or
    ``time.process_time`` (the CPU time of this process: on a loaded machine, less disturbed by the time spent
    waiting for a core)."""
    import onnxruntime as ort

    sessions = {k: (session(m, threads), {n: ort.OrtValue.ortvalue_from_numpy(v) for n, v in feeds.items()})
                for k, (m, feeds) in built.items()}
    outputs = {k: [o.name for o in built[k][0].graph.output] for k in built}
    times = {k: [] for k in sessions}
    for r in range(runs + 3):
        for k, (s, feeds) in sessions.items():
            t = clock()
            s.run_with_ort_values(outputs[k], feeds)
            if r >= 3:
                times[k].append(clock() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def profile_table(built: dict, kind: str, threads: int, steps: int = 5) -> str:
    """onnxruntime's profiler on one of the four models: kernel time per op type (after onnxruntime's fusions
    and layout changes: ReorderOutput, FusedConv...), per run, over ``steps`` runs after a warm-up run."""
    import collections

    from benchmarks.profile import profile

    model, feeds = built[kind]
    kernels, wall, cpu = profile(model, feeds, threads, steps)
    by_op = collections.defaultdict(lambda: [0.0, 0])
    for e in kernels:
        op = e["args"].get("op_name", "?")
        by_op[op][0] += e["dur"] / 1e3 / steps
        by_op[op][1] += 1
    total = sum(v[0] for v in by_op.values())
    lines = [f"{kind}: {len(model.graph.node)} nodes, kernel time {total:.1f} ms per run (wall {1e3 * wall:.1f}, "
             f"CPU {1e3 * cpu:.1f}), load average {load()}", "", "| op type | ms per run | share | kernels per run |",
             "| --- | ---: | ---: | ---: |"]
    for op, (ms, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {op} | {ms:.2f} | {ms / total:.1%} | {n // steps} |")
    return "\n".join(lines)


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,cnn,transformer,lstm", help="comma-separated, of mlp, cnn, transformer, "
                   "lstm (default all; mlp alone runs in seconds)")
    p.add_argument("--runs", type=int, default=30, help="timed runs of each model, after 3 warm-up runs (default 30)")
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (default 1)")
    p.add_argument("--cpu-time", action="store_true", help="time each run by the CPU time of this process "
                   "(time.process_time) instead of wall time: on a loaded machine, less disturbed by waiting for a "
                   "core (with --threads 1 it is the run's own work)")
    p.add_argument("--emit", metavar="NAME=0|1", action="append", default=[],
                   help="switch an emitted form off or on while building (``emit_options``: lstm_tangent, "
                   "lstm_tangent_lean, lstm_hvp_share, lstm_hvp_share_factors, lstm_batched_backward, "
                   "max_pool_shared_indices, ...), to "
                   "compare a form with the one before it in separate processes")
    p.add_argument("--profile", metavar="KIND", choices=["forward", "jvp", "gradient", "hvp"],
                   help="instead of the timings, onnxruntime's kernel time per op type for one of the four models")
    args = p.parse_args(argv)
    from onnx_autodiff.engine.builder import emit_options

    with emit_options(**dict(_switch(e) for e in args.emit)):
        return run(args)


def _switch(text: str) -> tuple[str, bool]:
    name, _, value = text.partition("=")
    if value not in ("0", "1"):
        raise SystemExit(f"--emit {text}: give NAME=0 or NAME=1")
    return name, value == "1"


def run(args) -> int:
    if args.profile:
        for name in args.models.split(","):
            label, built, _ = build(name)
            print(f"{label}, {args.threads} thread(s)")
            print(profile_table(built, args.profile, args.threads), flush=True)
        return 0
    clock = time.process_time if args.cpu_time else time.perf_counter
    print(f"load average at start: {load()}; onnxruntime intra-op threads: {args.threads}; {args.runs} runs each"
          + ("; CPU time per run" if args.cpu_time else ""))
    print("| model | nodes fwd / jvp / grad / hvp | ms fwd | ms jvp | jvp / fwd | ms grad | ms hvp | hvp / grad "
          "| build s jvp / hvp |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name in args.models.split(","):
        label, built, seconds = build(name)
        t = measure(built, args.runs, args.threads, clock)
        nodes = " / ".join(str(len(built[k][0].graph.node)) for k in ("forward", "jvp", "gradient", "hvp"))
        ms = {k: 1e3 * v for k, v in t.items()}
        print(f"| {label} | {nodes} | {ms['forward']:.2f} | {ms['jvp']:.2f} | {t['jvp'] / t['forward']:.2f}x "
              f"| {ms['gradient']:.2f} | {ms['hvp']:.2f} | {t['hvp'] / t['gradient']:.2f}x "
              f"| {seconds['jvp']:.1f} / {seconds['hvp']:.1f} |", flush=True)
    print(f"load average at end: {load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
