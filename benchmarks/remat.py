"""Rematerialization under a memory budget on BERT-base: peak RSS and step time of the plain step, the step
under budgets, PyTorch eager and PyTorch with ``torch.utils.checkpoint`` per layer, each in its own process.

``python -m benchmarks.remat --batch 32 --seq 128 --budgets 1 5.6GB`` (heavy: wrap it in ``flock /tmp/heavy.lock``).
Ours takes the docs' path (``make_training_model("bert.onnx", memory_budget=...)`` -> ``TrainingSession``)
unless ``--path lean``. ``--tiny``: a 2-layer BERT of width 32, to see that it runs (CI's smoke test).
Every system starts from the same random weights (BertForSequenceClassification, dropout 0, seed 0) and
the same batch, trains with Adam at 2 threads, runs ``--steps`` timed steps after a warm-up step, and
reports the peak RSS (VmHWM) of its training steps (reset after the set-up, which has its own peak: lowering
and loading) and the median and 90th-percentile step. The budgets' gradients are held
against the plain step's through Adam's first moment after the first step, which is 0.1 x the gradient.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from .worker import THREADS, ort_options, peak_mb, rss_mb, torch_step


def build_bert(model: str):
    """BERT-base (``bert``), a 2-layer BERT of width 32 (``bert-tiny``, benchmarks/large_models.py), or a 4-layer
    BERT (hidden 256, 4 heads, vocabulary 1000: ``bert-small``): the same graph at a size a shared machine runs in
    seconds, where the budget's effect shows the same way."""
    import torch

    from .large_models import Logits, build_large

    if model != "bert-small":
        return build_large(model)
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=SMALL_VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                     intermediate_size=1024, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return Logits(BertForSequenceClassification(cfg))


SMALL_VOCAB = 1000


def prepare(workdir: str, batch: int, seq: int, model: str = "bert") -> dict:
    import onnx
    import torch

    from .large_models import VOCAB
    from .run import export

    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB.get(model, SMALL_VOCAB), (batch, seq)).astype(np.int64)
    labels = rng.integers(0, 2, batch).astype(np.int64)
    module = build_bert(model)
    np.savez(os.path.join(workdir, "data.npz"), x=x, labels=labels)
    torch.save(module.state_dict(), os.path.join(workdir, "bert.pt"))
    path = os.path.join(workdir, "bert.onnx")
    onnx.save(export(module, torch.from_numpy(x), constant_folding=False, dynamic_batch=True), path)
    return {"workdir": workdir, "inference": path, "batch": batch, "model": model}


def worker_ours(cfg: dict, data: dict):
    from onnx_autodiff import MemoryBudget, TrainingSession, make_training_model
    from onnx_autodiff.model.carrier import open_model
    from onnx_autodiff.passes.remat import remat_summary
    from onnx_autodiff.training import build_training_model

    budget = MemoryBudget(cfg["budget"], {"batch": cfg["batch"]}) if cfg.get("budget") is not None else None
    if cfg.get("path") == "lean":  # the carrier itself, never a ModelProto
        training = build_training_model(open_model(cfg["inference"]), "cross_entropy", "adam", lr=1e-4,
                                        memory_budget=budget)
    else:  # the docs' path: the model's path in, a ModelProto out
        training = make_training_model(cfg["inference"], "cross_entropy", "adam", lr=1e-4, memory_budget=budget)
    import onnxruntime as ort

    options = ort_options()
    options.enable_cpu_mem_arena = not cfg.get("no_arena")  # without it RSS follows the live tensors
    # onnxruntime's default order is a depth-first walk back from the outputs, which runs the weight
    # gradients late and keeps their activations (original or recomputed) alive; the priority-based order
    # runs the nodes in the model's own order, the one the remat plan was estimated on
    orders = {"priority": ort.ExecutionOrder.PRIORITY_BASED, "default": ort.ExecutionOrder.DEFAULT}
    options.execution_order = orders[cfg.get("order") or "priority"]
    sess = TrainingSession(training, session_options=options, progress=False)
    del training
    feeds = {"x": data["x"], "labels": data["labels"]}
    first = sess.step(feeds)
    moments = {k: sess.state[k].copy() for k in sess.state if k.endswith(".exp_avg")}
    return (lambda: sess.step(feeds)), float(np.asarray(first[sess.loss_name])), moments, \
        remat_summary(sess.model) or ""


