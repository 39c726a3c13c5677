"""One benchmark configuration in its own process, driven over stdin/stdout by ``benchmarks.run``.

``python -m benchmarks.worker '<json config>'``: sets up the configuration (kind ``ours``,
``torch`` or ``forward``), prints ``ready {"losses": [...], "stages": [...]}``, then answers each
line ``run N`` with a JSON list of N step times in seconds and ``quit`` with the memory report: RSS
after the imports (baseline), the peak RSS of the process (``VmHWM``) and the difference.

Small models (``cfg["large"]`` false) train the model ``benchmarks.run`` already lowered. Real-size
models do the whole set-up here with the public API, each stage timed with its RSS: build
(``make_training_model(path)``: the weights memory-mapped, the rules checked), session (``TrainingSession``,
which lowers once); the set-up time is what a user waits for between an exported model and the first step.
Only the imports a configuration needs are made (the ONNX workers never import torch), so the
baseline is that configuration's own.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time

THREADS = int(os.environ.get("BENCH_THREADS", "2"))


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    """VmHWM, the peak RSS of this process image. (ru_maxrss is no good here: Linux carries the parent's
    peak over fork and exec, so every worker would report at least the parent's size.)"""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


def load1() -> float:
    """The 1-minute load average, quoted beside every timing."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def json_worker(module: str, kind: str, info_path: str, steps: int, threads: int) -> dict:
    """``python -m MODULE --worker KIND --info INFO --steps N`` in its own process: the JSON of its last line."""
    import subprocess

    cmd = [sys.executable, "-m", module, "--worker", kind, "--info", info_path, "--steps", str(steps)]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                       check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{kind} worker failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def timed_steps(step, steps: int, setup: float) -> dict:
    """``steps`` timed calls of ``step`` after one untimed warm-up call (allocations, graph preparation, our
    forward check): the set-up seconds given, the first call's seconds, the step times, every loss, the peak
    RSS. The LoRA benchmarks' workers report this."""
    losses, times = [], []
    for _ in range(steps + 1):
        t = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t)
    return {"setup_s": setup, "first_step_s": times[0], "step_s": times[1:], "losses": losses, "peak_mb": peak_mb()}


def ort_options():
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = THREADS
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return so


class Stages:
    """Wall time, RSS and peak RSS after each named stage of a set-up."""

    def __init__(self):
        self.rows: list[dict] = []
        self._t = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.rows.append({"stage": name, "s": now - self._t, "rss_mb": rss_mb(), "peak_mb": peak_mb()})
        self._t = time.perf_counter()


def _feeds(data):
    import onnxruntime as ort

    return {"x": ort.OrtValue.ortvalue_from_numpy(data["x"]),
            "labels": ort.OrtValue.ortvalue_from_numpy(data["labels"])}


def setup_ours(cfg, data, stages: Stages):
    from onnx_autodiff import TrainingSession

    if cfg.get("large"):
        from onnx_autodiff import make_training_model

        stages.mark("load")  # nothing to load: the path's weights are memory-mapped where they are used
        training = make_training_model(cfg["inference"], loss="cross_entropy", optimizer=cfg["optimizer"],
                                       lr=cfg["lr"])
        stages.mark("build")  # make_training_model checks the rules; the session lowers once
        sess = TrainingSession(training, session_options=ort_options(), progress=False)
        del training
        gc.collect()
        stages.mark("session")
    else:
        sess = TrainingSession(cfg["lowered"], session_options=ort_options())
        stages.mark("session")
    feeds = _feeds(data)
    return lambda: sess.step(feeds)[sess.loss_name]


def setup_forward(cfg, data, stages: Stages):
    import onnxruntime as ort

    sess = ort.InferenceSession(cfg["inference"], ort_options(), providers=["CPUExecutionProvider"])
    stages.mark("session")
    x = ort.OrtValue.ortvalue_from_numpy(data["x"])
    io = sess.io_binding()
    io.bind_ortvalue_input("x", x)
    for o in sess.get_outputs():
        io.bind_output(o.name)

    def run():
        sess.run_with_iobinding(io)
        return io.get_outputs()[0].numpy()
    return run


def torch_step(model, opt, x, labels):
    """One PyTorch eager training step as a closure (zero_grad, forward, cross-entropy, backward, update)
    that returns the loss: what every torch baseline of the benchmarks times."""
    import torch

    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), labels)
        loss.backward()
        opt.step()
        return loss.item()
    return step


def setup_torch(cfg, data, stages: Stages):
    import torch

    torch.set_num_threads(THREADS)
    if cfg.get("large"):
        from .large_models import build_large as build
    else:
        from .models import build
    model = build(cfg["model"])
    model.load_state_dict(torch.load(cfg["state_dict"]))
    model.train()
    if cfg["optimizer"] == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    else:
        opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"], eps=1e-8)
    stages.mark("model")
    x = torch.from_numpy(data["x"])
    labels = torch.from_numpy(data["labels"])
    return torch_step(model, opt, x, labels)


def main(argv):
    cfg = json.loads(argv[0])
    import numpy as np

    if cfg["kind"] == "torch":
        import torch  # noqa: F401  (in the baseline: the torch runtime itself is not what we measure)
    else:
        import onnxruntime  # noqa: F401

        import onnx_autodiff  # noqa: F401
    with np.load(cfg["data"]) as f:
        data = {k: f[k] for k in f.files}
    baseline = rss_mb()
    stages = Stages()
    step = {"ours": setup_ours, "forward": setup_forward, "torch": setup_torch}[cfg["kind"]](cfg, data, stages)
    losses = []
    for k in range(3):  # warm-up: allocations, graph preparation; the losses check ours against torch
        out = step()
        if k == 0:
            stages.mark("first step")
        if cfg["kind"] != "forward":
            losses.append(float(np.asarray(out).reshape(-1)[0]))
    print("ready " + json.dumps({"losses": losses, "stages": stages.rows}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "run":
            times = []
            for _ in range(int(cmd[1])):
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
            print(json.dumps(times), flush=True)
        elif cmd[0] == "quit":
            peak = peak_mb()
            print(json.dumps({"baseline_mb": baseline, "peak_mb": peak, "growth_mb": peak - baseline}), flush=True)
            return


if __name__ == "__main__":
    main(sys.argv[1:])
