"""The public path, timed as a user's loop runs it (issue 21).

    python -m benchmarks.public_path [--models mlp,cnn,transformer] [--bert] [--steps 200] [--rounds 3]

``--models`` also takes issue 38's real-size pair, slow and not in the default: ``resnet18`` (ResNet-18, batch 32,
3x64x64, 10 classes) and ``gpt2s`` (GPT-2 small with its LM head, random weights, 4 x 128 tokens, next-token
cross entropy); ``resnet18-tiny`` and ``gpt2s-tiny`` are their graphs at a size for the smoke test.

Every run is its own process and does the whole path, with no pause between steps:

* **ours** (the docs' path): ``make_training_model("model.onnx", "cross_entropy", "adam")`` ->
  ``TrainingSession(training_model, session_options=so)`` (user-style options: ``intra_op_num_threads``
  only) -> ``sess.step({"x": x, "labels": labels})`` back to back, numpy in and out;
* **proto**: the same from a ModelProto the user keeps: ``onnx.load`` -> ``make_training_model(model, ...)``;
* **lean**: ``open_model`` -> ``build_training_model`` -> ``TrainingSession`` on the carrier (no ModelProto),
  the same steps (for the per-stage RSS comparison);
* **torch**: PyTorch eager on the same weights and batch: ``zero_grad``, forward, cross entropy,
  ``backward``, ``Adam.step``, ``loss.item()``;
* **onnxsim** (the peer, when ``onnxsim`` is importable: 0.8.1 measured): ``onnxsim.compile_torch_training_loop``
  on the same module with cross entropy inside it and the same weights, ``loop({"x": x, "y": labels}, lr)``: its
  own backward and Adam in one onnxruntime session (its ``Runner``: onnxruntime's default thread count, graph
  optimizations off, spinning on; ``--threads`` does not reach it). A model it cannot build (BatchNorm) is
  reported as such, not timed;
* **machine**: no model, the machine's own noise: a fixed numpy workload (float32 products of 256 x 256
  matrices at the same thread count) as long as PyTorch's step in the same round. Its p90/median is the
  spread that any step of that length gets from the machine (a shared host: other tenants' work does
  not show in the load average); when it is above the target, no system's spread can be judged.

The ``ours`` process then times the model's own inference forward and counts the FLOPs of its products and of
our step model (``benchmarks/path_forward.py``): step / forward beside the FLOPs' ratio, issue 38's bound.

The processes run interleaved (ours, torch, lean, ours, torch, lean...), one at a time. Each records
every step's time and the RSS and peak RSS (``VmHWM``) after each stage. Step statistics pool the
steps after ``--warmup`` over all processes of a system: median, 90th percentile, p90/median, and
the ratios to PyTorch's; "per process" is the p90/median within each process, the median over them. Issue
38's verdict also gives each round's ratio (a process's median step over PyTorch's in the same round) and in how
many rounds the target held: PyTorch's own step moves between runs on this VM, so one pooled ratio is not a result.
The 1-minute load average is read around every process; a model whose runs saw a load above
``--max-load`` is marked noisy. Writes public_path.md / public_path.json to
``--out`` (default benchmarks/out/, untracked).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

if __package__ in (None, ""):  # python benchmarks/public_path.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

from benchmarks.path_forward import FORWARD_TARGET, against_forward, forward_report, forward_table  # noqa: E402
from benchmarks.worker import Stages, peak_mb, rss_mb, torch_step  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BATCH = 64
LR = 1e-3  # make_training_model's default for Adam; torch uses the same
KINDS = ("ours", "torch", "proto", "lean", "onnxsim", "machine")  # machine after torch: it copies its step length
# issue 38's targets for the docs' path: median step / PyTorch eager's (and the MLP ahead of the peer onnxsim)
TARGETS_38 = {"mlp": 0.55, "cnn": 0.8, "transformer": 0.8, "resnet18": 0.8, "gpt2s": 0.8}
# issue 38's batches where they are not BATCH: ResNet-18 at 32, the GPT-2 LM at 4 x 128 tokens
BATCHES = {"resnet18": 32, "resnet18-tiny": 4, "gpt2s": 4, "gpt2s-tiny": 2}
# issue 21's targets for the docs' path: median step / PyTorch eager's, and p90 / median
TARGETS = {"mlp": 1.0, "transformer": 1.0, "cnn": 1.2}
SPREAD_TARGET = 1.2
PEAK_TARGET, SETUP_TARGET = 1.1, 10.0  # BERT-base: peak RSS / PyTorch eager's, and set-up seconds


def _tiny():
    from torch import nn

    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))


TINY = (_tiny, (16,), 4, "tiny MLP 16-8-4")  # for the unit test


def spec(name: str) -> tuple:
    """(constructor, sample shape, classes, label, batch, language model?) of a model other than BERT. A language
    model takes token ids [batch, T] and its labels are the next tokens, [batch * T] (classes: the vocabulary)."""
    from .models import LMS, MODELS, PATH_ONLY

    batch = BATCHES.get(name, BATCH)
    if name in LMS:
        ctor, seq, vocab, lab = LMS[name]
        return ctor, (seq,), vocab, f"{lab} {batch}x{seq} tokens", batch, True
    ctor, shape, classes, lab = TINY if name == "tiny" else {**MODELS, **PATH_ONLY}[name]
    return ctor, shape, classes, lab + (f", batch {batch}" if batch != BATCH else ""), batch, False


def build_module(name: str):
    import torch

    if name == "bert":
        from .large_models import build_large

        return build_large(name)
    torch.manual_seed(0)
    return spec(name)[0]()


# ---- one run, in its own process -------------------------------------------------------------------

# ``--spin``: the thread pool spins during a run and stops at its end (the step turns spinning off unless the user's
# options say otherwise: driver/runs.py, SESSION_CONFIG); onnxsim's one session spins by onnxruntime's default
SPIN = {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"}


def _user_options(threads: int, spin: bool = False):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    for key, value in (SPIN.items() if spin else ()):
        so.add_session_config_entry(key, value)
    return so


def setup_ours(cfg: dict, x, labels, stages: Stages):
    from onnx_autodiff import TrainingSession, make_training_model

    stages.mark("load")  # nothing to load: make_training_model reads the path
    training_model = make_training_model(cfg["inference"], "cross_entropy", "adam")
    stages.mark("build")
    sess = TrainingSession(training_model, session_options=_user_options(cfg["threads"], cfg.get("spin", False)))
    stages.mark("session")
    feeds = {"x": x, "labels": labels}
    cfg["_keep"], cfg["_session"] = training_model, sess  # a user's script still holds it
    return lambda: float(sess.step(feeds)[sess.loss_name])


def setup_proto(cfg: dict, x, labels, stages: Stages):
    import onnx

    from onnx_autodiff import TrainingSession, make_training_model

    model = onnx.load(cfg["inference"])
    stages.mark("load")
    training_model = make_training_model(model, "cross_entropy", "adam")
    stages.mark("build")
    sess = TrainingSession(training_model, session_options=_user_options(cfg["threads"], cfg.get("spin", False)))
    stages.mark("session")
    feeds = {"x": x, "labels": labels}
    cfg["_keep"] = (model, training_model)  # a user's script still holds both
    return lambda: float(sess.step(feeds)[sess.loss_name])


def setup_lean(cfg: dict, x, labels, stages: Stages):
    from onnx_autodiff import TrainingSession
    from onnx_autodiff.model.carrier import open_model
    from onnx_autodiff.training import build_training_model

    light = open_model(cfg["inference"])
    stages.mark("load")
    training_model = build_training_model(light, "cross_entropy", "adam")
    stages.mark("build")
    sess = TrainingSession(training_model, session_options=_user_options(cfg["threads"], cfg.get("spin", False)))
    stages.mark("session")
    feeds = {"x": x, "labels": labels}
    cfg["_keep"] = (light, training_model)
    return lambda: float(sess.step(feeds)[sess.loss_name])


def setup_torch(cfg: dict, x, labels, stages: Stages):
    import torch

    torch.set_num_threads(cfg["threads"])
    model = build_module(cfg["model"])
    model.load_state_dict(torch.load(cfg["state_dict"]))
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x, labels = torch.from_numpy(x), torch.from_numpy(labels)
    stages.mark("session")
    return torch_step(model, opt, x, labels)


def setup_machine(cfg: dict, x, labels, stages: Stages):
    a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    reps = 1
    for _ in range(3):  # scale the repetitions until a step takes about as long as PyTorch's
        t = time.perf_counter()
        for _ in range(5 * reps):
            a @ a
        reps = max(1, round(reps * cfg["target_ms"] / 1e3 / ((time.perf_counter() - t) / 5)))
    stages.mark("session")

    def step():
        for _ in range(reps):
            a @ a
        return float("nan")
    return step


def setup_onnxsim(cfg: dict, x, labels, stages: Stages):
    """The peer: onnxsim's torch.compile-styled loop (its own backward and Adam, one onnxruntime session)."""
    import onnxsim
    import torch
    from onnxsim.torch_training import export_torch_module_to_onnx

    torch.set_num_threads(cfg["threads"])
    model = build_module(cfg["model"])
    model.load_state_dict(torch.load(cfg["state_dict"]))
    stages.mark("load")

    class WithLoss(torch.nn.Module):
        """Cross entropy as ops onnxsim differentiates (it has no rule for SoftmaxCrossEntropyLoss or
        LogSoftmax): softmax, log, and the one-hot labels."""

        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, x, one_hot):
            p = torch.softmax(self.module(x), dim=1)
            return -(torch.log(p) * one_hot).sum(dim=1).mean()

    classes = spec(cfg["model"])[2]
    one_hot = np.zeros((len(labels), classes), np.float32)  # the batch's labels as the loss reads them (not
    one_hot[np.arange(len(labels)), labels] = 1.0  # np.eye(classes)[labels]: 10 GB at GPT-2's vocabulary)
    module = WithLoss(model)
    exported = export_torch_module_to_onnx(module, (torch.from_numpy(x), torch.from_numpy(one_hot)),
                                           output_names=("loss",))
    constants_as_initializers(exported)  # its backward has no rule for a Constant node (ReduceSum's axes)
    loop = onnxsim.compile_training_loop(exported, "loss", [n for n, _ in module.named_parameters()])
    stages.mark("build")
    names = [i.name for i in loop.model.graph.input][:2]  # the data and the labels, in forward's order
    feeds = dict(zip(names, (x, one_hot)))
    loop.step_graph  # noqa: B018  (compiles: the onnxruntime session)
    cfg["_loop"] = loop  # benchmarks.profile_peer reads its session
    stages.mark("session")
    return lambda: float(loop(feeds, lr=LR))