def worker_torch(cfg: dict, data: dict):
    import torch

    torch.set_num_threads(THREADS)
    model = build_bert(cfg.get("model", "bert"))
    model.load_state_dict(torch.load(os.path.join(cfg["workdir"], "bert.pt")))
    if cfg["kind"] == "torch-checkpoint":  # torch.utils.checkpoint around every encoder layer
        model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, eps=1e-8)
    x, labels = torch.from_numpy(data["x"]), torch.from_numpy(data["labels"])
    step = torch_step(model, opt, x, labels)
    first = step()
    return step, first, {}, ""


def worker(cfg: dict) -> dict:
    with np.load(os.path.join(cfg["workdir"], "data.npz")) as f:
        data = {k: f[k] for k in f.files}
    baseline = rss_mb()
    t = time.perf_counter()
    step, first_loss, moments, summary = (worker_torch if cfg["kind"].startswith("torch") else worker_ours)(cfg, data)
    setup = time.perf_counter() - t
    setup_peak = peak_mb()
    out = {}
    plain = os.path.join(cfg["workdir"], "plain_moments.npz")
    if moments and cfg.get("budget") is None and cfg.get("order") == "priority":
        np.savez(plain, **{k.replace("/", "|"): v for k, v in moments.items()})
    elif moments:
        out["grad_rel"] = _relative_difference(moments, plain)
    del moments  # 440 MB of copies (BERT-base): not the steps' memory
    _reset_peak()  # from here VmHWM is the training steps' peak, not the set-up's (lowering, loading)
    step()
    times, cpu = [], []
    for _ in range(cfg["steps"]):
        t, c = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    out |= {"kind": cfg["kind"], "budget": cfg.get("budget"), "order": cfg.get("order"), "peak_mb": peak_mb(),
           "setup_peak_mb": setup_peak,
           "baseline_mb": baseline,
           "setup_s": setup, "first_loss": first_loss, "median_s": statistics.median(times),
           "median_cpu_s": statistics.median(cpu), "load": os.getloadavg()[0],
           "p90_s": float(np.percentile(times, 90)), "summary": summary}
    return out


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: resets the peak RSS (VmHWM) to the current RSS


def _relative_difference(moments: dict, plain_path: str) -> float:
    """max |m - m_plain| / max |m_plain| over every parameter (Adam's first moment after one step is 0.1 x the
    gradient). Global, not per tensor: a gradient that is zero but for rounding (BERT's key bias: softmax
    ignores a per-query constant) has no relative accuracy of its own."""
    diff = scale = 0.0
    with np.load(plain_path) as f:
        for k, v in moments.items():
            ref = f[k.replace("/", "|")]
            diff = max(diff, float(np.abs(v - ref).max()))
            scale = max(scale, float(np.abs(ref).max()))
    return diff / scale


