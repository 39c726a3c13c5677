"""The opt-in 8-bit backward through the frozen int4 base (``lora={..., "base_backward": "int8"}``, docs/llm.md) on
``benchmarks.genai_lora``'s builder model (Qwen2.5-0.5B's shape with random weights; ``--layers/--hidden/--vocab``
downsize it): how far its gradients are from float32's, beside how far PyTorch + PEFT's bf16 autocast gradients
are from PEFT float32's, and the loss over many steps, float32 against int8. Issue 38 asked for both.

    python -m benchmarks.genai_int8 --workdir DIR grad-error --batch 1 --seq 64      # relative error per adapter
    python -m benchmarks.genai_int8 --workdir DIR --layers 4 loss --steps 50         # the two loss curves
    python -m benchmarks.genai_int8 --workdir DIR --layers 2 profile --steps 2       # kernel ms per op type
    python -m benchmarks.genai_int8 --workdir DIR --tiny grad-error                  # CI's smoke test

``grad-error``: one batch (the first ``--batch`` rows, ``--seq`` tokens of the benchmark's ids); the adapters
are ours as ``make_training_model`` draws them with B set to N(0, 0.01^2) (B starts at zero, which gives A no
gradient), the same values loaded into PEFT (``peft_tensors``: our packed qkv_proj's A and B split into q, k, v);
for each adapter ||g - g_float32|| / ||g_float32||, its maximum and median, ours int8 against ours float32 and PEFT
bf16 autocast against PEFT float32 (each against its own float32: the bases differ, int4 and float). ``loss``: AdamW
steps on the benchmark's batch, float32 and int8 each in its own process, the losses side by side. ``profile``:
onnxruntime's kernel time per op type of a step (1 intra-op thread), float32 and int8 each in its own process.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from benchmarks.genai_lora import ALPHA, LR, RANK, THREADS, prepare
from benchmarks.worker import json_worker, load1

B_STD = 0.01


def _lora(base_backward: str) -> dict:
    return {"rank": RANK, "alpha": ALPHA, "targets": ["all"], "base_backward": base_backward}


def _session(info: dict, base_backward: str, optimizer: str = "adamw", lr: float = LR):
    import onnxruntime as ort

    from onnx_autodiff.driver.session import TrainingSession
    from onnx_autodiff.training.builder import make_training_model

    training = make_training_model(info["onnx"], loss="causal_lm", optimizer=optimizer, lr=lr,
                                   lora=_lora(base_backward))
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = THREADS, 1, 3
    return training, TrainingSession(training, session_options=so, progress=False, check_forward=False)


def _batch(info: dict, batch: int, seq: int) -> np.ndarray:
    return np.ascontiguousarray(np.load(info["npy"])[:batch, :seq])


def ours_gradients(info: dict, ids: np.ndarray, base_backward: str) -> tuple[dict, dict, object]:
    """(adapter -> gradient, adapter -> value, the training model): B drawn from N(0, B_STD^2), seed 0."""
    from onnx_autodiff.training.lora import lora_record

    training, sess = _session(info, base_backward)
    record = lora_record(training)
    names = [layer[k] for layer in record["layers"] for k in ("lora_A", "lora_B")]
    rng = np.random.default_rng(0)
    for name in names:
        if name.endswith(".lora_B"):
            sess.set_state(name, (rng.standard_normal(sess.get_state(name).shape) * B_STD).astype(np.float32))
    values = {n: sess.get_state(n) for n in names}
    out = sess.gradients({"input_ids": ids, "attention_mask": np.ones_like(ids)})
    grads = {n: next(v.numpy() for k, v in out.items() if k.endswith(f"{n}_grad")) for n in names}
    return grads, values, training


def peft_gradients(info: dict, ids: np.ndarray, tensors: dict, bf16: bool) -> dict:
    """PEFT key -> gradient, the adapters set to ``tensors`` (PEFT's keys), float32 or under bf16 autocast."""
    import contextlib

    import torch
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import Qwen2ForCausalLM

    from benchmarks.genai_lora import PEFT_TARGETS

    torch.set_num_threads(THREADS)
    model = Qwen2ForCausalLM.from_pretrained(info["hf"], attn_implementation="sdpa", dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=PEFT_TARGETS))
    set_peft_model_state_dict(model, {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()})
    model.train()
    t = torch.from_numpy(ids)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with autocast:
        loss = model(input_ids=t, attention_mask=torch.ones_like(t), labels=t).loss
    loss.backward()
    return {n.replace(".default", ""): p.grad.float().numpy().copy() for n, p in model.named_parameters()
            if p.requires_grad}


