"""Mixed precision on the CPU: a small GPT-2 (random weights, built locally) trained 50 AdamW steps in float32,
float16 and bfloat16 (``make_training_model(precision=...)``: float32 masters, float32 optimizer state, dynamic loss
scaling for float16), each precision in its own process, from the same start on the same batches::

    python -m benchmarks.mixed_precision --workdir /tmp/mixed --steps 50

Each worker reports the losses, the loss scale the step used and whether it skipped (float16), its step times
(after two warm-up steps) and its peak RSS (VmHWM). ``--kernels`` also lists, for the ops of a transformer's step,
which have a float16 / bfloat16 kernel in onnxruntime's CPU provider and which it computes in float32 between Casts
its graph optimizer inserts (``InsertedPrecisionFreeCast_*``), which is where the float16 cost on a CPU comes from.

The data: sequences of a fixed random bigram chain (each token has 4 likely successors), so the loss has somewhere
to fall; batch 8 x 64 tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from benchmarks.worker import peak_mb

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BATCH, SEQ, VOCAB, LR = 8, 64, 512, 2e-3
THREADS = int(os.environ.get("BENCH_THREADS", "2"))


def export(path: str, layers: int, width: int) -> None:
    """A GPT-2 LM head model exported by TorchScript (opset 18): input_ids, attention_mask -> logits."""
    import warnings

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    class LogitsOnly(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=width, n_layer=layers, n_head=width // 64,
                                       n_positions=SEQ, bos_token_id=0, eos_token_id=1)).eval()
    ids = torch.zeros((BATCH, SEQ), dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(LogitsOnly(model), (ids, torch.ones_like(ids)), path, dynamo=False, opset_version=18,
                          input_names=["input_ids", "attention_mask"], output_names=["logits"],
                          dynamic_axes={"input_ids": {0: "B", 1: "S"}, "attention_mask": {0: "B", 1: "S"}})


def batches(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, VOCAB, (VOCAB, 4))
    out = []
    for _ in range(n):
        ids = np.empty((BATCH, SEQ), np.int64)
        ids[:, 0] = rng.integers(0, VOCAB, BATCH)
        for t in range(1, SEQ):
            ids[:, t] = successors[ids[:, t - 1], rng.integers(0, 4, BATCH)]
        out.append(ids)
    return out


def worker(path: str, precision: str, steps: int) -> dict:
    import onnxruntime as ort

    from onnx_autodiff import LossSpec, Precision, TrainingSession, make_training_model

    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.log_severity_level = 3
    # fp16-hot: a scale that overflows at first and a short growth interval, to show the scaler at work
    mixed = {"fp32": None, "fp16-hot": Precision("fp16", init_scale=2.0 ** 24, growth_interval=10)}.get(
        precision, precision)
    training = make_training_model(path, LossSpec("causal_lm", options={"mask": "attention_mask"}), "adamw",
                                   lr=LR, precision=mixed)
    sess = TrainingSession(training, outputs=["loss"], session_options=options, progress=False)
    data = batches(steps)
    losses, times, scales, skipped = [], [], [], []
    for ids in data:
        start = time.perf_counter()
        out = sess.step({"input_ids": ids, "attention_mask": np.ones_like(ids)})
        times.append(time.perf_counter() - start)
        losses.append(float(out["loss"]))
        if "loss_scale" in out:
            scales.append(float(out["loss_scale"]))
            skipped.append(bool(out["step_skipped"]))
    timed = times[2:] or times  # after two warm-up steps, when there are more
    return {"precision": precision, "losses": losses, "step_s": float(np.median(timed)),
            "step_s_min": float(np.min(timed)), "peak_mb": peak_mb(), "scales": scales, "skipped": skipped}


def _probe(op: str, inputs: list, attrs: dict, dtype: int, workdir: str) -> str:
    """Whether onnxruntime's CPU provider runs one ``op`` node in ``dtype`` with its own kernel, or computes it
    in float32 between Casts its optimizer inserts (``InsertedPrecisionFreeCast_*``)."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    infos = [helper.make_tensor_value_info(n, dtype if t is None else t, s) for n, t, s in inputs]
    node = helper.make_node(op, [n for n, _, _ in inputs], ["y"], **attrs)
    model = helper.make_model(helper.make_graph([node], "probe", infos, [helper.make_empty_tensor_value_info("y")]),
                              opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.optimized_model_filepath = os.path.join(workdir, "probe.onnx")
    options.log_severity_level = 3
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception:
        return "none"
    names = [n.name for n in onnx.load(options.optimized_model_filepath).graph.node]
    return "float32 via Casts" if any("InsertedPrecisionFreeCast" in n for n in names) else "kernel"


def kernels(workdir: str) -> dict:
    """For the ops a transformer's step uses, what onnxruntime's CPU provider does with float16 and bfloat16."""
    from onnx import TensorProto

    x, y, w, b = ("x", None, [4, 8]), ("y2", None, [4, 8]), ("w", None, [8, 8]), ("b", None, [8])
    ids = ("i", TensorProto.INT64, [3])
    cases = {op: ([x], {}) for op in ("Tanh", "Sigmoid", "Exp", "Log", "Sqrt", "Neg", "Reciprocal", "Erf",
                                      "Softmax", "LogSoftmax", "Relu", "Transpose")}
    cases.update({op: ([x, y], {}) for op in ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Equal", "Sum")})
    cases.update({"MatMul": ([x, w], {}), "Gemm": ([x, w, b], {}), "ReduceSum": ([x], {"keepdims": 1}),
                  "ReduceMean": ([x], {"keepdims": 1}), "Gather": ([x, ids], {}),
                  "LayerNormalization": ([x, b, ("c", None, [8])], {"axis": -1}),
                  "Where": ([("m", TensorProto.BOOL, [4, 8]), x, y], {}), "Concat": ([x, y], {"axis": 0})})
    return {name: {op: _probe(op, inputs, attrs, dtype, workdir) for op, (inputs, attrs) in cases.items()}
            for name, dtype in (("fp16", TensorProto.FLOAT16), ("bf16", TensorProto.BFLOAT16))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="/tmp/mixed_precision", help="the export is kept here between runs")
    p.add_argument("--steps", type=int, default=50, help="AdamW steps per precision")
    p.add_argument("--layers", type=int, default=4, help="GPT-2 layers")
    p.add_argument("--width", type=int, default=256, help="GPT-2 width, a multiple of 64 (heads of 64)")
    p.add_argument("--precisions", default="fp32,fp16,bf16,fp16-hot",
                   help="comma-separated, of fp32, fp16, bf16 and fp16-hot (float16 from loss scale 2^24, growth "
                   "every 10 steps)")
    p.add_argument("--kernels", action="store_true", help="also list which ops have float16 / bfloat16 kernels in "
                   "onnxruntime's CPU provider")
    p.add_argument("--tiny", action="store_true", help="--layers 1 --width 64 --steps 2 --precisions fp32,fp16, to "
                   "see that it runs (CI's smoke test; its numbers mean nothing)")
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "PRECISION"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.width, args.steps, args.precisions = 1, 64, 2, "fp32,fp16"
    if args.width % 64 or args.width < 64:
        p.error(f"--width {args.width}: a multiple of 64 (GPT-2's heads here are 64 wide)")
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.steps)))
        return
    os.makedirs(args.workdir, exist_ok=True)
    path = os.path.join(args.workdir, f"gpt2_{args.layers}x{args.width}.onnx")
    if not os.path.exists(path):
        export(path, args.layers, args.width)
    results = {}
    for precision in args.precisions.split(","):
        out = subprocess.run([sys.executable, "-m", "benchmarks.mixed_precision", "--steps", str(args.steps),
                              "--worker", path, precision], capture_output=True, text=True, check=True)
        results[precision] = json.loads(out.stdout.strip().splitlines()[-1])
        r = results[precision]
        print(f"{precision}: step {r['step_s'] * 1000:.0f} ms (min {r['step_s_min'] * 1000:.0f}), peak RSS "
              f"{r['peak_mb']:.0f} MB, loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}", flush=True)
    if args.kernels:
        results["cpu_kernels"] = kernels(args.workdir)
        for name, table in results["cpu_kernels"].items():
            for what in ("kernel", "float32 via Casts", "none"):
                print(f"{name} {what}: {', '.join(op for op, v in table.items() if v == what) or '-'}")
    with open(os.path.join(args.workdir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    if "fp32" in results:
        ref = np.array(results["fp32"]["losses"])
        for precision, r in results.items():
            if precision in ("fp32", "cpu_kernels"):
                continue
            gap = np.abs(np.array(r["losses"]) - ref) / ref
            print(f"{precision} vs fp32: loss within {gap.max():.2e} relative (mean {gap.mean():.2e}); "
                  f"skipped steps {[k for k, s in enumerate(r['skipped']) if s]}, scale by step {r['scales']}")


if __name__ == "__main__":
    main()