def run_one(cfg: dict) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, "-m", "benchmarks.remat", "--worker", json.dumps(cfg)], capture_output=True,
                       text=True, env=env)
    if p.returncode:
        raise RuntimeError(f"{cfg['kind']} {cfg.get('budget')}: exit {p.returncode}\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict], args) -> str:
    plain = next(r for r in rows if r["kind"] == "ours" and r["budget"] is None and r["order"] == "priority")
    title = {"bert": "BERT-base", "bert-small": "BERT 4 layers x 256"}.get(args.model, "tiny BERT")
    lines = [f"{title}, batch {args.batch} x {args.seq}, Adam, {THREADS} threads, {args.steps} timed steps, "
             f"ours on the {args.path} path",
             "", "| system | step peak RSS MB | / plain | set-up peak MB | median step s | / plain | p90 s | set-up s "
             "| grads vs plain | step CPU s | / plain | load |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = r["kind"] if r["kind"] != "ours" else f"ours, budget {r['budget'] or 'none'}, {r['order']} order"
        grads = f"{r['grad_rel']:.1e}" if "grad_rel" in r else ""
        lines.append(f"| {name} | {r['peak_mb']:.0f} | {r['peak_mb'] / plain['peak_mb']:.2f} | "
                     f"{r['setup_peak_mb']:.0f} | {r['median_s']:.2f} | "
                     f"{r['median_s'] / plain['median_s']:.2f} | {r['p90_s']:.2f} | {r['setup_s']:.1f} | {grads} | "
                     f"{r['median_cpu_s']:.2f} | {r['median_cpu_s'] / max(plain['median_cpu_s'], 1e-9):.2f} | "
                     f"{r['load']:.1f} |")
    lines += [""] + [f"- {r['summary']}" for r in rows if r["summary"]]
    lines += [f"- {line}" for line in estimate_lines(rows, plain)]
    return "\n".join(lines)


def estimate_lines(rows: list[dict], plain: dict) -> list[str]:
    """The plan's estimates (the summary's ``estimated peak A -> B``: the plain step, the plan) against the
    measured step peaks (MiB here, GB = 1e9 bytes there)."""
    out = []
    for r in rows:
        m = re.search(r"estimated peak ([0-9.]+) (GB|MB) -> ([0-9.]+) (GB|MB)", r["summary"] or "")
        if not m:
            continue
        scale = {"GB": 1e9, "MB": 1e6}
        plain_est, plan_est = (float(m.group(i)) * scale[m.group(i + 1)] / 2**20 for i in (1, 3))
        out.append(f"estimate / measured, budget {r['budget']}: plain step {plain_est:.0f} / {plain['peak_mb']:.0f} "
                   f"MiB = {plain_est / plain['peak_mb']:.2f}, planned step {plan_est:.0f} / {r['peak_mb']:.0f} MiB "
                   f"= {plan_est / r['peak_mb']:.2f}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", choices=["bert", "bert-small", "bert-tiny"], default="bert",
                   help="BERT-base; a 4-layer BERT of width 256 that runs in seconds and shows the budget's effect; "
                        "or a 2-layer BERT of width 32 (benchmarks/large_models.py) to see that it runs")
    p.add_argument("--tiny", action="store_true", help="--model bert-tiny --batch 4 --seq 16 --steps 2 "
                   "(CI's smoke test; its numbers mean nothing)")
    p.add_argument("--batch", type=int, default=32, help="sequences per batch")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up step")
    p.add_argument("--budgets", nargs="*", default=["1"], help="memory budgets (sizes) to run besides the plain step")
    p.add_argument("--no-torch", action="store_true", help="leave out PyTorch eager and PyTorch with checkpointing")
    p.add_argument("--no-arena", action="store_true", help="ours without onnxruntime's CPU memory arena")
    p.add_argument("--path", choices=["docs", "lean"], default="docs",
                   help="ours: make_training_model(path) -> TrainingSession(model) as the docs show (default), or "
                        "the carrier itself: open_model -> build_training_model -> TrainingSession")
    p.add_argument("--max-ratio", type=float,
                   help="exit 1 when a budgeted step's peak RSS is above this times the plain step's (CI)")
    p.add_argument("--default-order", action="store_true",
                   help="also run the plain step in onnxruntime's default execution order (the others: priority-based)")
    args = p.parse_args(argv)
    if args.tiny:
        args.model, args.batch, args.seq, args.steps = "bert-tiny", 4, 16, 2
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="remat-bench-") as workdir:
        base = {**prepare(workdir, args.batch, args.seq, args.model), "steps": args.steps, "no_arena": args.no_arena,
                "path": args.path}
        kinds = [("ours", None, "priority")] + [("ours", b, "priority") for b in args.budgets]
        if not args.no_torch:
            kinds += [("torch", None, None), ("torch-checkpoint", None, None)]
        if args.default_order:
            kinds.append(("ours", None, "default"))
        rows = []
        for kind, budget, order in kinds:
            rows.append(run_one({**base, "kind": kind, "budget": budget, "order": order}))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(markdown(rows, args))
    plain = rows[0]["peak_mb"]
    over = [r for r in rows if r["kind"] == "ours" and r["budget"] is not None and r["order"] == "priority"
            and args.max_ratio is not None and r["peak_mb"] > args.max_ratio * plain]
    if over:
        sys.exit(f"budget {over[0]['budget']}: peak {over[0]['peak_mb']:.0f} MB is above {args.max_ratio} x the plain "
                 f"step's {plain:.0f} MB")


if __name__ == "__main__":
    main()
