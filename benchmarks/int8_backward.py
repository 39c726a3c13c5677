"""The input gradient through a frozen quantized weight, dX = dY @ W (W [N, K] float32: the dequantized base), on
onnxruntime's CPU provider in three forms: float32 MatMul (what the MatMulNBits gradient runs now), 8-bit with dY
quantized per tensor at run time (DynamicQuantizeMatMul, W int8 per output column), and 8-bit with dY quantized
per row (ReduceMax of |dY|, QuantizeLinear along axis 0 to uint8 around 128, MatMulInteger u8 x s8, the two
scales applied to the int32 result). CPU ms per run at 1 intra-op thread (``time.thread_time``: onnxruntime runs
the kernels on the calling thread), the forms alternating, and each form's error against float64
(||dX - dX64|| / ||dX64||). Issue 38's opt-in faster backward (docs/benchmarks.md, "Issue 38: int4 LoRA
set-up and step (third session)"):

    python -m benchmarks.int8_backward                      # Qwen2.5-0.5B's MLP and lm_head shapes, batch 4 x 256
    python -m benchmarks.int8_backward --shapes 64x256x128 --rounds 2   # tiny (CI's smoke test)

``--grad gauss`` draws dY from a normal distribution; ``ce`` (the default for the lm_head's shape) makes it a
cross-entropy gradient (softmax - one_hot) / rows, whose one large entry per row is what per-tensor quantization
cannot represent beside the rest.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

SHAPES = "1024x4864x896,1024x896x4864,1024x151936x896"  # (rows M, contracted N, out K): down, gate/up, lm_head


def _session(nodes, inits, m: int, n: int, k: int) -> ort.InferenceSession:
    g = helper.make_graph(nodes, "dx", [helper.make_tensor_value_info("dy", TensorProto.FLOAT, [m, n])],
                          [helper.make_tensor_value_info("dx", TensorProto.FLOAT, [m, k])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = 1, 1, 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def forms(w: np.ndarray, m: int) -> dict[str, ort.InferenceSession]:
    """The three sessions for dY [m, N] @ w [N, K]."""
    n, k = w.shape
    col = (np.abs(w).max(0) / 127.0).astype(np.float32)
    wq = np.clip(np.round(w / col), -127, 127).astype(np.int8)
    const = numpy_helper.from_array
    f32 = _session([helper.make_node("MatMul", ["dy", "w"], ["dx"])], [const(w, "w")], m, n, k)
    per_tensor = _session([helper.make_node("DynamicQuantizeMatMul", ["dy", "wq", "col"], ["dx"],
                                            domain="com.microsoft")], [const(wq, "wq"), const(col, "col")], m, n, k)
    per_row = _session([
        helper.make_node("Abs", ["dy"], ["a"]),
        helper.make_node("ReduceMax", ["a", "axis1"], ["amax"], keepdims=1),
        helper.make_node("Mul", ["amax", "inv127"], ["s"]),
        helper.make_node("Max", ["s", "tiny"], ["s_safe"]),
        helper.make_node("Reshape", ["s_safe", "rows"], ["s_row"]),
        helper.make_node("QuantizeLinear", ["dy", "s_row", "zp"], ["q"], axis=0),
        helper.make_node("MatMulInteger", ["q", "wq", "a_zp"], ["acc"]),
        helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["s_safe", "col"], ["scale"]),
        helper.make_node("Mul", ["accf", "scale"], ["dx"])],
        [const(wq, "wq"), const(col, "col"), const(np.array([1], np.int64), "axis1"),
         const(np.float32(1 / 127), "inv127"), const(np.float32(1e-30), "tiny"),
         const(np.array([m], np.int64), "rows"), const(np.full(m, 128, np.uint8), "zp"),
         const(np.uint8(128), "a_zp")], m, n, k)
    return {"float32": f32, "int8 per tensor": per_tensor, "int8 per row": per_row}


def gradient(kind: str, m: int, n: int, rng) -> np.ndarray:
    if kind == "gauss":
        return (rng.standard_normal((m, n)) * 1e-3).astype(np.float32)
    logits = rng.standard_normal((m, n)).astype(np.float32)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(m), rng.integers(0, n, m)] -= 1.0
    return (p / m).astype(np.float32)


def measure(m: int, n: int, k: int, kind: str, rounds: int) -> dict:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    dy = gradient(kind, m, n, rng)
    ref = dy.astype(np.float64) @ w.astype(np.float64)
    sessions = forms(w, m)
    times: dict[str, list[float]] = {name: [] for name in sessions}
    errors = {}
    for _ in range(rounds):
        for name, sess in sessions.items():
            c = time.thread_time()
            dx = sess.run(None, {"dy": dy})[0]
            times[name].append(time.thread_time() - c)
            errors[name] = float(np.linalg.norm(dx - ref) / np.linalg.norm(ref))
    return {name: (float(np.median(t)) * 1e3, errors[name]) for name, t in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated MxNxK: dY [M, N] @ W [N, K]")
    ap.add_argument("--rounds", type=int, default=5, help="runs per form, alternating (the median is quoted)")
    ap.add_argument("--grad", choices=("auto", "gauss", "ce"), default="auto",
                    help="dY's distribution; auto: ce where N > 100,000 (the lm_head), else gauss")
    args = ap.parse_args(argv)
    print(f"load {os.getloadavg()[0]:.1f}; 1 intra-op thread; CPU ms per run (median of {args.rounds}), "
          "relative error against float64")
    print("| dY @ W | dY | form | CPU ms | / float32 | rel. error |\n| --- | --- | --- | ---: | ---: | ---: |")
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        kind = args.grad if args.grad != "auto" else ("ce" if n > 100_000 else "gauss")
        out = measure(m, n, k, kind, args.rounds)
        base = out["float32"][0]
        for name, (ms, err) in out.items():
            print(f"| [{m}, {n}] @ [{n}, {k}] | {kind} | {name} | {ms:.0f} | {ms / base:.2f} | {err:.1e} |", flush=True)
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
