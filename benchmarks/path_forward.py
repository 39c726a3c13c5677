"""Issue 38's bound for ``benchmarks.public_path``: our step against the model's own inference forward.

In the process that timed our steps, right after them (the peak RSS is read before): an onnxruntime
InferenceSession of the exported inference model (weights as initializers, the user's session options, the
same batch) is run as many times as the step; and the FLOPs of its products and of the step model our session
runs are counted from shapes (``benchmarks.flops``). A clean backward costs about two forwards, so a step near
its bound is about 3x its forward; issue 38 asks for <= 3.5x.
"""
from __future__ import annotations

import time

import numpy as np

FORWARD_TARGET = 3.5


def forward_report(cfg: dict, options, x, labels) -> dict:
    """The forward's step times (``forward_times``) and the FLOPs of the forward and of our step model."""
    import onnxruntime as ort

    from .flops import model_flops

    sess = ort.InferenceSession(cfg["inference"], options, providers=["CPUExecutionProvider"])
    io = sess.io_binding()
    io.bind_cpu_input("x", x)
    for o in sess.get_outputs():
        io.bind_output(o.name)
    times = []
    for _ in range(cfg["steps"]):
        t = time.perf_counter()
        sess.run_with_iobinding(io)
        times.append(time.perf_counter() - t)
    del io, sess
    flops = {"forward": model_flops(cfg["inference"], {"x": x.shape}),
             "step": model_flops(cfg["_session"].step_model, {"x": x.shape, "labels": labels.shape})}
    return {"forward_times": times,
            "flops": {k: {"total": f.total, "by_op": f.by_op, "unknown": len(f.unknown)} for k, f in flops.items()}}


def against_forward(reports: list[dict], warmup: int) -> dict:
    """Our step against the model's own forward: the pooled forward median, step / forward within each process
    (the median over them), and the FLOPs of both (one process's: they depend on shapes only)."""
    ms = 1e3 * np.asarray([t for r in reports for t in r["forward_times"][warmup:]])
    ratio = float(np.median([np.median(r["times"][warmup:]) / np.median(r["forward_times"][warmup:])
                             for r in reports]))
    flops = reports[0]["flops"]
    bound = flops["step"]["total"] / flops["forward"]["total"] if flops["forward"]["total"] else None
    return {"forward_ms": float(np.median(ms)), "step_vs_forward": ratio, "flops": flops, "flops_ratio": bound}


def _gflop(f: dict) -> str:
    unknown = f" ({f['unknown']} nodes of unknown shape left out)" if f["unknown"] else ""
    return f"{f['total'] / 1e9:.3g}{unknown}"


def forward_table(rows: list[tuple[str, dict]]) -> list[str]:
    """Markdown lines: per (label, our system's summary) that has the forward, the step / forward ratio beside
    the FLOPs' ratio."""
    rows = [(name, o) for name, o in rows if "step_vs_forward" in o]
    if not rows:
        return []
    lines = ["", "Our step against the model's own inference forward, timed in the same process after the steps "
             "(onnxruntime InferenceSession of the exported model: weights as initializers, the same options, "
             "threads and batch); step / forward is the median over the processes of each one's medians. FLOPs: "
             "MatMul, Gemm, Conv and ConvTranspose from shapes (benchmarks/flops.py); a clean backward costs about "
             "two forwards, so the FLOPs' ratio is about 3.", "",
             f"| model | step ms | forward ms | step / forward (target <= {FORWARD_TARGET}) | "
             "step FLOPs / forward FLOPs | forward GFLOP | step GFLOP | step GFLOP by op |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, o in rows:
        f = o["flops"]
        by_op = ", ".join(f"{k} {v / 1e9:.3g}" for k, v in sorted(f["step"]["by_op"].items()))
        bound = "" if o["flops_ratio"] is None else f"{o['flops_ratio']:.2f}"
        lines.append(f"| {name} | {o['median_ms']:.2f} | {o['forward_ms']:.2f} | **{o['step_vs_forward']:.2f}** | "
                     f"{bound} | {_gflop(f['forward'])} | {_gflop(f['step'])} | {by_op} |")
    return lines
