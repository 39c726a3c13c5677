"""CPU time of one rewritten pattern alone: forward + backward (build_vjp) of a one- or few-node graph.

    python -m benchmarks.rewrite_micro maxpool|bn|linear|qkv [repeats]

maxpool: 2x2/2 MaxPool on 64x32x28x28 (the small CNN's first pool); bn: training-mode
BatchNormalization on the same shape; linear: MatMul(X, Transpose(W)) on 8x64x768 by 3072x768 (a
BERT-base feed-forward Linear exported without constant folding); qkv: three Gather picks of a
stacked 3x64x64x128 projection. One thread; the median process CPU time over the repeats, so two
worktrees can be compared back to back on a shared machine (PYTHONPATH=<worktree>).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import build_vjp

KINDS = ("maxpool", "bn", "linear", "qkv")


def pattern(kind: str, rng: np.random.Generator):
    """(nodes, initializers, x's shape, tensors to differentiate by, feeds) of one pattern."""
    def arr(a):
        return np.asarray(a, np.float32)

    if kind == "bn":
        c, shape = 32, [64, 32, 28, 28]
        inits = [numpy_helper.from_array(arr(rng.standard_normal(c)), "s"),
                 numpy_helper.from_array(np.zeros(c, np.float32), "b"),
                 numpy_helper.from_array(np.zeros(c, np.float32), "m"),
                 numpy_helper.from_array(np.ones(c, np.float32), "v")]
        nodes = [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"],
                                  training_mode=1)]
        return nodes, inits, shape, ["x", "s", "b"], {"x": arr(rng.standard_normal(shape))}
    if kind == "linear":
        shape = [8, 64, 768]
        inits = [numpy_helper.from_array(arr(0.02 * rng.standard_normal((3072, 768))), "w")]
        nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
                 helper.make_node("MatMul", ["x", "wt"], ["y"])]
        return nodes, inits, shape, ["x", "w"], {"x": arr(rng.standard_normal(shape))}
    if kind == "maxpool":
        shape = [64, 32, 28, 28]
        nodes = [helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2])]
        return nodes, [], shape, ["x"], {"x": arr(np.maximum(rng.standard_normal(shape), 0))}
    if kind == "qkv":
        shape = [3, 64, 64, 128]
        inits = [numpy_helper.from_array(np.array(i, np.int64), f"i{i}") for i in range(3)]
        nodes = [helper.make_node("Gather", ["x", f"i{i}"], [f"p{i}"], axis=0) for i in range(3)]
        nodes += [helper.make_node("Mul", ["p0", "p1"], ["q"]), helper.make_node("Mul", ["q", "p2"], ["y"])]
        return nodes, inits, shape, ["x"], {"x": arr(rng.standard_normal(shape))}
    raise SystemExit(f"unknown pattern {kind!r}; pick one of {', '.join(KINDS)}")


def main(kind: str, repeats: int) -> None:
    rng = np.random.default_rng(0)
    nodes, inits, shape, wrt, feeds = pattern(kind, rng)
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)], [], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    model.graph.output.append(inferred["y"])
    vjp = build_vjp(model, wrt=wrt)

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.log_severity_level = 3
    forward = ort.InferenceSession(vjp.forward.SerializeToString(), so, providers=["CPUExecutionProvider"])
    backward = ort.InferenceSession(vjp.backward.SerializeToString(), so, providers=["CPUExecutionProvider"])
    forward_feeds = {i.name: feeds[i.name] for i in forward.get_inputs()}
    outs = dict(zip([o.name for o in forward.get_outputs()], forward.run(None, forward_feeds)))
    seeds = {f"{o}_grad": rng.standard_normal(outs[o].shape).astype(np.float32) for o in vjp.outputs}
    available = {**feeds, **outs, **seeds}
    backward_feeds = {i.name: available[i.name] for i in backward.get_inputs()}

    times = []
    for _ in range(repeats):
        start = time.process_time()
        forward.run(None, forward_feeds)
        backward.run(None, backward_feeds)
        times.append(time.process_time() - start)
    print(f"{kind}: {1e3 * np.median(times):.2f} ms CPU (median of {len(times)}), "
          f"backward ops {len(vjp.backward.graph.node)}")


def cli(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pattern", nargs="?", choices=KINDS, default="maxpool", help="the pattern (default maxpool)")
    p.add_argument("repeats", nargs="?", type=int, default=20, help="timed runs; the median is printed (default 20)")
    args = p.parse_args(argv)
    main(args.pattern, max(args.repeats, 1))


if __name__ == "__main__":
    cli()