def constants_as_initializers(model) -> None:
    """In place: every Constant node of ``model.graph`` becomes an initializer of the same name."""
    from onnx import helper, numpy_helper

    g = model.graph
    constants = [n for n in g.node if n.op_type == "Constant"]
    for n in constants:
        a = n.attribute[0]
        value = helper.get_attribute_value(a)
        if a.name == "value":
            value = numpy_helper.to_array(value)
        value = np.asarray(value, np.int64 if a.name.startswith("value_int") else None)
        g.initializer.append(numpy_helper.from_array(value, n.output[0]))
    keep = [n for n in g.node if n.op_type != "Constant"]
    del g.node[:]
    g.node.extend(keep)


def default_kinds() -> tuple[str, ...]:
    """Every system, the peer only where onnxsim is installed."""
    import importlib.util

    return tuple(k for k in KINDS if k != "onnxsim" or importlib.util.find_spec("onnxsim") is not None)


def child(cfg: dict) -> dict:
    """Set up one system and run its steps back to back; the report as a dict."""
    if cfg["kind"] in ("torch", "onnxsim"):
        import torch  # noqa: F401  (the runtime's own size is the baseline, as in benchmarks.worker)
    else:
        import onnxruntime  # noqa: F401

        import onnx_autodiff  # noqa: F401
    with np.load(cfg["data"]) as f:
        x, labels = f["x"], f["labels"]
    baseline = rss_mb()
    stages = Stages()
    stages.mark("imports")  # the runtime itself (torch, or onnxruntime and onnx_autodiff) and the batch
    setup = {"ours": setup_ours, "proto": setup_proto, "lean": setup_lean, "torch": setup_torch,
             "onnxsim": setup_onnxsim, "machine": setup_machine}[cfg["kind"]]
    step = setup(cfg, x, labels, stages)
    times, losses = [], []
    for _ in range(cfg["steps"]):
        t = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t)
        losses.append(loss)
    stages.mark("steps")
    report = {"kind": cfg["kind"], "baseline_mb": baseline, "peak_mb": peak_mb(), "stages": stages.rows,
              "times": times, "losses": losses[:3]}
    if cfg["kind"] == "ours":  # after the peak is read: the forward's session is not the step's memory
        report.update(forward_report(cfg, _user_options(cfg["threads"], cfg.get("spin", False)), x, labels))
    return report


