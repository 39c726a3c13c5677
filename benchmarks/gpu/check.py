"""The prepared GPU check (docs/gpu.md): training steps on a GPU through stock onnxruntime, against the CPU and
against PyTorch CUDA eager. ``benchmarks/gpu/run.sh`` is the entry; this module does the work.

    python -m benchmarks.gpu.check [--dry-run] [--providers webgpu,cuda] [--models cnn,mlp,transformer,bert]
                                   [--wheels DIR] [--out DIR] [--budget SECONDS]

For every (provider, model) cell, in a process of its own (onnxruntime-gpu and the CPU build of onnxruntime
cannot share one):

* **parity**: 5 steps (learning rates 0.01 ... 0.002, Adam with eps 1e-4; SGD too for the small models) of
  ``TrainingSession(providers=[provider])`` (state on the device) against ``TrainingSession`` on the CPU: the loss
  of every step and every state tensor after them within 1e-5 relative (``max|a - b| / max|b|``). CUDA runs with
  TF32 off (``use_tf32=0``), else its matmuls round to 10 mantissa bits.
* **speed**: the median step (loss read back: a sync point) over ``steps`` more steps of the Adam parity session,
  against PyTorch eager on the same weights and batch (forward, loss, backward, ``torch.optim.Adam``, loss read
  back; 3 warm-up steps) on CUDA, TF32 off on both sides; the set-up (lowering, sessions, the first step with its
  kernel compiles) apart.

Providers: ``webgpu`` (the onnxruntime-ep-webgpu plugin over the GPU's Vulkan driver; the machine's onnxruntime)
and ``cuda`` (onnxruntime-gpu from its wheel, unpacked apart). Models: the demo CNN (batch 32), an MLP 784-512-512-10
(batch 64), a TransformerEncoderLayer d128 h4 s64 (batch 64) and BERT-base (8 x 64 tokens, Adam lr 1e-4; its
attention key biases frozen, as in tests/runtime_models.py: their gradient is exactly zero and their Adam moments
rounding noise). ``--dry-run``: tiny models (an MLP 784-32-10, a layer of 16, BERT with 2 layers of 16; no CNN,
the slowest on a software adapter), Adam only, the WebGPU plugin on SwiftShader's software adapter, PyTorch on the
CPU, 3 timed steps: the plumbing, on a machine without a GPU (CI).
Writes ``gpu_check.json`` and ``gpu_check.md`` to ``--out``; exits 1 when a parity cell fails.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RTOL = 1e-5
LRS = [0.01, 0.008, 0.006, 0.004, 0.002]
FROZEN = {"bert": ["*attention.self.key.bias"]}
# Adam's step g / (sqrt(v) + eps) turns the float rounding of a gradient that cancels to ~1e-6 (an eighth of the
# MLP's first-layer gradients here) into weight differences of 1e-4 relative with torch's eps = 1e-8: rounding, not
# a wrong step (tests/runtime_models.py, docs/runtimes.md "Adam and zero gradients"); the parity cells use 1e-4
ADAM_EPS = 1e-4
PROVIDERS = {"webgpu": "WebGpuExecutionProvider", "cuda": ("CUDAExecutionProvider", {"use_tf32": 0})}


# ---- the models: (torch module, ONNX export of it, batch, loss) ----------------------------------------------

def _torch_cnn(seed: int = 0):
    """The demo CNN (onnx_autodiff.cli.demo.cnn_model) as a torch module with its weights."""
    import torch
    from onnx import numpy_helper
    from torch import nn

    from onnx_autodiff.cli.demo import cnn_model

    m = nn.Sequential()
    m.add_module("conv1", nn.Conv2d(1, 16, 3, padding=1))
    m.add_module("relu1", nn.ReLU())
    m.add_module("pool1", nn.MaxPool2d(2))
    m.add_module("conv2", nn.Conv2d(16, 32, 3, padding=1))
    m.add_module("relu2", nn.ReLU())
    m.add_module("pool2", nn.MaxPool2d(2))
    m.add_module("flatten", nn.Flatten())
    m.add_module("fc", nn.Linear(128, 10))
    weights = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in cnn_model(seed).graph.initializer}
    m.load_state_dict(weights)
    return m


def _bert(dry: bool):
    import transformers as tf

    from benchmarks.large_models import bert_base

    if not dry:
        return bert_base()
    cfg = tf.BertConfig(vocab_size=64, max_position_embeddings=16, hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=32, num_labels=2, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    from benchmarks.large_models import Logits

    return Logits(tf.BertForSequenceClassification(cfg))


def build(name: str, dry: bool) -> dict:
    """{module, x, labels, batch, optimizer lr}: the torch module (its weights are the ONNX model's) and a batch."""
    import torch

    from benchmarks.models import MLP, Transformer

    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    if name == "cnn":
        module, x, classes = _torch_cnn(), rng.random((32, 1, 8, 8), np.float32), 10
    elif name == "mlp":
        module = MLP() if not dry else torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 32),
                                                           torch.nn.ReLU(), torch.nn.Linear(32, 10))
        x, classes = rng.random((64 if not dry else 8, 1, 28, 28), np.float32), 10
    elif name == "transformer":
        module = Transformer() if not dry else Transformer(d_model=16, heads=2)
        x, classes = rng.standard_normal((64, 64, 128) if not dry else (4, 8, 16)).astype(np.float32), 10
    elif name == "bert":
        module = _bert(dry)
        vocab = 64 if dry else 30522
        x, classes = rng.integers(0, vocab, (2, 8) if dry else (8, 64)).astype(np.int64), 2
    else:
        raise KeyError(name)
    labels = [rng.integers(0, classes, x.shape[0]).astype(np.int64) for _ in LRS]
    batches = [x] + [x if name == "bert" else rng.permuted(x, axis=0) for _ in LRS[1:]]
    return {"module": module.eval(), "batches": batches, "labels": labels,
            "lr": 1e-4 if name == "bert" and not dry else 1e-3}


