"""Where a training step's time goes: onnxruntime's profiler, kernel time per op type.

    python -m benchmarks.profile cnn [--threads 1] [--steps 5] [--top 15] [--optimizer sgd]
    python -m benchmarks.profile bert --threads 2 --steps 2
    python -m benchmarks.profile cnn --threads 2 --against /path/to/other/checkout [--rounds 3]

Builds the step model the benchmark trains (``build_step_model`` of the lowered training model; the
state tensors are inputs whose defaults are their initial values), runs it ``steps`` times after one
warm-up in an onnxruntime session with profiling on, and sums the ``Node`` kernel events per op type
(after onnxruntime's own fusions, so FusedMatMul, FusedConv... appear under their fused names) and
per part: forward, backward (a node named ``.../grad/...``) or the rest (loss, optimizer). Kernel
times are per-op CPU work, so their shares are the measure to compare between graphs on a busy
machine; the wall time per step is printed too.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

import numpy as np


def step_model(name: str, workdir: str, optimizer: str, inference: bool = False):
    """(step model, feeds) for a benchmark model, small or real-size; with ``inference`` the exported
    inference model instead (weights as constant initializers)."""
    import onnx

    from onnx_autodiff import build_step_model, lower

    from .run import LARGE_NAMES, prepare, prepare_large

    if name in LARGE_NAMES:
        from onnx_autodiff import make_training_model

        prep = prepare_large(name, workdir)
        if inference:
            return onnx.load(prep["inference"]), _feeds(prep)
        lowered = lower(make_training_model(onnx.load(prep["inference"]), loss="cross_entropy",
                                            optimizer=prep["optimizer"], lr=prep["lr"]))
    else:
        prep = prepare(name, workdir, optimizer, 1)
        if inference:
            return onnx.load(prep["inference"]), _feeds(prep)
        lowered = onnx.load(prep["lowered"])
    return build_step_model(lowered), _feeds(prep)


def _feeds(prep: dict) -> dict:
    with np.load(prep["data"]) as f:
        return {"x": f["x"], "labels": f["labels"]}


def part(node_name: str) -> str:
    if "/grad/" in node_name or node_name.endswith("/grad"):
        return "backward"
    return "forward" if not node_name.startswith(("bench/", "Gradient", "train", "opt", "adam", "sgd")) else "rest"


def profile(model, feeds: dict, threads: int, steps: int) -> tuple[list[dict], float, float]:
    """(kernel events of the timed steps, median wall and CPU seconds per step). With one thread the CPU
    time is the least load-sensitive measure of the whole step (time spent descheduled is not in it)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tempfile.gettempdir(), f"oa-profile-{os.getpid()}")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    feeds = {k: v for k, v in feeds.items() if k in names}
    outputs = [o.name for o in sess.get_outputs()]
    sess.run(outputs, feeds)  # warm-up
    walls, cpus = [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        sess.run(outputs, feeds)
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    path = sess.end_profiling()
    with open(path) as f:
        events = json.load(f)
    os.unlink(path)
    runs = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e["name"] == "model_run")
    mark = runs[1] if len(runs) > 1 else 0  # skip the warm-up run
    kernels = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= mark]
    return kernels, float(np.median(walls)), float(np.median(cpus))


