"""Training-step benchmarks against PyTorch eager, and lowering time.

    python -m benchmarks.run [--quick] [--models mlp,cnn,transformer,resnet18] [--threads 2,1]
    python -m benchmarks.run --models bert,gpt2,resnet50 --threads 2 --no-lowering     # real size

Small models (batch 64, float32, SGD or Adam): three configurations in their own processes on the
same weights and inputs: our training step (torch.onnx.export -> training model -> lower ->
TrainingSession.step), PyTorch eager (forward, cross entropy, backward, optimizer step) and the
forward pass alone in onnxruntime. Real-size models (BERT-base, GPT-2 small, ResNet-50; opt-in) the
same, with our set-up done inside the worker by the public API, timed per stage. The processes are
driven in interleaved rounds, so a burst of load from elsewhere hits all three alike; each number is
the median over all steps. Each row set runs once per thread count (default 2, then 1: the 1-thread
rows are the contention-free control).

Noise: before and after each row's timed rounds the 1-minute load average is read, and the CPU time
the rest of the machine used during them is counted (/proc/stat minus our workers). A row whose load
was above --max-load at the start, moved by more than our own threads explain, or that shared the
machine with more than --max-foreign busy cores is timed again (--retries), then marked noisy: its
times are printed, its ratios are not.

Writes results.md / results.json / results.png (matplotlib, if installed) to --out: benchmarks/ for
a full run, benchmarks/out/ (untracked) for --quick.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

if __package__ in (None, ""):  # python benchmarks/run.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

from benchmarks.noise import Noise, wait_quiet  # noqa: E402
from benchmarks.training_model import inference_only, make_training_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BATCH = 64
LR = {"sgd": 0.01, "adam": 1e-3}
SMALL = ("mlp", "cnn", "transformer", "resnet18")
LARGE_NAMES = ("bert", "gpt2", "resnet50", "bert-tiny")  # bert-tiny: the large path in seconds


# ---- preparing a model -------------------------------------------------------------------------------

def export(module, x, *, constant_folding=True, dynamic_batch=False) -> onnx.ModelProto:
    """TorchScript export at opset 17; models with BatchNorm in training mode (batch statistics, as
    torch's train()), the others in eval mode (dropout is 0 in every benchmark model)."""
    import torch

    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in module.modules())
    mode = torch.onnx.TrainingMode.TRAINING if has_bn else torch.onnx.TrainingMode.EVAL
    module.train(has_bn)
    buf = io.BytesIO()
    axes = {"x": {0: "batch"}, "logits": {0: "batch"}} if dynamic_batch else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), buf, dynamo=False, opset_version=17, input_names=["x"],
                          output_names=["logits"], training=mode, do_constant_folding=constant_folding,
                          dynamic_axes=axes)
    return onnx.load_from_string(buf.getvalue())


def timed(fn, repeats: int):
    """(median seconds, last result) of ``repeats`` calls (``lower`` keeps no cache: each lowers from scratch)."""
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def _save_inputs(name: str, workdir: str, x, labels, module) -> tuple[str, str]:
    """The batch (.npz) and the module's state dict (.pt) every worker of a row starts from."""
    import torch

    data = os.path.join(workdir, f"{name}.npz")
    np.savez(data, x=x, labels=labels)
    state = os.path.join(workdir, f"{name}.pt")
    torch.save(module.state_dict(), state)
    return data, state


def prepare(name: str, workdir: str, optimizer: str, lower_repeats: int, batch: int = BATCH) -> dict:
    """A small model: data, state dict, the lowered training model and the inference model on disk."""
    import torch

    from onnx_autodiff import lower

    from .models import MODELS, build

    _, shape, classes, _ = MODELS[name]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    labels = rng.integers(0, classes, batch).astype(np.int64)
    module = build(name)
    data, state = _save_inputs(name, workdir, x, labels, module)
    inference = export(module, torch.from_numpy(x))
    training = make_training_model(inference, "logits", optimizer, LR[optimizer])
    lower_s, lowered = timed(lambda: lower(training), lower_repeats)
    paths = {"lowered": os.path.join(workdir, f"{name}.lowered.onnx"),
             "inference": os.path.join(workdir, f"{name}.inference.onnx")}
    onnx.save(lowered, paths["lowered"])
    onnx.save(inference_only(inference), paths["inference"])
    n_backward = len(lowered.training_info[0].algorithm.node)
    return {"data": data, "state_dict": state, **paths, "lower_s": lower_s, "optimizer": optimizer,
            "lr": LR[optimizer], "forward_nodes": len(inference.graph.node),
            "step_nodes": len(inference.graph.node) + n_backward}


