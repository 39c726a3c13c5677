"""Where the set-up of ``benchmarks.genai_lora``'s ours side goes: CPU and wall seconds of each phase, from the
builder's folder to the end of the first step (``python -m benchmarks.genai_lora --phases``).

Each phase is a function of the library wrapped for the run (no profiler: cProfile's per-call cost tripled the
lowering's share of a real-size set-up); CPU seconds count every thread (onnxruntime's session creation runs on
several) and are far steadier than wall time on a shared machine. A phase called twice (the two onnxruntime
sessions of a step) is summed, its calls counted. The peak RSS (VmHWM) is read after the set-up and after the first
step.
"""
from __future__ import annotations

import functools
import json
import os
import time

import numpy as np

from benchmarks.worker import peak_mb

# (module, attribute, phase): the functions timed, as their callers look them up
PHASES = [
    ("onnx_autodiff.training.builder", "open_model", "load the builder model (memory-mapped)"),
    ("onnx_autodiff.training.builder", "_inference_copy", "copy + LoRA rewrite"),
    ("onnx_autodiff.training.builder", "value_infos", "value infos (shape inference)"),
    ("onnx_autodiff.training.builder", "select_trainable", "select the trained tensors"),
    ("onnx_autodiff.training.builder", "_add_training_info", "loss + Gradient + AdamW graphs"),
    ("onnx_autodiff.training.builder", "make_portable", "make_portable"),
    ("onnx_autodiff.training.builder", "check_rules", "check_rules (every op has a rule)"),
    ("onnx_autodiff.training.builder", "hand_back", "hand back (external-data references)"),
    ("onnx_autodiff.driver.step", "open_model", "open the training model (split)"),
    ("onnx_autodiff.driver.step", "lowered", "lowering (gradients, clean-up, checker)"),
    ("onnx_autodiff.driver.step", "step_model_parts", "step model"),
    ("onnx_autodiff.driver.step", "feed_host_scalars", "host scalars"),
    ("onnx_autodiff.driver.step", "check_step_bindings", "check the step's bindings"),
    ("onnx_autodiff.driver.step", "build_init_model", "initialization models"),
    ("onnx_autodiff.driver.step", "fold_weight_arithmetic", "int4 codes unpacked (numpy)"),
    ("onnx_autodiff.driver.runs", "split_step_model", "split gradient / update parts"),
    ("onnx_autodiff.driver.devices:Device", "session", "onnxruntime sessions (optimizations, prepacking)"),
    ("onnx_autodiff.driver.session", "forward_check", "first step: forward check's model"),
    ("onnx_autodiff.driver.forward_check:ForwardCheck", "run", "first step: forward check's session + run"),
]


def _wrap(record: dict, where: str, name: str, label: str) -> None:
    import importlib

    module, _, cls = where.partition(":")
    owner = importlib.import_module(module)
    owner = getattr(owner, cls) if cls else owner
    f = getattr(owner, name, None)
    if f is None:  # a phase this version does not have
        return

    @functools.wraps(f)
    def timed(*a, **k):
        c, w = time.process_time(), time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            r = record.setdefault(label, [0.0, 0.0, 0])
            r[0] += time.process_time() - c
            r[1] += time.perf_counter() - w
            r[2] += 1

    setattr(owner, name, timed)


def phases(info: dict, threads: int, lr: float, lora: dict) -> dict:
    """Set-up and first step of the ours side with every phase of ``PHASES`` timed; prints the table, returns it."""
    import onnxruntime as ort

    from onnx_autodiff.engine.registry import load_rules

    load_rules()  # imports of the rules: the same for every model, not a phase of this one
    record: dict = {}
    for where, name, label in PHASES:
        _wrap(record, where, name, label)
    from onnx_autodiff.driver.session import TrainingSession
    from onnx_autodiff.training.builder import make_training_model

    ids = np.load(info["npy"])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    marks = [(time.process_time(), time.perf_counter())]
    training = make_training_model(info["onnx"], loss="causal_lm", optimizer="adamw", lr=lr, lora=lora)
    marks.append((time.process_time(), time.perf_counter()))
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = threads, 1, 3
    sess = TrainingSession(training, session_options=so, progress=False, outputs=["loss"])
    del training
    marks.append((time.process_time(), time.perf_counter()))
    peaks = {"set-up": peak_mb()}
    loss = float(np.asarray(sess.step(feeds)[sess.loss_name]).reshape(-1)[0])
    marks.append((time.process_time(), time.perf_counter()))
    peaks["first step"] = peak_mb()
    totals = {k: [marks[i + 1][0] - marks[i][0], marks[i + 1][1] - marks[i][1]]
              for i, k in enumerate(("make_training_model", "TrainingSession", "first step"))}
    print("| phase | CPU s | wall s | calls |\n| --- | ---: | ---: | ---: |")
    for _, _, label in PHASES:
        if label in record:
            c, w, n = record[label]
            print(f"| {label} | {c:.2f} | {w:.2f} | {n} |")
    for k, (c, w) in totals.items():
        print(f"| **{k}** | {c:.2f} | {w:.2f} | |")
    print(" ".join(f"peak RSS after the {k}: {v:.0f} MB;" for k, v in peaks.items()))
    out = {"phases": record, "totals": totals, "first_loss": loss, "peak_mb": peaks, "lora": lora,
           "load": os.getloadavg()[0]}
    print(json.dumps(out))
    return out


__all__ = ["phases", "PHASES"]