# ---- the driver ------------------------------------------------------------------------------------

def prepare(name: str, workdir: str) -> dict:
    """The batch, the state dict and the exported inference model on disk, shared by every run."""
    import onnx
    import torch

    from .run import _save_inputs, export, prepare_large

    if name == "bert":
        return prepare_large(name, workdir)
    _, shape, classes, _, batch, lm = spec(name)
    rng = np.random.default_rng(0)
    if lm:  # next-token labels: the sequence shifted by one
        tokens = rng.integers(0, classes, (batch, shape[0] + 1)).astype(np.int64)
        x, labels = np.ascontiguousarray(tokens[:, :-1]), tokens[:, 1:].reshape(-1)
    else:
        x = rng.standard_normal((batch, *shape)).astype(np.float32)
        labels = rng.integers(0, classes, batch).astype(np.int64)
    module = build_module(name)
    data, state = _save_inputs(name, workdir, x, labels, module)
    path = os.path.join(workdir, f"{name}.inference.onnx")
    onnx.save(export(module, torch.from_numpy(x)), path)
    return {"data": data, "state_dict": state, "inference": path}


def run_one(cfg: dict, max_rss_mb: float) -> dict:
    """One run in a fresh process (killed if its RSS passes ``max_rss_mb``: the machine is shared)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS=str(cfg["threads"]), HF_HUB_OFFLINE="1")
    load = os.getloadavg()[0]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.public_path", "--child", json.dumps(cfg)],
                                cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
        killed = None
        while proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    rss = next((int(s.split()[1]) / 1024 for s in f if s.startswith("VmRSS:")), 0.0)
            except (FileNotFoundError, ProcessLookupError):
                rss = 0.0
            if rss > max_rss_mb:
                killed = rss
                proc.kill()
            time.sleep(0.1)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            why = f"passed the RSS limit ({killed:.0f} MB)" if killed else f"exit code {proc.returncode}"
            raise RuntimeError(f"the {cfg['kind']} run of {cfg['model']} failed ({why}):\n{err.read()[-3000:]}")
        report = json.loads(out.read().strip().splitlines()[-1])
    report["load"] = [load, os.getloadavg()[0]]
    return report


def stats(times: list[float]) -> dict:
    ms = np.asarray(times) * 1e3
    med, p90 = float(np.median(ms)), float(np.percentile(ms, 90))
    return {"median_ms": med, "p90_ms": p90, "spread": p90 / med, "n": len(ms)}


def process_spread(reports: list[dict], warmup: int) -> float:
    """p90/median within each process (what a user's loop sees), the median over the processes: a slow
    stretch of the host that hits one process whole raises the pooled p90 but not this."""
    return float(np.median([stats(r["times"][warmup:])["spread"] for r in reports]))


def summarise(name: str, runs: dict, warmup: int, max_load: float) -> dict:
    """Pooled step statistics, ratios to PyTorch, per-stage RSS (median over runs) and the load seen."""
    out = {"model": name, "systems": {}}
    for kind, reports in runs.items():
        s = stats([t for r in reports for t in r["times"][warmup:]])
        s["process_spread"] = process_spread(reports, warmup)
        stages = {}
        for row in reports[0]["stages"]:
            vals = [next(x for x in r["stages"] if x["stage"] == row["stage"]) for r in reports]
            stages[row["stage"]] = {k: float(np.median([v[k] for v in vals])) for k in ("s", "rss_mb", "peak_mb")}
        out["systems"][kind] = {**s, "stages": stages, "peak_mb": float(np.median([r["peak_mb"] for r in reports])),
                                "first_loss": reports[0]["losses"][0]}
        if "forward_times" in reports[0]:
            out["systems"][kind].update(against_forward(reports, warmup))
    ref = out["systems"]["torch"]
    ref_rounds = [float(np.median(r["times"][warmup:])) for r in runs["torch"]]
    for kind, s in out["systems"].items():
        s["median_vs_torch"] = s["median_ms"] / ref["median_ms"]
        # each process against PyTorch's of the same round: a ratio that holds only in some rounds shows here
        s["round_ratios"] = [float(np.median(r["times"][warmup:])) / t for r, t in zip(runs[kind], ref_rounds)]
        s["p90_vs_torch"] = s["p90_ms"] / ref["p90_ms"]
        s["peak_vs_torch"] = s["peak_mb"] / ref["peak_mb"]
        s["loss_diff"] = abs(s["first_loss"] - ref["first_loss"]) / max(abs(ref["first_loss"]), 1e-12) \
            if np.isfinite(s["first_loss"]) else None  # the machine's workload has no loss
    loads = [v for reports in runs.values() for r in reports for v in r["load"]]
    out["load"] = {"min": min(loads), "max": max(loads)}
    out["noisy"] = max(loads) > max_load
    return out


def bench(name: str, opts, workdir: str) -> dict:
    prep = prepare(name, workdir)
    runs = {k: [] for k in opts.kinds}
    failed: dict[str, str] = {}
    for r in range(opts.rounds):  # interleaved: a burst of load from elsewhere hits every system
        for kind in opts.kinds:
            if kind in failed:
                continue
            cfg = {**prep, "model": name, "kind": kind, "threads": opts.threads, "steps": opts.steps,
                   "spin": opts.spin}
            if kind == "machine":  # as long as PyTorch's step of this round
                cfg["target_ms"] = 1e3 * float(np.median(runs["torch"][-1]["times"][opts.warmup:]))
            try:
                runs[kind].append(run_one(cfg, opts.max_rss_gb * 1024))
            except RuntimeError as e:
                if kind != "onnxsim":
                    raise
                failed[kind] = str(e).splitlines()[-1][:200]  # the peer cannot build this model (BatchNorm)
                continue
            print(f"[{name}] round {r + 1} {kind}: median "
                  f"{1e3 * float(np.median(runs[kind][-1]['times'][opts.warmup:])):.2f} ms", file=sys.stderr,
                  flush=True)
    out = summarise(name, {k: v for k, v in runs.items() if v}, opts.warmup, opts.max_load)
    out["failed"] = failed
    return out


# ---- output ------------------------------------------------------------------------------------------

def label(name: str) -> str:
    if name == "bert":
        from .run import label as run_label

        return run_label(name)
    return spec(name)[3]


STAGE_COLUMNS = ("imports", "load", "build", "session", "steps")


def verdict(r: dict) -> str:
    """Issue 21's targets for the docs' path ("ours"): met or not on a quiet run; not judged on a noisy one."""
    o = r["systems"]["ours"]

    def judged(ok: bool) -> str:
        return "not judged" if r["noisy"] else ("met" if ok else "NOT met")
    parts = []
    if r["model"] in TARGETS:
        t = TARGETS[r["model"]]
        parts.append(f"median {o['median_vs_torch']:.2f}x PyTorch (target <= {t}): {judged(o['median_vs_torch'] <= t)}")
    spread = f"p90/median {o['spread']:.2f}, per process {o['process_spread']:.2f} (target <= {SPREAD_TARGET}): "
    floor = r["systems"].get("machine", {}).get("spread")
    if floor is not None and floor > SPREAD_TARGET and not r["noisy"]:
        spread += f"not judged, the machine's own is {floor:.2f}"
    else:
        spread += judged(o["spread"] <= SPREAD_TARGET) + (f" (the machine's own: {floor:.2f})" if floor else "")
    parts.append(spread)
    if r["model"] == "bert":  # memory and set-up do not depend on the load: judged on every run
        for kind in ("ours", "lean"):
            if kind in r["systems"]:
                s = r["systems"][kind]
                met = "met" if s["peak_vs_torch"] <= PEAK_TARGET else "NOT met"
                setup = sum(s["stages"][c]["s"] for c in ("load", "build", "session"))
                parts.append(f"{kind}: peak RSS {s['peak_vs_torch']:.2f}x PyTorch's (target <= {PEAK_TARGET}): "
                             f"{met}; set-up {setup:.1f} s (target <= {SETUP_TARGET:g} s): "
                             f"{judged(setup <= SETUP_TARGET)}")
    noise = f" (NOISY: load up to {r['load']['max']:.1f})" if r["noisy"] else ""
    return f"* {label(r['model'])}{noise}: " + "; ".join(parts)


def _rounds(ratios: list[float], target: float) -> str:
    """Each round's ratio, when there are several: the target holds only where it holds in every round."""
    if len(ratios) < 2:
        return ""
    held = sum(x <= target for x in ratios)
    return f" (per round {min(ratios):.2f}-{max(ratios):.2f}, within the target in {held} of {len(ratios)})"


def verdict_38(r: dict) -> str:
    """Issue 38's step target for the docs' path, and where the peer (onnxsim) stands in the same run."""
    o, peer = r["systems"]["ours"], r["systems"].get("onnxsim")
    def judged(ok: bool) -> str:
        return "not judged" if r["noisy"] else ("met" if ok else "NOT met")
    parts = []
    if r["model"] in TARGETS_38:
        t = TARGETS_38[r["model"]]
        parts.append(f"median {o['median_vs_torch']:.2f}x PyTorch (target <= {t}): {judged(o['median_vs_torch'] <= t)}"
                     + _rounds(o["round_ratios"], t))
    if "step_vs_forward" in o:
        bound = "" if o["flops_ratio"] is None else f"; the FLOPs' {o['flops_ratio']:.2f}x"
        parts.append(f"step {o['step_vs_forward']:.2f}x its forward (target <= {FORWARD_TARGET}{bound}): "
                     f"{judged(o['step_vs_forward'] <= FORWARD_TARGET)}")
    if peer is not None:
        parts.append(f"onnxsim {peer['median_vs_torch']:.2f}x PyTorch, ours / onnxsim "
                     f"{o['median_ms'] / peer['median_ms']:.2f}")
    elif r.get("failed", {}).get("onnxsim"):
        parts.append(f"onnxsim cannot build it ({r['failed']['onnxsim']})")
    noise = f" (NOISY: load up to {r['load']['max']:.1f})" if r["noisy"] else ""
    return f"* {label(r['model'])}{noise}: " + "; ".join(parts or ["no target"])


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"Adam, batch {BATCH} where the model's name gives none (BERT-base: 8 x 64 tokens), {meta['threads']} "
             f"threads, {meta['rounds']} processes per system x {meta['steps']} steps back to back (statistics over "
             f"the steps after the first {meta['warmup']} of each); {meta['when']}, load average "
             f"{meta['load_before']:.2f} at start, {meta['load_after']:.2f} at end, on {os.cpu_count()} cores"
             f"{'; ours with a spinning thread pool (--spin)' if meta.get('spin') else ''}.", "",
             "| model | system | median ms | p90 ms | p90/median | per process | median / PyTorch | p90 / PyTorch | "
             "load min-max | loss rel. diff step 1 |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in results:
        for kind, s in r["systems"].items():
            lines.append(f"| {label(r['model'])} | {kind} | {s['median_ms']:.2f} | {s['p90_ms']:.2f} | "
                         f"{s['spread']:.2f} | {s['process_spread']:.2f} | **{s['median_vs_torch']:.2f}** | "
                         f"{s['p90_vs_torch']:.2f} | "
                         f"{r['load']['min']:.1f}-{r['load']['max']:.1f} | "
                         f"{'' if s['loss_diff'] is None else format(s['loss_diff'], '.0e')} |")
    lines += forward_table([(label(r["model"]), r["systems"].get("ours", {})) for r in results])
    lines += ["", "RSS / peak RSS in MB after each stage (median over the processes): imports, load (proto: "
              "`onnx.load`, lean: `open_model`, ours: nothing, it passes the path), build "
              "(`make_training_model`), session (`TrainingSession`; PyTorch: module, "
              "state dict and optimizer), after the steps.", "",
              "| model | system | imports | load | build | session | steps | peak / PyTorch's |",
              "| --- | --- | --- | --- | --- | --- | --- | ---: |"]
    for r in results:
        for kind, s in r["systems"].items():
            if kind == "machine":
                continue
            cells = [f"{s['stages'][c]['rss_mb']:.0f} / {s['stages'][c]['peak_mb']:.0f}" if c in s["stages"]
                     else "" for c in STAGE_COLUMNS]
            lines.append(f"| {label(r['model'])} | {kind} | " + " | ".join(cells) + f" | {s['peak_vs_torch']:.2f} |")
    lines += ["", "Issue 21's targets on the docs' path (ours):"] + [verdict(r) for r in results]
    lines += ["", "Issue 38's targets on the docs' path (ours), and the peer:"] + [verdict_38(r) for r in results]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,cnn,transformer",
                    help="comma-separated: mlp, cnn, transformer, resnet18 (batch 32), gpt2s (GPT-2 small LM, "
                         "4 x 128 tokens; GBs per process), tiny, resnet18-tiny, gpt2s-tiny")
    ap.add_argument("--bert", action="store_true", help="add BERT-base (8 x 64 tokens; several GB per process)")
    ap.add_argument("--steps", type=int, default=200, help="steps per process, back to back")
    ap.add_argument("--warmup", type=int, default=5, help="first steps of each process left out of the statistics")
    ap.add_argument("--rounds", type=int, default=3, help="processes per system, interleaved")
    ap.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads and torch threads")
    ap.add_argument("--kinds", default=",".join(default_kinds()),
                    help="systems to run, in this order in each round, of " + ",".join(KINDS) + " (default: all, "
                         "onnxsim where it is installed); torch is required (the reference) and comes before machine")
    spin = ", ".join(f"{k}={v}" for k, v in SPIN.items())
    ap.add_argument("--spin", action="store_true", help=f"ours, proto and lean: onnxruntime's thread pool spins "
                    f"during a run and stops at its end ({spin} in the session options): the setting for a machine "
                    "of its own, which onnxsim's session has by default")
    ap.add_argument("--max-load", type=float, default=1.5, help="a model whose runs saw a higher load is noisy")
    ap.add_argument("--max-rss-gb", type=float, default=18.0, help="kill a process whose RSS passes this")
    ap.add_argument("--out", default=os.path.join(HERE, "out"), help="folder for public_path.md / .json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    opts.kinds = tuple(opts.kinds.split(","))
    if "torch" not in opts.kinds:
        ap.error("--kinds must include torch: every ratio is to PyTorch eager")
    if "machine" in opts.kinds and opts.kinds.index("machine") < opts.kinds.index("torch"):
        ap.error("--kinds: machine must come after torch (its workload is as long as PyTorch's step)")
    if opts.warmup >= opts.steps:
        ap.error("--warmup must be smaller than --steps")
    return opts


def main(argv=None) -> list[dict]:
    opts = parse_args(argv)
    if opts.child:
        print(json.dumps(child(json.loads(opts.child))), flush=True)
        return []
    names = [n for n in opts.models.split(",") if n] + (["bert"] if opts.bert else [])
    meta = {"threads": opts.threads, "spin": opts.spin, "rounds": opts.rounds, "steps": opts.steps,
            "warmup": opts.warmup, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as workdir:
        results = [bench(n, opts, workdir) for n in names]
    meta["load_after"] = os.getloadavg()[0]
    text = markdown(results, meta)
    print(text)
    os.makedirs(opts.out, exist_ok=True)
    from onnx_autodiff.model.io import write_atomic

    write_atomic(os.path.join(opts.out, "public_path.md"), text.encode())
    write_atomic(os.path.join(opts.out, "public_path.json"),
                 json.dumps({"meta": meta, "results": results}, indent=1).encode())
    return results


if __name__ == "__main__":
    main()