def errors(ref: dict, low: dict) -> dict:
    """Relative Frobenius error of each gradient: its max, median and count."""
    e = [float(np.linalg.norm(low[k].astype(np.float64) - ref[k]) / np.linalg.norm(ref[k])) for k in ref]
    return {"max": max(e), "median": float(np.median(e)), "adapters": len(e)}


def grad_error(info: dict, batch: int, seq: int) -> dict:
    from onnx_autodiff.training.lora import lora_record
    from onnx_autodiff.training.lora.adapters import peft_tensors

    ids = _batch(info, batch, seq)
    out = {"batch": [batch, seq], "b_std": B_STD}
    c = time.process_time()
    ref, values, training = ours_gradients(info, ids, "float32")
    low, _, _ = ours_gradients(info, ids, "int8")
    out["ours int8 vs ours float32"] = errors(ref, low)
    out["ours_cpu_s"] = time.process_time() - c
    record = lora_record(training)
    tensors = peft_tensors(record, values, model=training, family=record.get("family"))
    del training, ref, low
    c = time.process_time()
    pref = peft_gradients(info, ids, tensors, bf16=False)
    out["peft_cpu_s"] = time.process_time() - c
    c = time.process_time()
    pbf = peft_gradients(info, ids, tensors, bf16=True)
    out["peft_bf16_cpu_s"] = time.process_time() - c
    out["peft bf16 autocast vs peft float32"] = errors(pref, pbf)
    return out


def worker_loss(info: dict, steps: int, base_backward: str) -> dict:
    ids = _batch(info, 4, 256)
    _, sess = _session(info, base_backward)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    losses, cpu = [], []
    for _ in range(steps):
        c = time.process_time()
        losses.append(float(np.asarray(sess.step(feeds)[sess.loss_name]).reshape(-1)[0]))
        cpu.append(time.process_time() - c)
    return {"losses": losses, "step_cpu_s": cpu}


