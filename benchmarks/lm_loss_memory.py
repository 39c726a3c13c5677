"""How many vocabulary-sized tensors the causal-LM loss and its gradient make: a tiny Llama with a large vocabulary
(LoRA on q/v, ``causal_lm``), its lowered step's [N, V]-shaped values (N = batch x sequence) counted after shape
inference, and the peak RSS of a few TrainingSession steps (a fresh process per measurement)::

    flock /tmp/heavy.lock python -m benchmarks.lm_loss_memory --vocab 32000 --steps 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np


def build(vocab: int, hidden: int, layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    class LogitsOnly(LlamaForCausalLM):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids, use_cache=False).logits

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      attn_implementation="eager")
    return LogitsOnly(cfg).eval()


def export(path: str, args) -> None:
    import torch

    model = build(args.vocab, args.hidden, args.layers)
    ids = torch.zeros((args.batch, args.seq), dtype=torch.int64)
    program = torch.onnx.export(model, (ids,), dynamo=True, input_names=["input_ids"], output_names=["logits"],
                                dynamic_shapes=({0: "B", 1: "S"},), verbose=False)
    program.save(path)


def vocab_sized(step, ids_shape: tuple, v: int) -> list[tuple[str, str, int]]:
    """(value, producing op, bytes) of each value of the step whose shape, once the token ids are fixed to
    ``ids_shape``, has batch x sequence x v elements and a dimension v."""
    import onnx

    from onnx_autodiff.graph import infer_tensor_info

    step = onnx.ModelProto.FromString(step.SerializeToString())
    for inp in step.graph.input:
        if inp.name == "input_ids":
            for d, size in zip(inp.type.tensor_type.shape.dim, ids_shape):
                d.dim_value = size
    n = int(np.prod(ids_shape))
    producer = {o: nd.op_type for nd in step.graph.node for o in nd.output}
    out = []
    for name, info in infer_tensor_info(step).items():
        dtype, dims = info.dtype, info.shape
        if name in producer and dims and all(isinstance(d, int) for d in dims) and v in dims \
                and int(np.prod(dims)) == n * v:
            out.append((name, producer[name], n * v * onnx.helper.tensor_dtype_to_np_dtype(dtype).itemsize))
    return out


def worker(path: str, args) -> dict:
    import onnx
    import onnxruntime as ort

    from onnx_autodiff.driver.session import TrainingSession
    from onnx_autodiff.training import make_training_model
    training = make_training_model(onnx.load(path), loss="causal_lm", optimizer="adamw", lr=1e-4,
                                   lora={"rank": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]})
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = 2, 1, 3
    sess = TrainingSession(training, session_options=so, progress=False)
    ids = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq)).astype(np.int64)
    losses = [float(np.asarray(sess.step({"input_ids": ids})[sess.loss_name])) for _ in range(args.steps)]
    big = vocab_sized(sess.step_model, (args.batch, args.seq), args.vocab)
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    return {"peak_rss_mb": round(peak), "losses": losses, "vocab_sized": len(big),
            "vocab_sized_mb": round(sum(b for *_, b in big) / 2**20), "ops": sorted(op for _, op, _ in big)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("::")[0])
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (4 heads)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers")
    ap.add_argument("--batch", type=int, default=4, help="sequences per batch")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=3, help="training steps")
    ap.add_argument("--workdir", default="/tmp/lm_loss_memory", help="the export is kept here between runs")
    ap.add_argument("--tiny", action="store_true", help="--vocab 512 --hidden 32 --layers 1 --batch 2 --seq 16 "
                    "--steps 1, to see that it runs (CI's smoke test; its numbers mean nothing)")
    ap.add_argument("--export-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tiny:
        args.vocab, args.hidden, args.layers, args.batch, args.seq, args.steps = 512, 32, 1, 2, 16, 1
    os.makedirs(args.workdir, exist_ok=True)
    path = os.path.join(args.workdir, f"llama_v{args.vocab}_h{args.hidden}_l{args.layers}.onnx")
    if args.export_only:
        export(path, args)
        return
    if not os.path.exists(path):  # in its own process: the export's memory must not count in the peak
        subprocess.run([sys.executable, "-m", "benchmarks.lm_loss_memory", "--export-only",
                        *(argv if argv is not None else sys.argv[1:])], check=True)
    json.dump(worker(path, args), sys.stdout)
    print()


if __name__ == "__main__":
    main()
