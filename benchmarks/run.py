"""Training-step benchmarks against PyTorch, and lowering time.

    python -m benchmarks.run [--quick] [--models mlp,cnn,transformer,resnet18] [--optimizer sgd|adam]

For each model (batch 64, float32, 2 threads) three configurations run in their own processes on the
same weights and inputs: our training step (torch.onnx.export -> training model -> lower ->
TrainingSession.step), PyTorch eager (forward, cross entropy, backward, optimizer step) and the
forward pass alone in onnxruntime. The processes are driven in interleaved rounds, so a burst of load
from elsewhere hits all three alike; each number is the median over all steps. Then lowering time:
each model, a ResNet-50-shaped graph and synthetic chains of 1,000 / 3,000 / 10,000 nodes.
Writes benchmarks/results.md and benchmarks/results.png and prints the table.
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
import time
import warnings

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

if __package__ in (None, ""):  # python benchmarks/run.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

from benchmarks.training_model import inference_only, make_training_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BATCH = 64
LR = {"sgd": 0.01, "adam": 1e-3}


# ---- preparing a model -------------------------------------------------------------------------------

def export(module, x) -> onnx.ModelProto:
    """TorchScript export at opset 17; models with BatchNorm in training mode (batch statistics, as
    torch's train()), the others in eval mode (no Dropout nodes: dropout is 0 everywhere)."""
    import torch

    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in module.modules())
    mode = torch.onnx.TrainingMode.TRAINING if has_bn else torch.onnx.TrainingMode.EVAL
    module.train(has_bn)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), buf, dynamo=False, opset_version=17, input_names=["x"],
                          output_names=["logits"], training=mode, do_constant_folding=True)
    return onnx.load_from_string(buf.getvalue())


def timed(fn, repeats: int):
    """(median seconds, last result) of ``repeats`` calls."""
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def prepare(name: str, workdir: str, optimizer: str, lower_repeats: int) -> dict:
    import torch

    from onnx_autodiff import lower

    from .models import MODELS, build

    _, shape, classes, _ = MODELS[name]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, *shape)).astype(np.float32)
    labels = rng.integers(0, classes, BATCH).astype(np.int64)
    data = os.path.join(workdir, f"{name}.npz")
    np.savez(data, x=x, labels=labels)
    module = build(name)
    state = os.path.join(workdir, f"{name}.pt")
    torch.save(module.state_dict(), state)
    inference = export(module, torch.from_numpy(x))
    training = make_training_model(inference, "logits", optimizer, LR[optimizer])
    lower_s, lowered = timed(lambda: lower(training), lower_repeats)
    paths = {"lowered": os.path.join(workdir, f"{name}.lowered.onnx"),
             "inference": os.path.join(workdir, f"{name}.inference.onnx")}
    onnx.save(lowered, paths["lowered"])
    onnx.save(inference_only(inference), paths["inference"])
    n_backward = len(lowered.training_info[0].algorithm.node)
    return {"data": data, "state_dict": state, **paths, "lower_s": lower_s,
            "forward_nodes": len(inference.graph.node), "step_nodes": len(inference.graph.node) + n_backward}


# ---- driving the workers -----------------------------------------------------------------------------

class Worker:
    def __init__(self, cfg: dict):
        self.kind = cfg["kind"]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS=os.environ.get("BENCH_THREADS", "2"))
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.worker", json.dumps(cfg)], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.times: list[float] = []

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.kind} worker died (exit code {self.proc.wait()})")
        return line

    def wait_ready(self):
        line = self._line()
        while not line.startswith("ready"):
            line = self._line()
        self.losses = json.loads(line[len("ready"):])

    def run(self, n: int):
        self.proc.stdin.write(f"run {n}\n")
        self.proc.stdin.flush()
        self.times += json.loads(self._line())

    def quit(self) -> dict:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        mem = json.loads(self._line())
        self.proc.wait()
        return mem


def bench_model(name: str, prep: dict, optimizer: str, rounds: int, steps: int) -> dict:
    common = {"model": name, "optimizer": optimizer, "lr": LR[optimizer], **prep}
    workers = [Worker({**common, "kind": k}) for k in ("ours", "torch", "forward")]
    for w in workers:  # one at a time: set-up (session creation) should not overlap another's timing
        w.wait_ready()
    for r in range(rounds):
        order = workers[r % 3:] + workers[:r % 3]
        for w in order:
            time.sleep(0.2)  # let the previous process's spinning threads go idle
            w.run(steps)
    result = {}
    for w in workers:
        mem = w.quit()
        result[w.kind] = {"ms": 1e3 * statistics.median(w.times), "n": len(w.times), "losses": w.losses, **mem}
    ours, ref = result["ours"]["losses"], result["torch"]["losses"]
    result["loss_diff"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, ref))
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