def training_model(name: str, built: dict, optimizer: str):
    import torch

    from benchmarks.run import export
    from onnx_autodiff import LossSpec, OptimizerSpec, make_training_model

    inference = export(built["module"], torch.from_numpy(built["batches"][0]), constant_folding=False,
                       dynamic_batch=True)
    opts = {"eps": ADAM_EPS} if optimizer == "adam" else None
    return make_training_model(inference, LossSpec("cross_entropy", outputs="logits"), OptimizerSpec(optimizer, opts),
                               lr=0.01, frozen=FROZEN.get(name))


# ---- one cell (a process of its own) -------------------------------------------------------------------------

def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    diff = float(np.max(np.abs(a - b))) if b.size else 0.0
    return diff / scale if scale else float(diff != 0)


def parity(name: str, built: dict, provider, optimizer: str, steps: int = 0) -> dict:
    """5 steps on ``provider`` against the CPU; then, with ``steps``, the median of ``steps`` more steps there
    (the same session: its kernels are compiled) and of PyTorch eager on the same weights and batch."""
    from onnx_autodiff import TrainingSession

    training = training_model(name, built, optimizer)
    batch = built["batches"][0].shape[0]
    cpu = TrainingSession(training, progress=False, outputs=[])
    t0 = time.perf_counter()
    dev = TrainingSession(training, [provider], progress=False, outputs=[], dims={"batch": batch})
    losses, setup = [], None
    for x, y, lr in zip(built["batches"], built["labels"], LRS):
        feeds = {"x": x, "labels": y, "learning_rate": np.array(lr, np.float32)}
        losses.append((float(dev.step(feeds)[dev.loss_name]), float(cpu.step(feeds)[cpu.loss_name])))
        setup = setup if setup is not None else time.perf_counter() - t0
    loss = max(_rel(a, b) for a, b in losses)
    errs = {k: _rel(dev.get_state(k), cpu.get_state(k)) for k in cpu.state}
    worst = max(errs, key=errs.get)
    out = {"optimizer": optimizer, "device": dev.device, "loss": loss, "state": errs[worst], "worst": worst,
           "ok": loss <= RTOL and errs[worst] <= RTOL}
    if steps:
        del cpu
        out.update(setup_s=setup, step_ms=_our_step_ms(dev, built, steps), **_torch_step_ms(built, steps))
    return out


