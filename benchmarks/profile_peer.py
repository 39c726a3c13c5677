"""Issue 38: a step on the docs' path against the peer onnxsim's, kernel by kernel (onnxruntime's profiler).

    python -m benchmarks.profile_peer [mlp] [--steps 200] [--rounds 2] [--kinds ours,onnxsim] [--threads 1]

Each system in its own process, alternating ``--rounds`` times: **ours** is ``TrainingSession``'s own two runs
(``make_training_model(path, "cross_entropy", "adam")`` -> ``TrainingSession`` -> ``step``, profiling on in the
session options the user gives), **onnxsim** the one session of its ``compile_training_loop``
(``benchmarks.public_path.setup_onnxsim``, profiling turned on in the options its ``Runner`` makes; only where
``onnxsim`` is importable). Per node, the median of its kernel time over the steps after 5 (a step the machine
preempts moves a median little, where it moves a sum), summed per role: the forward's and the backward's products
(Gemm, MatMul, and the Transposes that feed them), the other forward and backward nodes, the optimizer, our NaN
checks. Also per step: the thread CPU time of the profiled steps, and the part of it outside onnxruntime's runs
(the Python around them). The profiler adds CPU time to every node: compare the systems, not these with an
unprofiled run. Median over the rounds; the load is printed with the table.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

if __package__ in (None, ""):  # python benchmarks/profile_peer.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP = 5
PRODUCTS = ("Gemm", "MatMul", "Transpose", "FusedMatMul")


def _timed(sess, method: str, spent: list) -> None:
    """Wrap ``sess.<method>`` so that the thread CPU time inside it adds to ``spent[0]``."""
    run = getattr(sess, method)

    def timed(*args, **kwargs):
        t = time.thread_time()
        try:
            return run(*args, **kwargs)
        finally:
            spent[0] += time.thread_time() - t
    setattr(sess, method, timed)


def _options(threads: int, prefix: str):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.enable_profiling = True
    so.profile_file_prefix = prefix
    return so


def setup(kind: str, cfg: dict, x, labels, threads: int, prefix: str):
    """(step function, [(part, onnxruntime session, role of a node name)]) of one system, profiling on."""
    if kind == "ours":
        from onnx_autodiff import TrainingSession, make_training_model

        sess = TrainingSession(make_training_model(cfg["inference"], "cross_entropy", "adam"),
                               session_options=_options(threads, prefix), progress=False)
        feeds = {"x": x, "labels": labels}
        parts = [(r.what, r.sess, lambda name, what=r.what: role_ours(what, name)) for r in sess._runs]
        return (lambda: float(sess.step(feeds)[sess.loss_name])), parts, "run_with_iobinding"
    from onnxsim import backend

    from .public_path import setup_onnxsim
    from .worker import Stages

    made = backend.rt.SessionOptions
    backend.rt.SessionOptions = lambda: _profiled(made(), threads, prefix)  # its Runner sets what it sets after
    c = {**cfg, "threads": threads}
    step = setup_onnxsim(c, x, labels, Stages())
    backend.rt.SessionOptions = made
    runner = getattr(c["_loop"], "_runner", None)
    if runner is None or not hasattr(runner, "_sess"):
        raise SystemExit("this onnxsim keeps its session elsewhere (0.8.1 was read); update profile_peer.setup")
    roles = roles_onnxsim(c["_loop"]._step.model.graph)
    return step, [("step", runner._sess, lambda name: roles.get(name, "other"))], "run_with_ort_values"


def _profiled(so, threads: int, prefix: str):
    so.intra_op_num_threads = threads
    so.enable_profiling = True
    so.profile_file_prefix = prefix
    return so


def role_ours(part: str, name: str) -> str:
    if "sum_of_squares" in name:
        return "NaN check"
    if part == "update":
        return "optimizer"
    return "backward" if "/grad/" in name or name.endswith("_grad") else "forward"


def roles_onnxsim(graph) -> dict[str, str]:
    """Node name -> forward / backward / optimizer, from the step graph's order: the forward up to the loss, its
    Adam after the first node that reads a beta (onnxsim's ``adam_update`` names them), the backward between."""
    nodes = list(graph.node)
    loss = next((i for i, n in enumerate(nodes) if "loss" in n.output), -1)
    adam = next((i for i, n in enumerate(nodes) if any("beta1" in x for x in n.input)), len(nodes))
    return {n.name: "forward" if i <= loss else "backward" if i < adam else "optimizer" for i, n in enumerate(nodes)}


def node_medians(path: str, role) -> dict[str, tuple[float, int]]:
    """role (with op type for products) -> (sum over its nodes of the node's median kernel ms, nodes)."""
    with open(path) as f:
        events = json.load(f)
    os.unlink(path)
    runs = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e["name"] == "model_run")
    mark = runs[WARMUP] if len(runs) > WARMUP else 0
    durs, ops = collections.defaultdict(list), {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= mark:
            node = e["name"][: -len("_kernel_time")]
            durs[node].append(e["dur"])
            ops[node] = e["args"].get("op_name", "?")
    out: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for node, d in durs.items():
        r = role(node)
        if r in ("forward", "backward"):
            r = f"{r}: {ops[node]}" if ops[node] in PRODUCTS else f"{r}: other"
        out[r][0] += float(np.median(d)) / 1e3
        out[r][1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def child(kind: str, data: dict, steps: int, threads: int) -> dict:
    with np.load(data["data"]) as f:
        x, labels = f["x"], f["labels"]
    step, parts, method = setup(kind, data, x, labels, threads, os.path.join(tempfile.gettempdir(),
                                                                            f"oa-peer-{os.getpid()}"))
    inside = [0.0]
    for _, sess, _ in parts:
        _timed(sess, method, inside)
    for _ in range(WARMUP):
        step()
    inside[0] = 0.0
    t = time.thread_time()
    for _ in range(steps):
        step()
    cpu = (time.thread_time() - t) / steps
    roles: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for _, sess, role in parts:
        for k, (ms, n) in node_medians(sess.end_profiling(), role).items():
            roles[k][0] += ms
            roles[k][1] += n
    return {"kind": kind, "roles": dict(roles), "cpu_ms": 1e3 * cpu, "outside_ms": 1e3 * (cpu - inside[0] / steps),
            "runs": len(parts), "load": os.getloadavg()[0]}


def table(results: dict[str, list[dict]]) -> str:
    kinds = list(results)
    keys = sorted({k for rs in results.values() for r in rs for k in r["roles"]})

    def med(kind, f):
        return float(np.median([f(r) for r in results[kind]]))
    lines = ["| role | " + " | ".join(f"{k} ms (nodes)" for k in kinds) + " |", "| --- |" + " ---: |" * len(kinds)]
    for key in keys:
        cells = [f"{med(k, lambda r, key=key: r['roles'].get(key, [0, 0])[0]):.3f} "
                 f"({results[k][0]['roles'].get(key, [0, 0])[1]})" for k in kinds]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines.append("| **kernel time** | " + " | ".join(
        f"**{med(k, lambda r: sum(v[0] for v in r['roles'].values())):.3f}**" for k in kinds) + " |")
    lines.append("| thread CPU a step (profiled) | " + " | ".join(
        f"{med(k, lambda r: r['cpu_ms']):.3f}" for k in kinds) + " |")
    lines.append("| of it outside onnxruntime's runs | " + " | ".join(
        f"{med(k, lambda r: r['outside_ms']):.3f}" for k in kinds) + " |")
    lines.append("| onnxruntime runs a step | " + " | ".join(str(results[k][0]["runs"]) for k in kinds) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import importlib.util

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="mlp", choices=["mlp", "tiny"], help="the MLP 784-512-512-10 "
                   "(default), or tiny (16-8-4, for the smoke test)")
    p.add_argument("--steps", type=int, default=200, help="profiled steps after 5 (default 200)")
    p.add_argument("--rounds", type=int, default=2, help="alternating processes per system (default 2)")
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (default 1)")
    p.add_argument("--kinds", default="ours,onnxsim", help="systems (default ours,onnxsim; onnxsim only where it "
                   "is importable)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(child(spec["kind"], spec["data"], args.steps, args.threads)))
        return 0
    kinds = [k for k in args.kinds.split(",") if k != "onnxsim" or importlib.util.find_spec("onnxsim") is not None]
    from .public_path import prepare

    results: dict[str, list[dict]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="oa-peer-") as workdir:
        data = {**prepare(args.model, workdir), "model": args.model}
        for _ in range(args.rounds):
            for kind in kinds:
                cmd = [sys.executable, "-m", "benchmarks.profile_peer", "--child",
                       json.dumps({"kind": kind, "data": data}), "--steps", str(args.steps), "--threads",
                       str(args.threads)]
                out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                if out.returncode != 0:
                    raise SystemExit(f"the {kind} process failed:\n{out.stderr[-2000:]}")
                results[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
    loads = ", ".join(f"{r['load']:.1f}" for rs in results.values() for r in rs)
    print(f"{args.model}, Adam, {args.threads} thread(s), {args.steps} steps after {WARMUP}, {args.rounds} "
          f"alternating processes per system; per node the median kernel time, summed per role (ms a step); "
          f"load {loads}")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
