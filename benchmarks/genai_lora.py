"""LoRA on an onnxruntime-genai builder model of real shape: ours (the builder's int4 ``model.onnx`` ->
``make_training_model(lora=...)`` -> ``TrainingSession`` on onnxruntime) against PyTorch + PEFT on the Hugging
Face model the builder read, in float32 and under bf16 autocast; each side in its own process, the processes
interleaved (ours, PEFT, PEFT bf16, ours, ...).

The model is Qwen2.5-0.5B's configuration (24 layers, hidden 896, 14 heads / 2 key-value heads, intermediate
4864, vocab 151936, tied embeddings) with random weights built locally (no download), converted by the model
builder (``-p int4 -e cpu``: MatMulNBits, block 32, accuracy_level 4). Batch 4 x 256 tokens, LoRA rank 8
(alpha 16) on every projection (q, k, v, o, gate, up, down; the builder's qkv_proj on our side), causal-LM
loss, AdamW lr 1e-4. ``--layers/--hidden/--vocab`` downsize it (heads of 64, 2 key-value heads, the
intermediate size in Qwen2.5's proportion) to see that it runs:

    python -m benchmarks.genai_lora --workdir /tmp/genai_lora                       # the real size
    python -m benchmarks.genai_lora --workdir /tmp/genai_tiny --layers 2 --hidden 128 --vocab 2048 --steps 2

Each worker reports its set-up time (ours: ``make_training_model`` on the builder's file and
``TrainingSession``; PEFT: loading the model, ``get_peft_model``, AdamW), its first step (ours: with the forward
check of driver/forward_check.py), the step times after it and its peak RSS (VmHWM), as JSON on its last line;
also the set-up's CPU seconds (all threads), which a loaded machine inflates less than wall time.
The table goes to stdout, every row and the summary to ``--out`` (JSON). ``--sides ours,ours-unchecked`` shows
what the forward check costs (time of the first step, peak RSS). ``--phases`` times each phase of our set-up and
first step instead (``benchmarks/genai_phases.py``; docs/benchmarks.md has the real size's table).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import time

import numpy as np

from benchmarks.worker import json_worker, load1, timed_steps

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BATCH, SEQ, RANK, ALPHA, LR = 4, 256, 8, 16, 1e-4
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
THREADS = int(os.environ.get("BENCH_THREADS", "2"))
# ours-unchecked: without the first step's forward check; ours-int8: lora={..., "base_backward": "int8"}, the
# opt-in 8-bit input gradient through the frozen int4 base (docs/llm.md)
KINDS = ("ours", "peft", "peft-bf16", "ours-unchecked", "ours-int8")


def qwen25_config(layers: int, hidden: int, vocab: int):
    from transformers import Qwen2Config

    heads = max(hidden // 64, 2)
    intermediate = int(round(hidden * 4864 / 896 / 32)) * 32
    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=2 if heads % 2 == 0 else 1,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, attention_dropout=0.0, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0)


def _tokenizer(folder: str) -> None:
    """A word-level tokenizer (the builder copies the model's tokenizer into its folder; none is read here)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 64)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)


def prepare(workdir: str, layers: int, hidden: int, vocab: int) -> dict:
    """The Hugging Face model (random weights), its int4 builder model and the token ids, once per workdir."""
    import torch
    from transformers import Qwen2ForCausalLM

    tag = f"qwen25_{layers}l_{hidden}h_{vocab}v"
    info_path = os.path.join(workdir, f"{tag}.json")
    if os.path.exists(info_path):
        with open(info_path) as f:
            return json.load(f)
    os.makedirs(workdir, exist_ok=True)
    hf, out, cache = (os.path.join(workdir, f"{tag}-{k}") for k in ("hf", "int4", "cache"))
    torch.manual_seed(0)
    t = time.perf_counter()
    model = Qwen2ForCausalLM(qwen25_config(layers, hidden, vocab))
    with contextlib.redirect_stderr(io.StringIO()):
        model.save_pretrained(hf)
    _tokenizer(hf)
    params = sum(p.numel() for p in model.parameters())
    del model
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    from onnxruntime_genai.models.builder import create_model, parse_extra_options
    root.setLevel(level)
    root.handlers[:] = handlers
    with contextlib.redirect_stdout(io.StringIO()):
        extra = parse_extra_options(None, hf, out, "int4", "cpu", cache, ["hf_token=false"])
        create_model(None, hf, out, "int4", "cpu", cache, **extra)
    ids = np.random.default_rng(0).integers(3, vocab, (BATCH, SEQ)).astype(np.int64)
    np.save(os.path.join(workdir, f"{tag}.npy"), ids)
    info = {"layers": layers, "hidden": hidden, "vocab": vocab, "params": params, "hf": hf,
            "onnx": os.path.join(out, "model.onnx"), "npy": os.path.join(workdir, f"{tag}.npy"),
            "build_s": time.perf_counter() - t,
            "onnx_mb": sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)) / 2**20}
    with open(info_path, "w") as f:
        json.dump(info, f)
    return info


