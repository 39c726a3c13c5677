"""Forms of a tangent rule in standard ONNX, timed in onnxruntime: which one the JVP rule should emit.

    python -m benchmarks.forward_forms [--shape 64,32,28,28] [--runs 60] [--threads 1]

The MaxPool tangent of 2x2/2 windows that tile the input (the CNN's pools): dx at the first maximum of each
window (the gradient's tie rule). Each form is one graph from x, dx and the pooled y to the tangent; every form
must give the first form's tangent exactly (the input is ReLU'd noise, so windows of zeros tie). Prints the
median CPU time per run (``time.process_time``: time the process ran, which load from other processes disturbs
less than wall time; one onnxruntime thread by default), the forms interleaved run by run, and the load average.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

node = helper.make_node


def _model(shape, nodes, inits=()):
    n, c, h, w = shape
    f = TensorProto.FLOAT
    g = helper.make_graph(nodes, "maxpool_jvp",
                          [helper.make_tensor_value_info("x", f, [n, c, h, w]),
                           helper.make_tensor_value_info("dx", f, [n, c, h, w]),
                           helper.make_tensor_value_info("y", f, [n, c, h // 2, w // 2])],
                          [helper.make_tensor_value_info("t", f, [n, c, h // 2, w // 2])], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def forms(shape) -> dict:
    n, c, h, w = shape
    ho, wo = h // 2, w // 2
    out = {"MaxPool with Indices + Gather (before)": _model(shape, [
        node("MaxPool", ["x"], ["y2", "i"], kernel_shape=[2, 2], strides=[2, 2]),
        node("Reshape", ["dx", "flat"], ["f"]), node("Reshape", ["i", "flat"], ["fi"]),
        node("Gather", ["f", "fi"], ["g"], axis=0), node("Reshape", ["g", "out"], ["t"])],
        [_ints("flat", [-1]), _ints("out", [n, c, ho, wo])])}
    out["SpaceToDepth + ArgMax + GatherElements (the rule)"] = _model(shape, [
        node("SpaceToDepth", ["x"], ["sx"], blocksize=2), node("SpaceToDepth", ["dx"], ["sd"], blocksize=2),
        node("Reshape", ["sx", "blocks"], ["x3"]), node("Reshape", ["sd", "blocks"], ["d3"]),
        node("ArgMax", ["x3"], ["a"], axis=1, keepdims=1), node("GatherElements", ["d3", "a"], ["g"], axis=1),
        node("Reshape", ["g", "out"], ["t"])], [_ints("blocks", [0, 4, c * ho * wo]), _ints("out", [n, c, ho, wo])])
    out["Transpose to a last axis + ArgMax + GatherElements"] = _model(shape, [
        node("Reshape", ["x", "six"], ["x6"]), node("Reshape", ["dx", "six"], ["d6"]),
        node("Transpose", ["x6"], ["xt"], perm=[0, 1, 2, 4, 3, 5]),
        node("Transpose", ["d6"], ["dt"], perm=[0, 1, 2, 4, 3, 5]),
        node("Reshape", ["xt", "five"], ["x5"]), node("Reshape", ["dt", "five"], ["d5"]),
        node("ArgMax", ["x5"], ["a"], axis=4, keepdims=1), node("GatherElements", ["d5", "a"], ["g"], axis=4),
        node("Reshape", ["g", "out"], ["t"])],
        [_ints("six", [n, c, ho, 2, wo, 2]), _ints("five", [n, c, ho, wo, 4]), _ints("out", [n, c, ho, wo])])
    offsets = [(0, 0), (0, 1), (1, 0), (1, 1)]
    nodes = []
    for k in range(4):
        nodes += [node("Slice", ["x", f"s{k}", "end", "axes", "step"], [f"x{k}"]),
                  node("Slice", ["dx", f"s{k}", "end", "axes", "step"], [f"d{k}"])]
    chain = "d3"
    for k in (2, 1, 0):
        nodes += [node("Equal", [f"x{k}", "y"], [f"e{k}"]),
                  node("Where", [f"e{k}", f"d{k}", chain], ["t" if k == 0 else f"w{k}"])]
        chain = f"w{k}"
    out["strided Slice per offset + Equal/Where chain"] = _model(
        shape, nodes, [_ints(f"s{k}", list(o)) for k, o in enumerate(offsets)]
        + [_ints("end", [h, w]), _ints("axes", [2, 3]), _ints("step", [2, 2])])
    out["plain MaxPool (the forward's, for scale)"] = _model(
        shape, [node("MaxPool", ["x"], ["t"], kernel_shape=[2, 2], strides=[2, 2])])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="64,32,28,28", help="N,C,H,W of x, H and W even (default 64,32,28,28)")
    p.add_argument("--runs", type=int, default=60, help="timed runs per form, after 3 warm-up runs (default 60)")
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (default 1)")
    args = p.parse_args(argv)
    shape = tuple(int(v) for v in args.shape.split(","))
    rng = np.random.default_rng(0)
    x = np.maximum(rng.standard_normal(shape), 0).astype(np.float32)
    dx = rng.standard_normal(shape).astype(np.float32)
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    so.log_severity_level = 3
    sessions = {k: ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
                for k, m in forms(shape).items()}
    plain = "plain MaxPool (the forward's, for scale)"
    y = sessions[plain].run(None, {"x": x, "dx": dx, "y": x[:, :, ::2, ::2]})[0]
    feeds = {"x": x, "dx": dx, "y": y}
    first = None
    for k, s in sessions.items():
        if k != plain:
            t = s.run(None, feeds)[0]
            first = t if first is None else first
            assert np.array_equal(t, first), f"{k} gives another tangent"
    cpu = {k: [] for k in sessions}
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}; x {list(shape)}, "
          f"{args.threads} thread(s)")
    for r in range(args.runs + 3):
        for k, s in sessions.items():
            c = time.process_time()
            s.run(None, feeds)
            if r >= 3:
                cpu[k].append(time.process_time() - c)
    base = statistics.median(cpu["MaxPool with Indices + Gather (before)"])
    print("| form | median CPU ms | / before |\n| --- | ---: | ---: |")
    for k, v in cpu.items():
        print(f"| {k} | {1e3 * statistics.median(v):.2f} | {statistics.median(v) / base:.2f}x |")
    print(f"load average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
