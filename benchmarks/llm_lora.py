"""LoRA fine-tuning of a decoder of real shape: ours (ONNX export -> make_training_model(lora=...) ->
TrainingSession on onnxruntime) against PyTorch + PEFT on the same weights, each side in its own process,
the processes interleaved (ours, PEFT, ours, PEFT, ...).

The model is Qwen2-0.5B's configuration (hidden 896, 24 layers, 14 heads / 2 key-value heads, intermediate
4864, vocab 151936, tied embeddings) with random weights built locally (no download); ``--layers`` scales
the depth down. Batch 4 x 256 tokens, LoRA rank 8 (alpha 16) on q_proj and v_proj, causal-LM loss (the
labels are the input ids, shifted), AdamW lr 1e-4.

    python -m benchmarks.llm_lora --workdir /tmp/llm_lora --layers 24 --rounds 2 --steps 3

Each worker reports its set-up time (ours: ``make_training_model`` on the exported file, as docs/llm.md,
``TrainingSession``; PEFT: building the model, loading the state dict, ``get_peft_model``, AdamW), its step
times (after one warm-up step) and its peak RSS (VmHWM), as JSON on its last line.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time

import numpy as np

from benchmarks.worker import json_worker, load1, peak_mb, timed_steps

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BATCH, SEQ, RANK, ALPHA, LR = 4, 256, 8, 16, 1e-4
TARGETS = ["q_proj", "v_proj"]
THREADS = int(os.environ.get("BENCH_THREADS", "2"))


# Qwen2-0.5B's sizes, and a tiny decoder of the same architecture (--tiny: CI's smoke test)
SIZES = {"qwen2": {"vocab": 151936, "hidden": 896, "intermediate": 4864, "heads": 14, "batch": BATCH, "seq": SEQ},
         "tiny": {"vocab": 512, "hidden": 64, "intermediate": 128, "heads": 4, "batch": 2, "seq": 16}}


def qwen2_config(layers: int, size: str = "qwen2"):
    from transformers import Qwen2Config

    z = SIZES[size]
    return Qwen2Config(vocab_size=z["vocab"], hidden_size=z["hidden"], intermediate_size=z["intermediate"],
                       num_hidden_layers=layers, num_attention_heads=z["heads"], num_key_value_heads=2,
                       max_position_embeddings=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       attention_dropout=0.0, attn_implementation="eager")


def build(layers: int, seed: int = 0, size: str = "qwen2"):
    """The causal LM, ``forward(input_ids) -> logits`` (labels given: transformers' own causal-LM loss)."""
    import torch
    from transformers import Qwen2ForCausalLM

    class LogitsOnly(Qwen2ForCausalLM):
        def forward(self, input_ids, labels=None):
            out = super().forward(input_ids=input_ids, labels=labels, use_cache=False)
            return out if labels is not None else out.logits

    torch.manual_seed(seed)
    return LogitsOnly(qwen2_config(layers, size)).eval()


def prepare(workdir: str, layers: int, size: str = "qwen2") -> dict:
    """Token ids, the state dict and the dynamo export (external data), once per workdir and depth."""
    import torch

    os.makedirs(workdir, exist_ok=True)
    paths = {k: os.path.join(workdir, f"{size}_{layers}l.{k}") for k in ("onnx", "pt", "npy", "json")}
    if os.path.exists(paths["json"]):
        with open(paths["json"]) as f:
            return json.load(f)
    torch.set_num_threads(THREADS)
    z = SIZES[size]
    ids = np.random.default_rng(0).integers(0, z["vocab"], (z["batch"], z["seq"])).astype(np.int64)
    np.save(paths["npy"], ids)
    model = build(layers, size=size)
    torch.save(model.state_dict(), paths["pt"])
    t = time.perf_counter()
    program = torch.onnx.export(model, (torch.from_numpy(ids),), dynamo=True, input_names=["input_ids"],
                                output_names=["logits"], dynamic_shapes=({0: "B", 1: "S"},), verbose=False)
    program.save(paths["onnx"], external_data=True)
    info = {"layers": layers, "size": size, "export_s": time.perf_counter() - t, "export_peak_mb": peak_mb(),
            "params": sum(p.numel() for p in model.parameters()), **{k: paths[k] for k in ("onnx", "pt", "npy")}}
    with open(paths["json"], "w") as f:
        json.dump(info, f)
    return info


def worker_ours(info: dict, steps: int) -> dict:
    import onnxruntime as ort

    from onnx_autodiff.driver.session import TrainingSession
    from onnx_autodiff.training.builder import make_training_model

    ids = ort.OrtValue.ortvalue_from_numpy(np.load(info["npy"]))
    t0 = time.perf_counter()
    training = make_training_model(info["onnx"], loss="causal_lm", optimizer="adamw", lr=LR,
                                   lora={"rank": RANK, "alpha": ALPHA, "targets": TARGETS})  # docs/llm.md's path
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = THREADS, 1, 3
    sess = TrainingSession(training, session_options=so, progress=False, outputs=["loss"])
    del training
    gc.collect()
    setup = time.perf_counter() - t0
    return timed_steps(lambda: float(np.asarray(sess.step({"input_ids": ids})[sess.loss_name]).reshape(-1)[0]),
                  steps, setup)


def worker_peft(info: dict, steps: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model

    torch.set_num_threads(THREADS)
    ids = torch.from_numpy(np.load(info["npy"]))
    t0 = time.perf_counter()
    model = build(info["layers"], size=info.get("size", "qwen2"))
    model.load_state_dict(torch.load(info["pt"]))
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                             target_modules=TARGETS))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    setup = time.perf_counter() - t0

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.item()
    return timed_steps(step, steps, setup)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/llm_lora", help="the export and batch are kept here between runs")
    ap.add_argument("--layers", type=int, default=24, help="decoder layers (Qwen2-0.5B has 24)")
    ap.add_argument("--rounds", type=int, default=2, help="processes per side, interleaved")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per process, after one warm-up step")
    ap.add_argument("--tiny", action="store_true", help="a 1-layer decoder of width 64, vocabulary 512, batch 2 x 16, "
                    "1 round x 2 steps, to see that it runs (CI's smoke test; its numbers mean nothing)")
    ap.add_argument("--worker", choices=["ours", "peft"], help=argparse.SUPPRESS)
    ap.add_argument("--info", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        with open(args.info) as f:
            info = json.load(f)
        fn = worker_ours if args.worker == "ours" else worker_peft
        print(json.dumps(fn(info, args.steps)), flush=True)
        return
    size = "tiny" if args.tiny else "qwen2"
    if args.tiny:
        args.layers, args.rounds, args.steps = 1, 1, 2
    info = prepare(args.workdir, args.layers, size)
    info_path = os.path.join(args.workdir, f"{size}_{args.layers}l.json")
    print(json.dumps({"prepared": info}), flush=True)
    rows = []
    for r in range(args.rounds):
        for kind in ("ours", "peft"):
            before = load1()
            out = json_worker("benchmarks.llm_lora", kind, info_path, args.steps, THREADS)
            out.update(kind=kind, round=r, load_before=before, load_after=load1())
            rows.append(out)
            print(json.dumps(out), flush=True)
    print(summary(rows))


def summary(rows: list[dict]) -> str:
    """Median step, best set-up and largest peak per side, and the ratios."""
    def side(kind):
        mine = [r for r in rows if r["kind"] == kind]
        return (float(np.median([t for r in mine for t in r["step_s"]])), min(r["setup_s"] for r in mine),
                max(r["peak_mb"] for r in mine))
    (s_o, u_o, m_o), (s_p, u_p, m_p) = side("ours"), side("peft")
    return "\n".join([
        "| side | median step s | set-up s | peak RSS MB |", "| --- | ---: | ---: | ---: |",
        f"| ours (onnxruntime) | {s_o:.2f} | {u_o:.1f} | {m_o:.0f} |",
        f"| PyTorch + PEFT | {s_p:.2f} | {u_p:.1f} | {m_p:.0f} |",
        f"| ours / PEFT | {s_o / s_p:.2f} | {u_o / u_p:.2f} | {m_o / m_p:.2f} |"])


if __name__ == "__main__":
    main()