def worker_ours(info: dict, steps: int, check: bool = True, base_backward: str = "float32") -> dict:
    import onnxruntime as ort

    from onnx_autodiff.driver.session import TrainingSession
    from onnx_autodiff.training.builder import make_training_model

    ids = np.load(info["npy"])
    feeds = {"input_ids": ort.OrtValue.ortvalue_from_numpy(ids),
             "attention_mask": ort.OrtValue.ortvalue_from_numpy(np.ones_like(ids))}
    t0, c0 = time.perf_counter(), time.process_time()
    training = make_training_model(info["onnx"], loss="causal_lm", optimizer="adamw", lr=LR,  # docs/llm.md's path
                                   lora={"rank": RANK, "alpha": ALPHA, "targets": ["all"],
                                         "base_backward": base_backward})
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = THREADS, 1, 3
    sess = TrainingSession(training, session_options=so, progress=False, outputs=["loss"], check_forward=check)
    del training
    setup, setup_cpu = time.perf_counter() - t0, time.process_time() - c0
    step, cpu = _cpu_timed(lambda: float(np.asarray(sess.step(feeds)[sess.loss_name]).reshape(-1)[0]))
    return {**timed_steps(step, steps, setup), "setup_cpu_s": setup_cpu, "step_cpu_s": cpu[1:]}


def _cpu_timed(step):
    """``step`` recording the CPU seconds (all threads) of each call, and that list: a loaded machine inflates
    them far less than wall time."""
    cpu = []

    def timed():
        c = time.process_time()
        out = step()
        cpu.append(time.process_time() - c)
        return out
    return timed, cpu


def worker_peft(info: dict, steps: int, bf16: bool = False) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2ForCausalLM

    torch.set_num_threads(THREADS)
    ids = torch.from_numpy(np.load(info["npy"]))
    mask = torch.ones_like(ids)
    t0, c0 = time.perf_counter(), time.process_time()
    model = Qwen2ForCausalLM.from_pretrained(info["hf"], attn_implementation="sdpa", dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=PEFT_TARGETS))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    setup, setup_cpu = time.perf_counter() - t0, time.process_time() - c0
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.item()
    step, cpu = _cpu_timed(step)
    return {**timed_steps(step, steps, setup), "setup_cpu_s": setup_cpu, "step_cpu_s": cpu[1:]}