def prepare_large(name: str, workdir: str) -> dict:
    """A real-size model: data, state dict and the exported inference model (opset 17, no constant
    folding, dynamic batch); the training model is built in the worker, where its cost is measured."""
    import torch

    from .large_models import LARGE, VOCAB, build_large

    _, shape, kind, classes, batch, optimizer, lr, _ = LARGE[name]
    rng = np.random.default_rng(0)
    if kind == "tokens":
        x = rng.integers(0, VOCAB[name], (batch, *shape)).astype(np.int64)
    else:
        x = rng.standard_normal((batch, *shape)).astype(np.float32)
    labels = rng.integers(0, classes, batch).astype(np.int64)
    module = build_large(name)
    data, state = _save_inputs(name, workdir, x, labels, module)
    inference = export(module, torch.from_numpy(x), constant_folding=False, dynamic_batch=True)
    del module
    path = os.path.join(workdir, f"{name}.inference.onnx")
    onnx.save(inference, path)
    return {"data": data, "state_dict": state, "inference": path, "large": True, "optimizer": optimizer,
            "lr": lr, "forward_nodes": len(inference.graph.node)}


# ---- driving the workers -----------------------------------------------------------------------------

class Worker:
    def __init__(self, cfg: dict, threads: int, max_rss_mb: float):
        self.kind = cfg["kind"]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS=str(threads), BENCH_THREADS=str(threads), HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.worker", json.dumps(cfg)], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.times: list[float] = []
        self.killed_at_mb = None
        self._watch = threading.Thread(target=self._watch_rss, args=(max_rss_mb,), daemon=True)
        self._watch.start()

    def _watch_rss(self, limit_mb: float):
        """Kill the worker if its RSS passes ``limit_mb``: the machine is shared, and an out-of-memory
        kill would take someone else's process."""
        while self.proc.poll() is None:
            try:
                with open(f"/proc/{self.proc.pid}/status") as f:
                    rss = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
            except (FileNotFoundError, StopIteration, ProcessLookupError):
                return
            if rss > limit_mb:
                self.killed_at_mb = rss
                self.proc.kill()
                return
            time.sleep(0.2)

    def _died(self) -> RuntimeError:
        code = self.proc.wait()
        if self.killed_at_mb:
            return RuntimeError(f"the {self.kind} worker passed the RSS limit ({self.killed_at_mb:.0f} MB; "
                                "raise --max-rss-gb if the machine has room)")
        return RuntimeError(f"the {self.kind} worker died (exit code {code}"
                            + (", killed by a signal: out of memory?" if code < 0 else "") + ")")

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise self._died()
        return line

    def _send(self, text: str):
        try:
            self.proc.stdin.write(text)
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None

    def wait_ready(self):
        line = self._line()
        while not line.startswith("ready"):
            line = self._line()
        ready = json.loads(line[len("ready"):])
        self.losses, self.stages = ready["losses"], ready["stages"]

    def run(self, n: int):
        self._send(f"run {n}\n")
        self.times += json.loads(self._line())

    def quit(self) -> dict:
        self._send("quit\n")
        mem = json.loads(self._line())
        self.proc.wait()
        return mem

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def bench_model(name: str, prep: dict, threads: int, rounds: int, steps: int, opts) -> dict:
    common = {"model": name, **prep}
    workers = []
    try:
        for kind in ("ours", "torch", "forward"):  # one at a time: set-up should not overlap another's
            workers.append(Worker({**common, "kind": kind}, threads, opts.max_rss_gb * 1024))
            workers[-1].wait_ready()
        attempts = 0
        for _ in range(opts.retries + 1):
            attempts += 1
            for w in workers:
                w.times = []
            opts.wait_left -= wait_quiet(opts.max_load, min(opts.settle, opts.wait_left), f"[{name} x{threads}] ")
            noise = Noise(workers)
            for r in range(rounds):
                order = workers[r % 3:] + workers[:r % 3]
                for w in order:
                    time.sleep(0.2)  # let the previous process's spinning threads go idle
                    w.run(steps)
            quiet = noise.finish(threads, opts.max_load, opts.max_foreign)
            print(f"[{name} x{threads}] load {quiet['load_before']:.2f} -> {quiet['load_after']:.2f}, "
                  f"{quiet['foreign_cores']:.2f} cores busy elsewhere" + (f": NOISY ({quiet['noisy']})"
                                                                          if quiet["noisy"] else ""),
                  file=sys.stderr, flush=True)
            if not quiet["noisy"]:
                break
            if attempts <= opts.retries:
                print(f"[{name} x{threads}] timing again ({attempts} of {opts.retries} --retries)", file=sys.stderr,
                      flush=True)
        result = {"noise": quiet, "attempts": attempts}
        for w in workers:
            mem = w.quit()
            result[w.kind] = {"ms": 1e3 * statistics.median(w.times), "n": len(w.times), "losses": w.losses,
                              "stages": w.stages, **mem}
    finally:
        for w in workers:
            w.stop()
    ours, ref = result["ours"]["losses"], result["torch"]["losses"]
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, ref)]
    result["loss_diff_first"], result["loss_diff"] = diffs[0], max(diffs)
    return result