def _our_step_ms(sess, built: dict, steps: int) -> float:
    feeds = {"x": built["batches"][0], "labels": built["labels"][0],
             "learning_rate": np.array(built["lr"], np.float32)}
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        float(sess.step(feeds)[sess.loss_name])  # the loss read back: the step is done
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _torch_step_ms(built: dict, steps: int) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    module = built["module"].to(device).train()
    opt = torch.optim.Adam(module.parameters(), lr=built["lr"])
    tx, ty = torch.from_numpy(built["batches"][0]).to(device), torch.from_numpy(built["labels"][0]).to(device)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(module(tx), ty)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return {"torch_ms": 1e3 * statistics.median(times), "torch_device": device}


def run_cell(provider_name: str, name: str, dry: bool, steps: int) -> dict:
    """One (provider, model) cell: parity with Adam, then the speed on that session; SGD parity for the small
    models (not in a dry run)."""
    provider = PROVIDERS[provider_name]
    if provider_name == "cuda":
        import onnxruntime as ort

        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()  # the CUDA libraries PyTorch ships
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return {"skipped": f"onnxruntime {ort.__version__} from {ort.__file__} has no CUDAExecutionProvider"}
    built = build(name, dry)
    adam = parity(name, built, provider, "adam", steps)
    cell = {k: adam.pop(k) for k in ("setup_s", "step_ms", "torch_ms", "torch_device")}
    cell["parity"] = [adam] + ([] if dry or name == "bert" else [parity(name, build(name, dry), provider, "sgd")])
    return cell


# ---- the driver ----------------------------------------------------------------------------------------------

def join_parts(folder: Path, work: Path) -> list[Path]:
    """Every file split in parts in ``folder`` (``NAME.part-aa``, ``-ab``, ... as ``split`` names them) put
    together with ``cat`` as ``work/NAME``."""
    joined = []
    for first in sorted(folder.glob("*.part-aa")):
        name = first.name[:-len(".part-aa")]
        parts = sorted(folder.glob(f"{name}.part-*"))
        with open(work / name, "wb") as out:
            subprocess.run(["cat", *map(str, parts)], stdout=out, check=True)
        joined.append(work / name)
    return joined


def _check_join(work: Path) -> None:
    """The dry run's check of ``join_parts`` on a file split as prepare.sh splits the CUDA wheel."""
    src = work / "parts"
    src.mkdir(exist_ok=True)
    data = np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes()
    (src / "x.bin").write_bytes(data)
    subprocess.run(["split", "-b", "1000", str(src / "x.bin"), str(src / "x.bin.part-")], check=True)
    (src / "x.bin").unlink()
    out = work / "joined"
    out.mkdir(exist_ok=True)
    assert [p.read_bytes() for p in join_parts(src, out)] == [data], "the parts did not join back"


def install_wheels(wheels: Path, work: Path) -> dict[str, Path]:
    """Each wheel of ``wheels`` (a wheel split in parts, ``NAME.whl.part-*``, is put together with ``cat``
    first) unpacked into a folder of its own under ``work``: {distribution: folder} (the machine's own
    packages stay as they are; a cell puts the folder first on its path)."""
    out = {}
    if not wheels.is_dir():
        return out
    join_parts(wheels, work)
    for wheel in sorted(list(wheels.glob("*.whl")) + list(work.glob("*.whl"))):
        dist = wheel.name.split("-")[0]
        target = work / dist
        if not target.is_dir():
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                            str(target), str(wheel)], check=True)
        out[dist] = target
    return out