def summary(rows: list[dict]) -> tuple[str, dict]:
    """Per side: median step, first step, best set-up, largest peak; the table and its numbers."""
    sides = {}
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        if mine:
            sides[kind] = {"step_s": float(np.median([t for r in mine for t in r["step_s"]])),
                           "step_cpu_s": float(np.median([t for r in mine for t in r.get("step_cpu_s", [np.nan])])),
                           "first_step_s": min(r["first_step_s"] for r in mine),
                           "setup_s": min(r["setup_s"] for r in mine), "peak_mb": max(r["peak_mb"] for r in mine),
                           "setup_cpu_s": min(r.get("setup_cpu_s", float("nan")) for r in mine),
                           "first_loss": mine[0]["losses"][0]}
    names = {"ours": "ours (int4 builder model, onnxruntime)", "peft": "PyTorch + PEFT, float32",
             "peft-bf16": "PyTorch + PEFT, bf16 autocast", "ours-unchecked": "ours, no forward check at step 1",
             "ours-int8": "ours, base_backward int8"}
    lines = ["| side | median step s | median step CPU s | first step s | set-up s | set-up CPU s | peak RSS MB | "
             "first loss |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for kind, s in sides.items():
        lines.append(f"| {names[kind]} | {s['step_s']:.3f} | {s['step_cpu_s']:.3f} | {s['first_step_s']:.3f} | "
                     f"{s['setup_s']:.1f} | "
                     f"{s['setup_cpu_s']:.1f} | {s['peak_mb']:.0f} | {s['first_loss']:.4f} |")
    if "ours" in sides and "peft" in sides:
        o, p = sides["ours"], sides["peft"]
        lines.append(f"| ours / PEFT float32 | {o['step_s'] / p['step_s']:.2f} | "
                     f"{o['step_cpu_s'] / p['step_cpu_s']:.2f} | | {o['setup_s'] / p['setup_s']:.2f} | "
                     f"{o['setup_cpu_s'] / p['setup_cpu_s']:.2f} | {o['peak_mb'] / p['peak_mb']:.2f} | |")
    for kind, over in (("ours-int8", "ours"), ("ours-int8", "peft-bf16")):
        if kind in sides and over in sides:
            o, p = sides[kind], sides[over]
            lines.append(f"| {kind} / {over} | {o['step_s'] / p['step_s']:.2f} | "
                         f"{o['step_cpu_s'] / p['step_cpu_s']:.2f} | | | | {o['peak_mb'] / p['peak_mb']:.2f} | |")
    return "\n".join(lines), sides


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/genai_lora", help="the builder's folder and batch are kept here")
    ap.add_argument("--layers", type=int, default=24, help="decoder layers (Qwen2.5-0.5B has 24)")
    ap.add_argument("--hidden", type=int, default=896, help="hidden size (heads of 64)")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary size")
    ap.add_argument("--rounds", type=int, default=2, help="processes per side, interleaved")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per process, after the first step")
    ap.add_argument("--tiny", action="store_true", help="--layers 1 --hidden 64 --vocab 512 --rounds 1 --steps 2 "
                    "--sides ours,peft, to see that it runs (CI's smoke test; its numbers mean nothing)")
    ap.add_argument("--sides", default=",".join(KINDS[:3]), help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--phases", action="store_true", help="only our set-up and first step, in this process, with "
                    "the CPU and wall seconds of each phase (benchmarks/genai_phases.py)")
    ap.add_argument("--base-backward", choices=("float32", "int8"), default="float32",
                    help="with --phases: lora's base_backward (int8: the opt-in int8 backward)")
    ap.add_argument("--out", help="JSON file for every row and the summary (default: WORKDIR/results.json)")
    ap.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--info", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tiny:
        args.layers, args.hidden, args.vocab, args.rounds, args.steps, args.sides = 1, 64, 512, 1, 2, "ours,peft"
    if args.worker:
        with open(args.info) as f:
            info = json.load(f)
        out = worker_ours(info, args.steps, check=args.worker != "ours-unchecked",
                          base_backward="int8" if args.worker == "ours-int8" else "float32") \
            if args.worker.startswith("ours") else worker_peft(info, args.steps, bf16=args.worker == "peft-bf16")
        print(json.dumps(out), flush=True)
        return
    info = prepare(args.workdir, args.layers, args.hidden, args.vocab)
    if args.phases:
        from benchmarks.genai_phases import phases

        phases(info, THREADS, LR, {"rank": RANK, "alpha": ALPHA, "targets": ["all"],
                                   "base_backward": args.base_backward})
        return
    info_path = os.path.join(args.workdir, f"qwen25_{args.layers}l_{args.hidden}h_{args.vocab}v.json")
    print(json.dumps({"prepared": info}), flush=True)
    kinds = [k for k in args.sides.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        ap.error(f"--sides: unknown {unknown}; the sides are {', '.join(KINDS)}")
    rows = []
    for r in range(args.rounds):
        for kind in kinds:
            before = load1()
            out = json_worker("benchmarks.genai_lora", kind, info_path, args.steps, THREADS)
            out.update(kind=kind, round=r, load_before=before, load_after=load1())
            rows.append(out)
            print(json.dumps(out), flush=True)
    table, sides = summary(rows)
    print(table)
    path = args.out or os.path.join(args.workdir, "results.json")
    with open(path, "w") as f:
        json.dump({"prepared": info, "threads": THREADS, "batch": [BATCH, SEQ], "rank": RANK, "rows": rows,
                   "summary": sides}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