# ---- lowering time -----------------------------------------------------------------------------------

def chain_model(n_nodes: int, width: int = 16) -> onnx.ModelProto:
    """MatMul -> Add -> Tanh blocks (3 nodes each) on (batch, width), a Gemm head to 10 logits."""
    rng = np.random.default_rng(0)
    nodes, inits, h = [], [], "x"
    for k in range((n_nodes - 1) // 3):
        w, b = f"w{k}", f"b{k}"
        inits += [numpy_helper.from_array((rng.standard_normal((width, width)) * 0.3).astype(np.float32), w),
                  numpy_helper.from_array(np.zeros(width, np.float32), b)]
        nodes += [helper.make_node("MatMul", [h, w], [f"m{k}"], name=f"mm{k}"),
                  helper.make_node("Add", [f"m{k}", b], [f"a{k}"], name=f"add{k}"),
                  helper.make_node("Tanh", [f"a{k}"], [f"h{k}"], name=f"tanh{k}")]
        h = f"h{k}"
    inits.append(numpy_helper.from_array(np.zeros((width, 10), np.float32), "head"))
    nodes.append(helper.make_node("Gemm", [h, "head"], ["logits"], name="head"))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def bench_lowering(quick: bool, optimizer: str, tiny: bool = False) -> list[dict]:
    """The ResNet-50-shaped graph (with and without the full check) and chains of 1,000 / 3,000 / 10,000 nodes;
    ``tiny``: a chain of 100 nodes only."""
    import torch

    from onnx_autodiff import lower

    from .models import RESNET50, build

    rows = []
    repeats = 1 if quick else 3
    if tiny:
        return [_lower_chain(100, optimizer, 1)]
    module = build("resnet50")
    inference = export(module, torch.zeros(BATCH, *RESNET50[1]))
    training = make_training_model(inference, "logits", optimizer, LR[optimizer])
    for check in (True, False):
        s, low = timed(lambda check=check: lower(training, check=check), repeats)
        rows.append({"graph": RESNET50[3] + ("" if check else ", check=False"),
                     "forward_nodes": len(inference.graph.node),
                     "lowered_nodes": len(inference.graph.node) + len(low.training_info[0].algorithm.node),
                     "seconds": s})
    for n in (1000, 3000, 10000):
        rows.append(_lower_chain(n, optimizer, 1 if (quick or n == 10000) else repeats))
    return rows


def _lower_chain(n: int, optimizer: str, repeats: int) -> dict:
    from onnx_autodiff import lower

    training = make_training_model(chain_model(n), "logits", optimizer, LR[optimizer])
    s, low = timed(lambda: lower(training), repeats)
    return {"graph": f"chain of {n:,} nodes", "forward_nodes": len(training.graph.node),
            "lowered_nodes": len(training.graph.node) + len(low.training_info[0].algorithm.node), "seconds": s}


# ---- output ------------------------------------------------------------------------------------------

def label(name: str) -> str:
    from .large_models import LARGE
    from .models import MODELS

    return MODELS[name][3] if name in MODELS else LARGE[name][7]


def ort_training_note() -> str:
    return ("onnxruntime-training: `pip download onnxruntime-training --no-deps` fetches 1.19.2 (2024, the last "
            "release, cp311 wheel); it ships its own `onnxruntime` package and would replace the project's "
            "onnxruntime, so it is not part of this benchmark.")


def _mem(r: dict) -> str:
    return " / ".join(f"{r[k]['peak_mb']:.0f} (+{r[k]['growth_mb']:.0f})" for k in ("ours", "torch", "forward"))


def markdown(results: list[dict], lowering: list[dict], meta: dict) -> str:
    lines = [f"float32, optimizer {meta['optimizer']} (small models), {meta['rounds']} interleaved rounds x "
             f"{meta['steps']} steps per configuration; {meta['when']}, load average at start/end "
             f"{meta['load_before']:.2f}/{meta['load_after']:.2f} on {os.cpu_count()} cores. A row marked noisy "
             "had load or foreign CPU above the limits (see docs/benchmarks.md): its ratios are not given.", "",
             "| model | threads | ours step ms | PyTorch step ms | ours/PyTorch | ORT forward ms | step/forward | "
             "load start→end, cores elsewhere | loss rel. diff step 1 / max of 3 | "
             "peak RSS MB ours / PyTorch / fwd (growth) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    for r in results:
        o, t, f, q = r["ours"], r["torch"], r["forward"], r["noise"]
        ratios = ((f"**{o['ms'] / t['ms']:.2f}**", f"**{o['ms'] / f['ms']:.2f}**") if not q["noisy"]
                  else ("noisy", "noisy"))
        lines.append(f"| {label(r['model'])} | {r['threads']} | {o['ms']:.2f} | {t['ms']:.2f} | {ratios[0]} | "
                     f"{f['ms']:.2f} | {ratios[1]} | {q['load_before']:.2f}→{q['load_after']:.2f}, "
                     f"{q['foreign_cores']:.2f} | {r['loss_diff_first']:.0e} / {r['loss_diff']:.0e} | {_mem(r)} |")
    large = [r for r in results if r.get("large")]
    if large:
        lines += ["", "Set-up of the real-size models in the `ours` worker (public API, one process): seconds and "
                  "RSS / peak RSS in MB after each stage; set-up = build (make_training_model of the path: the "
                  "rules checked) + session (TrainingSession, which lowers once).", "",
                  "| model | threads | load | build | session | first step | set-up s |",
                  "| --- | ---: | --- | --- | --- | --- | ---: |"]
        for r in large:
            st = {s["stage"]: s for s in r["ours"]["stages"]}
            cells = [f"{st[k]['s']:.1f} s, {st[k]['rss_mb']:.0f} / {st[k]['peak_mb']:.0f}" for k in
                     ("load", "build", "session", "first step")]
            setup = sum(st[k]["s"] for k in ("build", "session"))
            lines.append(f"| {label(r['model'])} | {r['threads']} | " + " | ".join(cells) + f" | {setup:.1f} |")
    small = [r for r in results if not r.get("large")]
    if small:
        lines += ["", "| model | lower s | nodes fwd/step |", "| --- | ---: | ---: |"]
        for r in small:
            if r["threads"] == small[0]["threads"]:
                lines.append(f"| {label(r['model'])} | {r['lower_s']:.2f} | {r['forward_nodes']}/{r['step_nodes']} |")
    if lowering:
        lines += ["", "| graph to lower | forward nodes | step nodes | lower() s |", "| --- | ---: | ---: | ---: |"]
        for row in lowering:
            lines.append(f"| {row['graph']} | {row['forward_nodes']:,} | {row['lowered_nodes']:,} | "
                         f"{row['seconds']:.2f} |")
    lines += ["", ort_training_note()]
    return "\n".join(lines) + "\n"


# The targets of issue 11: ours/PyTorch at most 1.0 (1.3 on ResNet-18), and a step at most 4 forwards.
VS_TORCH_TARGET = {"resnet18": 1.3}
STEP_FORWARD_TARGET = 4.0


def chart(results: list[dict], path: str) -> bool:
    """Grouped bars per (model, threads): ours/PyTorch and step/forward, each divided by its target, so
    the dashed line at 1 is the target for both. Noisy rows are left out. False if matplotlib is not
    installed (the `bench` extra)."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if not r["noise"]["noisy"]]
    if not rows:
        return False
    names = [f"{label(r['model']).split(' ')[0]} x{r['threads']}" for r in rows]
    vs_torch = [r["ours"]["ms"] / r["torch"]["ms"] / VS_TORCH_TARGET.get(r["model"], 1.0) for r in rows]
    vs_fwd = [r["ours"]["ms"] / r["forward"]["ms"] / STEP_FORWARD_TARGET for r in rows]
    xs = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows) + 2), 4.0))
    ax.bar(xs - 0.2, vs_torch, 0.4, label="(ours / PyTorch eager step time) / target (1.0; ResNet-18 1.3)")
    ax.bar(xs + 0.2, vs_fwd, 0.4, label=f"(our step / ORT forward) / {STEP_FORWARD_TARGET:g}")
    ax.axhline(1.0, color="k", linestyle="--", linewidth=1, label="at the target")
    ax.set_xticks(xs, names, rotation=20, ha="right")
    ax.set_xlabel("model x threads")
    ax.set_ylabel("ratio / target (lower is better)")
    ax.set_title("Training step against the targets: vs PyTorch eager, and vs the forward")
    ax.set_ylim(0, 1.4 * max(vs_torch + vs_fwd + [1.0]))  # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def parse_args(argv=None) -> argparse.Namespace:
    """The options, with --quick's and --tiny's defaults filled in; ``names`` and ``thread_counts`` parsed."""
    from .models import MODELS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 rounds x 5 steps, lowering timed once, --settle 20, "
                   "--retries 0, --max-wait 60; results go to benchmarks/out/ unless --out says otherwise")
    p.add_argument("--tiny", action="store_true", help="to see that it runs (CI's smoke test): the MLP at batch 8, "
                   "1 thread, 1 round x 2 steps, lowering a 100-node chain only, no waiting for the load; implies "
                   "--quick; its times mean nothing")
    p.add_argument("--models", default=",".join(SMALL),
                   help=f"comma-separated subset of {','.join(SMALL + LARGE_NAMES)} (real-size ones are opt-in)")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"], help="small models only (default sgd)")
    p.add_argument("--no-lowering", action="store_true", help="skip the lowering-time graphs")
    p.add_argument("--threads", default="2,1", help="thread counts, one row set each (default 2,1; "
                   "the 1-thread rows are the contention-free control)")
    p.add_argument("--max-load", type=float, default=1.0,
                   help="largest 1-minute load average at the start of a row (default 1.0); above it the row waits "
                   "(--settle), then is timed and marked noisy")
    p.add_argument("--max-foreign", type=float, default=0.25,
                   help="largest average number of cores other processes may keep busy during a row (default 0.25)")
    p.add_argument("--retries", type=int, default=None,
                   help="times a noisy row is timed again before it is marked noisy (default 2; 0 with --quick)")
    p.add_argument("--settle", type=float, default=None,
                   help="most seconds to wait for the load to drop to --max-load before each timing of a row (default "
                   "90: the 1-minute load average our own previous 2-thread row leaves, about 2, takes about 45 s to "
                   "fall below 1; 20 with --quick); then it times anyway and the row is marked noisy")
    p.add_argument("--max-wait", type=float, default=None,
                   help="most seconds the whole run waits for the load, summed over its rows (default: no bound "
                   "beyond --settle; 60 with --quick, 0 with --tiny); once spent, rows are timed at once")
    p.add_argument("--max-rss-gb", type=float, default=18.0, help="kill a worker whose RSS passes this (default 18)")
    p.add_argument("--out", default=None, help="directory for results.md/.json/.png "
                   "(default benchmarks/, or benchmarks/out/ with --quick)")
    args = p.parse_args(argv)
    args.quick = args.quick or args.tiny
    if args.tiny:
        args.models, args.threads = ("mlp" if args.models == ",".join(SMALL) else args.models), "1"
    for key, full, quick in (("retries", 2, 0), ("settle", 90.0, 20.0), ("max_wait", float("inf"), 60.0)):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    args.wait_left = 0.0 if args.tiny else args.max_wait
    args.names = [n for n in args.models.split(",") if n]
    unknown = [n for n in args.names if n not in MODELS and n not in LARGE_NAMES]
    if unknown:
        p.error(f"unknown models {unknown}; choose from {list(MODELS) + list(LARGE_NAMES)}")
    try:
        args.thread_counts = [int(t) for t in args.threads.split(",") if t]
    except ValueError:
        p.error(f"--threads {args.threads!r}: expected comma-separated integers such as 2,1")
    return args


def main(argv=None):
    args = parse_args(argv)
    names, thread_counts = args.names, args.thread_counts
    out = args.out or (os.path.join(HERE, "out") if args.quick else HERE)
    os.makedirs(out, exist_ok=True)
    stem = "results-large" if any(n in LARGE_NAMES for n in names) else "results"
    rounds, steps = (1, 2) if args.tiny else (3, 5) if args.quick else (7, 15)
    meta = {"threads": thread_counts, "optimizer": args.optimizer, "rounds": rounds, "steps": steps,
            "load_before": os.getloadavg()[0], "when": time.strftime("%Y-%m-%d %H:%M")}
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", file=sys.stderr, flush=True)
    results, failures = [], []
    with tempfile.TemporaryDirectory(prefix="oa-bench-") as workdir:
        for name in names:
            print(f"[{name}] export, training model ...", file=sys.stderr, flush=True)
            if name in LARGE_NAMES:
                prep = prepare_large(name, workdir)
                r_steps = (2, 2) if args.quick else (4, 3)
            else:
                prep = prepare(name, workdir, args.optimizer, 1 if args.quick else 3, 8 if args.tiny else BATCH)
                r_steps = (rounds, steps)
            for threads in thread_counts:
                print(f"[{name} x{threads}] timing ours / PyTorch / forward ...", file=sys.stderr, flush=True)
                try:
                    r = bench_model(name, prep, threads, *r_steps, args)
                except RuntimeError as e:  # one model's failure does not lose the others' rows
                    print(f"[{name} x{threads}] FAILED: {e}", file=sys.stderr, flush=True)
                    failures.append(f"{label(name)}, {threads} threads: {e}")
                    continue
                results.append({"model": name, "threads": threads, "large": name in LARGE_NAMES, **r,
                                **{k: prep[k] for k in ("lower_s", "forward_nodes", "step_nodes") if k in prep}})
    lowering = []
    if not args.no_lowering:
        print("[lowering] " + ("a 100-node chain" if args.tiny else "ResNet-50-shaped and synthetic chains") + " ...",
              file=sys.stderr, flush=True)
        lowering = bench_lowering(args.quick, args.optimizer, tiny=args.tiny)
    meta["load_after"] = os.getloadavg()[0]
    print(f"load average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", file=sys.stderr, flush=True)
    text = markdown(results, lowering, meta) + "".join(f"\nFailed: {f}\n" for f in failures)
    print(text)
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write("# Benchmark results\n\nWritten by `python -m benchmarks.run`; see docs/benchmarks.md.\n\n" + text)
    if results and not chart(results, os.path.join(out, stem + ".png")):
        print("no chart: matplotlib is not installed (pip install .[bench]) or every row was noisy", file=sys.stderr)
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump({"meta": meta, "models": results, "lowering": lowering}, f, indent=1)


if __name__ == "__main__":
    main()