def top_nodes(kernels: list[dict], steps: int, top: int) -> str:
    """The ``top`` nodes by kernel time: where inside an op type the time goes."""
    by_node = collections.defaultdict(float)
    ops = {}
    for e in kernels:
        node = e["name"][: -len("_kernel_time")]
        by_node[node] += e["dur"] / 1e3 / steps
        ops[node] = e["args"].get("op_name", "?")
    lines = ["| node | op type | ms/step |", "| --- | --- | ---: |"]
    for node, ms in sorted(by_node.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {node} | {ops[node]} | {ms:.2f} |")
    return "\n".join(lines)


def summarize(kernels: list[dict], steps: int, top: int) -> str:
    by_op = collections.defaultdict(lambda: [0.0, 0])
    by_part = collections.defaultdict(float)
    by_op_part = collections.defaultdict(float)
    for e in kernels:
        op = e["args"].get("op_name", "?")
        node = e["name"][: -len("_kernel_time")]
        ms = e["dur"] / 1e3 / steps
        by_op[op][0] += ms
        by_op[op][1] += 1
        by_part[part(node)] += ms
        by_op_part[(op, part(node))] += ms
    total = sum(v[0] for v in by_op.values())
    lines = [f"kernel time {total:.1f} ms/step: " + ", ".join(f"{k} {v:.1f} ({v / total:.0%})"
                                                            for k, v in sorted(by_part.items())), "",
             "| op type | ms/step | share | nodes | forward / backward / rest ms |",
             "| --- | ---: | ---: | ---: | --- |"]
    for op, (ms, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]:
        split = " / ".join(f"{by_op_part[(op, p)]:.1f}" for p in ("forward", "backward", "rest"))
        lines.append(f"| {op} | {ms:.1f} | {ms / total:.1%} | {n // steps} | {split} |")
    return "\n".join(lines)


def aggregate(kernels: list[dict], steps: int) -> dict:
    """ms per step by op type, by part, and by (op type, part): what ``--against`` compares."""
    by_op, by_part, by_op_part, grad_of = (collections.defaultdict(float), collections.defaultdict(float), {},
                                           collections.defaultdict(float))
    for e in kernels:
        op = e["args"].get("op_name", "?")
        node = e["name"][: -len("_kernel_time")]
        where = part(node)
        ms = e["dur"] / 1e3 / steps
        by_op[op] += ms
        by_part[where] += ms
        by_op_part[f"{op}/{where}"] = by_op_part.get(f"{op}/{where}", 0.0) + ms
        if "/grad/" in node:
            grad_of[node.split("/grad/")[0]] += ms
    return {"op": dict(by_op), "part": dict(by_part), "op_part": by_op_part, "grad_of": dict(grad_of)}


def compare(args, against: str) -> str:
    """The profile of this checkout and of the one at ``against`` (its ``onnx_autodiff``, these benchmarks),
    each in its own process, alternating ``--rounds`` times; the median of each side per op type and part."""
    import subprocess

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = {"before": [], "after": []}
    for _ in range(args.rounds):
        for side, code in (("before", against), ("after", here)):
            cmd = [sys.executable, "-m", "benchmarks.profile", args.model, "--threads", str(args.threads), "--steps",
                   str(args.steps), "--optimizer", args.optimizer, "--json", "--code", code]
            out = subprocess.run(cmd, cwd=here, capture_output=True, text=True, check=True).stdout
            run = json.loads(out.splitlines()[-1])
            if os.path.realpath(run["code"]) != os.path.realpath(code):
                raise SystemExit(f"the {side} run imported onnx_autodiff from {run['code']}, not {code}")
            runs[side].append(run)
    return comparison_table(runs, args.top)


def comparison_table(runs: dict, top: int) -> str:
    def med(side, kind, key):
        return float(np.median([r[kind].get(key, 0.0) for r in runs[side]]))

    totals = {s: float(np.median([sum(r["op"].values()) for r in runs[s]])) for s in runs}
    loads = {s: ", ".join(f"{r['load']:.1f}" for r in runs[s]) for s in runs}
    cpu = {s: 1e3 * float(np.median([r["cpu"] for r in runs[s]])) for s in runs}
    lines = [f"kernel time ms/step (median of {len(runs['after'])} alternating runs each): before "
             f"{totals['before']:.1f}, after {totals['after']:.1f}; process CPU ms/step: before {cpu['before']:.1f}, "
             f"after {cpu['after']:.1f}; load at each run: before {loads['before']}; after {loads['after']}", "",
             "| op type / part | before ms | share | after ms | share |", "| --- | ---: | ---: | ---: | ---: |"]
    for p in ("forward", "backward", "rest"):
        b, a = med("before", "part", p), med("after", "part", p)
        lines.append(f"| **{p}** | {b:.1f} | {b / totals['before']:.1%} | {a:.1f} | {a / totals['after']:.1%} |")
    keys = sorted({k for s in runs for r in runs[s] for k in r["op_part"]}, key=lambda k: -med("before", "op_part", k))
    for k in keys[:top]:
        b, a = med("before", "op_part", k), med("after", "op_part", k)
        lines.append(f"| {k} | {b:.1f} | {b / totals['before']:.1%} | {a:.1f} | {a / totals['after']:.1%} |")
    lines += ["", "| backward of forward node | before ms | share | after ms | share |",
              "| --- | ---: | ---: | ---: | ---: |"]
    nodes = sorted({k for s in runs for r in runs[s] for k in r["grad_of"]}, key=lambda k: -med("before", "grad_of", k))
    for k in nodes[:top]:
        b, a = med("before", "grad_of", k), med("after", "grad_of", k)
        lines.append(f"| {k} | {b:.1f} | {b / totals['before']:.1%} | {a:.1f} | {a / totals['after']:.1%} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a benchmark model name (mlp, cnn, transformer, resnet18, bert, gpt2, resnet50)")
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (default 1)")
    p.add_argument("--steps", type=int, default=5, help="profiled steps after one warm-up step (default 5)")
    p.add_argument("--top", type=int, default=15, help="op types listed (default 15)")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"], help="small models only")
    p.add_argument("--inference", action="store_true", help="profile the exported inference model instead")
    p.add_argument("--nodes", type=int, default=0, help="also list this many nodes with the most kernel time")
    p.add_argument("--against", metavar="DIR", help="also profile the checkout at DIR (its onnx_autodiff), each "
                   "side in its own process, alternating --rounds times, and print both")
    p.add_argument("--rounds", type=int, default=3, help="alternating runs per side with --against (default 3)")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--code", help=argparse.SUPPRESS)  # the checkout whose onnx_autodiff builds the step
    args = p.parse_args(argv)
    if args.against:
        print(f"{args.model}, {args.threads} thread(s), {args.steps} steps per run; before: {args.against}")
        print(compare(args, args.against))
        return 0
    if args.code:
        sys.path.insert(0, os.path.abspath(args.code))
    with tempfile.TemporaryDirectory(prefix="oa-profile-") as workdir:
        model, feeds = step_model(args.model, workdir, args.optimizer, args.inference)
        kernels, wall, cpu = profile(model, feeds, args.threads, args.steps)
    if args.json:
        import onnx_autodiff

        print(json.dumps(dict(aggregate(kernels, args.steps), wall=wall, cpu=cpu, load=os.getloadavg()[0],
                              code=os.path.dirname(os.path.dirname(onnx_autodiff.__file__)))))
        return 0
    print(f"{args.model}{' inference' if args.inference else ''}, {args.threads} thread(s), {args.steps} steps, "
          f"wall {1e3 * wall:.1f} ms/step, "
          f"CPU {1e3 * cpu:.1f} ms/step, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(summarize(kernels, args.steps, args.top))
    if args.nodes:
        print()
        print(top_nodes(kernels, args.steps, args.nodes))


if __name__ == "__main__":
    sys.exit(main())
