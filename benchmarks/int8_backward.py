"""The input gradient through a frozen quantized weight, dX = dY @ W (W [N, K] float32: the dequantized base), on
onnxruntime's CPU provider in four forms: float32 MatMul (the MatMulNBits gradient's default), 8-bit with dY
quantized per tensor at run time (DynamicQuantizeMatMul, W int8 per output column), 8-bit with dY quantized per
row as ``lora={..., "base_backward": "int8"}``'s rule emits it (gradient_rules/quantized.int8_input_grad: TopK of
|dY| per row, the scale from the second largest entry, QuantizeLinear along axis 0 to uint8 around 128,
MatMulInteger u8 x u8 with W stored as uint8 around 128, the contraction split where int32 sums could overflow,
the two scales applied, and the largest entry's saturated part added back in float times its row of W), and the
previous session's per-row form (ReduceMax, MatMulInteger u8 x s8: onnxruntime's AVX2 kernel without VNNI adds
pairs of products in saturating 16-bit sums, so its error grows with dY's range). CPU ms per run at 1 intra-op
thread (``time.thread_time``: onnxruntime runs the kernels on the calling thread), the forms alternating, and each
form's error against float64 (||dX - dX64|| / ||dX64||). Issue 38's opt-in faster backward (docs/benchmarks.md,
"Issue 38: int4 LoRA set-up and step (third session)" and "... (fifth session)"):

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
    return {"float32": f32, "int8 per tensor": per_tensor, "int8 per row": _rule_form(wq, col, m, n, k),
            "int8 per row u8 x s8": per_row}


_ACC_LIMIT = 2 ** 31 - 1  # as gradient_rules/quantized.py: MatMulInteger's int32 sums, at most 127 * 127 per term


def _rule_form(wq: np.ndarray, col: np.ndarray, m: int, n: int, k: int) -> ort.InferenceSession:
    """dY @ W as gradient_rules/quantized.int8_input_grad emits it (W's codes + 128 as uint8)."""
    const = numpy_helper.from_array
    pieces = -(-n * 127 * 127 // _ACC_LIMIT)
    sizes = [n // pieces + (1 if j < n % pieces else 0) for j in range(pieces)]
    split = ([helper.make_node("Split", ["q", "sizes"], [f"q{j}" for j in range(pieces)], axis=1),
              helper.make_node("Split", ["wu", "sizes"], [f"w{j}" for j in range(pieces)], axis=0)]
             if pieces > 1 else [helper.make_node("Identity", [x], [f"{x[0]}0"]) for x in ("q", "wu")])
    products = [node for j in range(pieces) for node in (
        helper.make_node("MatMulInteger", [f"q{j}", f"w{j}", "mid", "mid"], [f"acc{j}"]),
        helper.make_node("Cast", [f"acc{j}"], [f"accf{j}"], to=TensorProto.FLOAT))]
    nodes = [
        helper.make_node("Abs", ["dy"], ["mag"]),
        helper.make_node("TopK", ["mag", "two"], ["top", "at"], axis=1),
        helper.make_node("Slice", ["top", "one", "two", "one"], ["second"]),
        helper.make_node("Slice", ["at", "zero", "one", "one"], ["first_at"]),
        helper.make_node("Mul", ["second", "inv127"], ["s"]),
        helper.make_node("Max", ["s", "tiny"], ["rows"]),
        helper.make_node("GatherElements", ["dy", "first_at"], ["spike"], axis=1),
        helper.make_node("Reshape", ["rows", "flat"], ["scale_rows"]),
        helper.make_node("QuantizeLinear", ["dy", "scale_rows", "mids"], ["q"], axis=0),
        *split, *products,
        helper.make_node("Sum", [f"accf{j}" for j in range(pieces)], ["acc"]),
        helper.make_node("Mul", ["acc", "rows"], ["acc_rows"]),
        helper.make_node("Mul", ["acc_rows", "col"], ["dx0"]),
        helper.make_node("Mul", ["rows", "f127"], ["bound"]),
        helper.make_node("Neg", ["bound"], ["low"]),
        helper.make_node("Max", ["spike", "low"], ["above"]),
        helper.make_node("Min", ["above", "bound"], ["kept"]),
        helper.make_node("Sub", ["spike", "kept"], ["cut"]),
        helper.make_node("Reshape", ["first_at", "flat"], ["at_rows"]),
        helper.make_node("Gather", ["wu", "at_rows"], ["codes"], axis=0),
        helper.make_node("Cast", ["codes"], ["codesf"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["codesf", "f128"], ["centred"]),
        helper.make_node("Mul", ["centred", "col"], ["w_rows"]),
        helper.make_node("Mul", ["cut", "w_rows"], ["back"]),
        helper.make_node("Add", ["dx0", "back"], ["dx"])]
    inits = [const((wq.view(np.uint8) ^ np.uint8(0x80)), "wu"), const(col, "col"),
             const(np.array([2], np.int64), "two"), const(np.array([1], np.int64), "one"),
             const(np.array([0], np.int64), "zero"), const(np.array([-1], np.int64), "flat"),
             const(np.float32(1 / 127), "inv127"), const(np.float32(np.finfo(np.float32).tiny), "tiny"),
             const(np.full(m, 128, np.uint8), "mids"), const(np.uint8(128), "mid"), const(np.float32(127), "f127"),
             const(np.float32(128), "f128"), const(np.array(sizes, np.int64), "sizes")]
    return _session(nodes, inits, m, n, k)


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