def worker_profile(info: dict, steps: int, base_backward: str) -> dict:
    """onnxruntime's kernel time per op type over ``steps`` steps after a warm-up one, 1 intra-op thread (the
    profile files are written when the sessions go)."""
    import gc
    import glob
    import tempfile

    import onnxruntime as ort

    from onnx_autodiff.driver.session import TrainingSession
    from onnx_autodiff.training.builder import make_training_model

    ids = _batch(info, 4, 256)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    training = make_training_model(info["onnx"], loss="causal_lm", optimizer="adamw", lr=LR, lora=_lora(base_backward))
    sess = TrainingSession(training, progress=False, check_forward=False)
    sess.step(feeds)
    del sess
    folder = tempfile.mkdtemp(prefix="genai_int8_prof")
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = 1, 1, 3
    so.enable_profiling, so.profile_file_prefix = True, os.path.join(folder, "p")
    sess = TrainingSession(training, session_options=so, progress=False, check_forward=False)
    sess.step(feeds)  # warm-up, profiled too: dropped below by the run count
    c = time.process_time()
    for _ in range(steps):
        sess.step(feeds)
    cpu = (time.process_time() - c) / steps
    del sess
    gc.collect()
    per_op: dict[str, float] = {}
    for path in glob.glob(os.path.join(folder, "p*.json")):
        with open(path) as f:
            events = json.load(f)
        runs = [e for e in events if e.get("name") == "model_run"]
        keep = sorted(runs, key=lambda e: e["ts"])[1:] if runs else []
        start = keep[0]["ts"] if keep else 0
        for e in events:
            if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= start:
                op = e.get("args", {}).get("op_name", "?")
                per_op[op] = per_op.get(op, 0.0) + e["dur"] / 1e3 / steps
    return {"kernel_ms": per_op, "step_cpu_s": cpu}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/genai_lora", help="benchmarks.genai_lora's folder (the model is "
                    "built there once)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tiny", action="store_true", help="--layers 1 --hidden 64 --vocab 512, batch 1 x 16, 3 steps")
    ap.add_argument("--worker", choices=("float32", "int8", "profile-float32", "profile-int8"), help=argparse.SUPPRESS)
    ap.add_argument("--info", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=50, help="loss: AdamW steps per side")
    ap.add_argument("--batch", type=int, default=1, help="grad-error: rows of the batch")
    ap.add_argument("--seq", type=int, default=64, help="grad-error: tokens per row")
    ap.add_argument("mode", nargs="?", choices=("grad-error", "loss", "profile"), default="grad-error")
    args = ap.parse_args(argv)
    if args.tiny:
        args.layers, args.hidden, args.vocab, args.batch, args.seq, args.steps = 1, 64, 512, 1, 16, 3
    if args.worker:
        with open(args.info) as f:
            info = json.load(f)
        out = worker_profile(info, args.steps, args.worker.split("-")[1]) if args.worker.startswith("profile") \
            else worker_loss(info, args.steps, args.worker)
        print(json.dumps(out), flush=True)
        return
    info = prepare(args.workdir, args.layers, args.hidden, args.vocab)
    print(f"load {load1():.1f}; {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}", flush=True)
    if args.mode == "grad-error":
        out = grad_error(info, args.batch, args.seq)
        print(json.dumps(out), flush=True)
        for what in ("ours int8 vs ours float32", "peft bf16 autocast vs peft float32"):
            e = out[what]
            print(f"| {what} | {e['adapters']} | {e['max']:.2e} | {e['median']:.2e} |")
    elif args.mode == "profile":
        info_path = os.path.join(args.workdir, f"qwen25_{args.layers}l_{args.hidden}h_{args.vocab}v.json")
        runs = {kind: json_worker("benchmarks.genai_int8", f"profile-{kind}", info_path, args.steps, 1)
                for kind in ("float32", "int8")}
        print(json.dumps(runs), flush=True)
        ops = sorted(set(runs["float32"]["kernel_ms"]) | set(runs["int8"]["kernel_ms"]),
                     key=lambda o: -max(runs["float32"]["kernel_ms"].get(o, 0), runs["int8"]["kernel_ms"].get(o, 0)))
        f32, i8 = runs["float32"], runs["int8"]
        print("| op | float32 kernel ms | int8 kernel ms |\n| --- | ---: | ---: |")
        for op in ops[:16]:
            print(f"| {op} | {f32['kernel_ms'].get(op, 0):.0f} | {i8['kernel_ms'].get(op, 0):.0f} |")
        print(f"| total | {sum(f32['kernel_ms'].values()):.0f} | {sum(i8['kernel_ms'].values()):.0f} |")
        print(f"step CPU s (1 thread): float32 {f32['step_cpu_s']:.2f}, int8 {i8['step_cpu_s']:.2f}")
    else:
        info_path = os.path.join(args.workdir, f"qwen25_{args.layers}l_{args.hidden}h_{args.vocab}v.json")
        runs = {kind: json_worker("benchmarks.genai_int8", kind, info_path, args.steps, THREADS)
                for kind in ("float32", "int8")}
        print(json.dumps(runs), flush=True)
        print("| step | loss float32 | loss int8 | int8 - float32 |\n| ---: | ---: | ---: | ---: |")
        for k, (a, b) in enumerate(zip(runs["float32"]["losses"], runs["int8"]["losses"])):
            print(f"| {k + 1} | {a:.5f} | {b:.5f} | {b - a:+.5f} |")
        print(f"median step CPU s: float32 {np.median(runs['float32']['step_cpu_s']):.2f}, "
              f"int8 {np.median(runs['int8']['step_cpu_s']):.2f}")
    print(f"load {load1():.1f}")


if __name__ == "__main__":
    main()