def _cell_env(provider: str, installed: dict[str, Path], dry: bool) -> dict:
    env = dict(os.environ)
    paths = [str(ROOT)]
    if provider == "cuda" and "onnxruntime_gpu" in installed:
        paths.insert(0, str(installed["onnxruntime_gpu"]))
    if provider == "webgpu" and "onnxruntime_ep_webgpu" in installed:
        paths.insert(0, str(installed["onnxruntime_ep_webgpu"]))
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if provider == "webgpu" and dry:  # no GPU: SwiftShader's software Vulkan (tests/webgpu_runtime.py)
        env.setdefault("VK_ICD_FILENAMES", "/usr/lib/chromium/vk_swiftshader_icd.json")
        env.setdefault("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", "1")
    return env


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"GPU check ({'dry run, ' if meta['dry'] else ''}{meta['gpu']}; {meta['when']}; "
             f"{meta['elapsed_s']:.0f} s)", "",
             "| provider | model | parity Adam (loss / state) | parity SGD | set-up s | step ms | PyTorch eager ms |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r or "error" in r:
            lines.append(f"| {r['provider']} | {r['model']} | {r.get('skipped') or 'ERROR: ' + r['error']} | | | | |")
            continue
        par = {p["optimizer"]: f"{p['loss']:.1e} / {p['state']:.1e}{'' if p['ok'] else ' FAIL'}" for p in r["parity"]}
        lines.append(f"| {r['provider']} | {r['model']} | {par.get('adam', '')} | {par.get('sgd', '-')} | "
                     f"{r['setup_s']:.1f} | {r['step_ms']:.2f} | {r['torch_ms']:.2f} ({r['torch_device']}) |")
    return "\n".join(lines) + "\n"


def _gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip() or "no GPU"
    except (OSError, subprocess.SubprocessError):
        return "no GPU (no nvidia-smi)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.gpu.check")
    p.add_argument("--dry-run", action="store_true", help="tiny models, software WebGPU, PyTorch on the CPU")
    p.add_argument("--providers", default="webgpu,cuda")
    p.add_argument("--models", help="default cnn,mlp,transformer,bert (a dry run: mlp,transformer,bert)")
    p.add_argument("--wheels", default=str(HERE / "wheels"), help="wheels (or their parts) to install apart")
    p.add_argument("--work", default="/tmp/onnx-autodiff-gpu-check")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    p.add_argument("--budget", type=float, default=450.0, help="seconds; the cells not started by then are skipped")
    p.add_argument("--steps", type=int, help="timed steps per cell (default 20; 3 in a dry run)")
    p.add_argument("--cell", nargs=2, metavar=("PROVIDER", "MODEL"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    steps = args.steps or (3 if args.dry_run else 20)
    models = args.models or ("mlp,transformer,bert" if args.dry_run else "cnn,mlp,transformer,bert")
    if args.cell:
        try:
            result = run_cell(args.cell[0], args.cell[1], args.dry_run, steps)
        except Exception as e:  # one line for the table; the traceback goes to stderr
            import traceback

            traceback.print_exc()
            result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        print("CELL " + json.dumps(result))
        return 0
    start = time.monotonic()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        _check_join(work)
    installed = install_wheels(Path(args.wheels), work)
    print(f"wheels unpacked apart: {sorted(installed) or 'none'}", flush=True)
    results = []
    for provider in args.providers.split(","):
        for model in models.split(","):
            cell = {"provider": provider, "model": model}
            if time.monotonic() - start > args.budget:
                results.append({**cell, "skipped": f"over the {args.budget:.0f} s budget"})
                continue
            if provider == "cuda" and args.dry_run:
                results.append({**cell, "skipped": "dry run: no CUDA"})
                continue
            cmd = [sys.executable, "-m", "benchmarks.gpu.check", "--cell", provider, model, "--steps", str(steps)]
            cmd += ["--dry-run"] if args.dry_run else []
            t = time.monotonic()
            proc = subprocess.run(cmd, cwd=ROOT, env=_cell_env(provider, installed, args.dry_run),
                                  capture_output=True, text=True)
            found = [line[5:] for line in proc.stdout.splitlines() if line.startswith("CELL ")]
            got = json.loads(found[-1]) if found else {"error": f"exit {proc.returncode}: "
                                                              f"{proc.stderr.strip().splitlines()[-1:]}"}
            if "error" in got:
                sys.stderr.write(proc.stderr[-3000:])
            results.append({**cell, **got, "cell_s": time.monotonic() - t})
            print(f"{provider} {model}: {json.dumps(results[-1])}", flush=True)
    meta = {"dry": args.dry_run, "gpu": _gpu_name(), "when": time.strftime("%Y-%m-%d %H:%M"),
            "elapsed_s": time.monotonic() - start, "load": os.getloadavg()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    table = markdown(results, meta)
    (out / "gpu_check.md").write_text(table)
    print(table)
    failed = [r for r in results if any(not c["ok"] for c in r.get("parity", []))]
    errors = [r for r in results if "error" in r]
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
