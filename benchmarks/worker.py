"""One benchmark configuration in its own process, driven over stdin/stdout by ``benchmarks.run``.

``python -m benchmarks.worker '<json config>'``: sets up the configuration (kind "ours", "torch" or
"forward"), prints ``ready``, then answers each line ``run N`` with a JSON list of N step times in
seconds and ``quit`` with the memory report: RSS after the imports (baseline), the peak RSS of the
process (``VmHWM``) and the difference. Only the imports a configuration needs are made (the ONNX
workers never import torch), so the baseline is that configuration's own.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

THREADS = int(os.environ.get("BENCH_THREADS", "2"))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    """VmHWM, the peak RSS of this process image. (ru_maxrss is no good here: Linux carries the parent's
    peak over fork and exec, so every worker would report at least the parent's size.)"""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _ort_options():
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = THREADS
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return so


def setup_ours(cfg, data):
    import onnxruntime as ort

    from onnx_autodiff import TrainingSession
    from onnx_autodiff.io import load_model

    sess = TrainingSession(load_model(cfg["lowered"]), session_options=_ort_options())
    feeds = {"x": ort.OrtValue.ortvalue_from_numpy(data["x"]),
             "labels": ort.OrtValue.ortvalue_from_numpy(data["labels"])}
    return lambda: sess.step(feeds)


def setup_forward(cfg, data):
    import onnxruntime as ort

    sess = ort.InferenceSession(cfg["inference"], _ort_options(), providers=["CPUExecutionProvider"])
    x = ort.OrtValue.ortvalue_from_numpy(data["x"])
    io = sess.io_binding()
    io.bind_ortvalue_input("x", x)
    for o in sess.get_outputs():
        io.bind_output(o.name)

    def run():
        sess.run_with_iobinding(io)
        return io.get_outputs()[0].numpy()
    return run


def setup_torch(cfg, data):
    import torch

    from .models import build

    torch.set_num_threads(THREADS)
    model = build(cfg["model"])
    model.load_state_dict(torch.load(cfg["state_dict"]))
    model.train()
    if cfg["optimizer"] == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    else:
        opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"], eps=1e-8)
    x = torch.from_numpy(data["x"])
    labels = torch.from_numpy(data["labels"])
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), labels)
        loss.backward()
        opt.step()
        return loss.item()
    return step


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
    baseline = _rss_mb()
    step = {"ours": setup_ours, "forward": setup_forward, "torch": setup_torch}[cfg["kind"]](cfg, data)
    losses = []
    for _ in range(3):  # warm-up: allocations, graph preparation; the losses check ours against torch
        out = step()
        if cfg["kind"] != "forward":
            losses.append(float(np.asarray(out["loss"] if isinstance(out, dict) else out).reshape(-1)[0]))
    print("ready " + json.dumps(losses), flush=True)
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
            peak = _peak_mb()
            print(json.dumps({"baseline_mb": baseline, "peak_mb": peak, "growth_mb": peak - baseline}), flush=True)
            return


if __name__ == "__main__":
    main(sys.argv[1:])