def bench_lowering(quick: bool, optimizer: str) -> list[dict]:
    import torch

    from onnx_autodiff import lower

    from .models import RESNET50, build

    rows = []
    repeats = 1 if quick else 3
    module = build("resnet50")
    inference = export(module, torch.zeros(BATCH, *RESNET50[1]))
    training = make_training_model(inference, "logits", optimizer, LR[optimizer])
    for check in (True, False):
        s, low = timed(lambda: lower(training, check=check), repeats)
        rows.append({"graph": RESNET50[3] + ("" if check else ", check=False"), "forward_nodes": len(inference.graph.node),
                     "lowered_nodes": len(inference.graph.node) + len(low.training_info[0].algorithm.node),
                     "seconds": s})
    for n in (1000, 3000, 10000):
        training = make_training_model(chain_model(n), "logits", optimizer, LR[optimizer])
        s, low = timed(lambda: lower(training), 1 if (quick or n == 10000) else repeats)
        rows.append({"graph": f"chain of {n:,} nodes", "forward_nodes": len(training.graph.node),
                     "lowered_nodes": len(training.graph.node) + len(low.training_info[0].algorithm.node),
                     "seconds": s})
    return rows


# ---- output ------------------------------------------------------------------------------------------

def ort_training_note() -> str:
    return ("onnxruntime-training: `pip download onnxruntime-training --no-deps` fetches 1.19.2 (2024, the last "
            "release, cp311 wheel); it ships its own `onnxruntime` package and would replace onnxruntime 1.31 in "
            "this venv, so it is not part of this benchmark.")


def markdown(results: dict, lowering: list[dict], meta: dict) -> str:
    from .models import MODELS

    lines = [f"Batch {BATCH}, float32, {meta['threads']} threads, optimizer {meta['optimizer']}, {meta['rounds']} interleaved rounds x "
             f"{meta['steps']} steps per configuration; {meta['when']}, load average before/after "
             f"{meta['load_before']:.1f}/{meta['load_after']:.1f}.", "",
             "| model | ours step ms | PyTorch step ms | ours/PyTorch | ORT forward ms | step/forward | "
             "lower s | nodes fwd/step | loss rel. diff (3 steps) | peak RSS MB ours / PyTorch / fwd (growth) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, r in results.items():
        o, t, f = r["ours"], r["torch"], r["forward"]
        mem = " / ".join(f"{x['peak_mb']:.0f} (+{x['growth_mb']:.0f})" for x in (o, t, f))
        lines.append(f"| {MODELS[name][3]} | {o['ms']:.2f} | {t['ms']:.2f} | **{o['ms'] / t['ms']:.2f}** | "
                     f"{f['ms']:.2f} | **{o['ms'] / f['ms']:.2f}** | {r['lower_s']:.2f} | "
                     f"{r['forward_nodes']}/{r['step_nodes']} | {r['loss_diff']:.1e} | {mem} |")
    if lowering:
        lines += ["", "| graph to lower | forward nodes | step nodes | lower() s |", "| --- | ---: | ---: | ---: |"]
        for row in lowering:
            lines.append(f"| {row['graph']} | {row['forward_nodes']:,} | {row['lowered_nodes']:,} | {row['seconds']:.2f} |")
    lines += ["", ort_training_note()]
    return "\n".join(lines) + "\n"


def load_average() -> float:
    return os.getloadavg()[0]


def main(argv=None):
    from .models import MODELS
    from .png import bar_chart

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer rounds and steps, lowering timed once")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    p.add_argument("--no-lowering", action="store_true", help="skip the lowering-time graphs")
    p.add_argument("--threads", type=int, default=2, help="threads for torch and onnxruntime (default 2)")
    p.add_argument("--out", default=HERE, help="directory for results.md and results.png")
    args = p.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    rounds, steps = (3, 5) if args.quick else (7, 15)
    os.environ["BENCH_THREADS"] = str(args.threads)
    meta = {"threads": args.threads, "optimizer": args.optimizer, "rounds": rounds, "steps": steps, "load_before": load_average(),
            "when": time.strftime("%Y-%m-%d %H:%M")}
    results = {}
    with tempfile.TemporaryDirectory(prefix="oa-bench-") as workdir:
        for name in names:
            print(f"[{name}] export, training model, lower ...", file=sys.stderr, flush=True)
            prep = prepare(name, workdir, args.optimizer, 1 if args.quick else 3)
            print(f"[{name}] timing ours / PyTorch / forward ...", file=sys.stderr, flush=True)
            r = bench_model(name, prep, args.optimizer, rounds, steps)
            results[name] = {**r, "lower_s": prep["lower_s"], "forward_nodes": prep["forward_nodes"],
                             "step_nodes": prep["step_nodes"]}
    lowering = []
    if not args.no_lowering:
        print("[lowering] ResNet-50-shaped and synthetic chains ...", file=sys.stderr, flush=True)
        lowering = bench_lowering(args.quick, args.optimizer)
    meta["load_after"] = load_average()
    text = markdown(results, lowering, meta)
    print(text)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("# Benchmark results\n\nWritten by `python -m benchmarks.run`; see docs/benchmarks.md.\n\n" + text)
    if results:
        groups = [(n, [r["ours"]["ms"] / r["torch"]["ms"], r["ours"]["ms"] / r["forward"]["ms"] / 3.0])
                  for n, r in results.items()]
        with open(os.path.join(args.out, "results.png"), "wb") as f:
            f.write(bar_chart(groups, targets=[0.8, 1.0]))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "models": results, "lowering": lowering}, f, indent=1)


if __name__ == "__main__":
    main()
