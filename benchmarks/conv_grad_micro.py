"""The Conv weight-gradient graph alone, by CPU time: which form is faster for which layer shape.

    python -m benchmarks.conv_grad_micro [stem cnn1 l1 l2s]

For each shape (ResNet-18's 7x7/2 stem on 3x64x64, the small CNN's first conv, a 64->64 3x3 layer, a
64->128 3x3/2 layer; batch 64) it builds the backward of a one-Conv model w.r.t. the weight and times
it in onnxruntime with one thread, twice: with the im2col-rows form forced off (one Gemm per kernel
offset) and forced on. Process CPU time (min of 5), so a busy machine inflates it less than wall time.
The rule picks im2col rows below the emitter option ``im2col_columns`` (256) columns (input channels x kernel offsets).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import build_vjp
from onnx_autodiff.engine.builder import emit_options

SHAPES = {"stem": ((64, 3, 64, 64), (64, 3, 7, 7), {"strides": [2, 2], "pads": [3, 3, 3, 3]}),
          "cnn1": ((64, 1, 28, 28), (32, 1, 3, 3), {"pads": [1, 1, 1, 1]}),
          "l1": ((64, 64, 16, 16), (64, 64, 3, 3), {"pads": [1, 1, 1, 1]}),
          "l2s": ((64, 64, 16, 16), (128, 64, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]})}


def weight_grad_ms(name: str, im2col: bool) -> float:
    with emit_options(im2col_columns=10**9 if im2col else 0):
        xs, ws, attrs = SHAPES[name]
        w = np.random.default_rng(0).random(ws, dtype=np.float32)
        graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], **attrs)], "conv",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(xs))], [],
                                  [numpy_helper.from_array(w, "w")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
        model.graph.output.append(inferred["y"])
        backward = build_vjp(model, wrt=["w"]).backward
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(backward.SerializeToString(), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    feeds = {i.name: rng.random([d if isinstance(d, int) else 1 for d in i.shape], dtype=np.float32)
             for i in sess.get_inputs()}
    sess.run(None, feeds)
    times = []
    for _ in range(5):
        t = time.process_time()
        sess.run(None, feeds)
        times.append(time.process_time() - t)
    return 1e3 * min(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="*", metavar="SHAPE",
                   help=f"layer shapes to time, of {', '.join(SHAPES)} (default all; cnn1 is the smallest)")
    names = p.parse_args(argv).shapes or list(SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        p.error(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")
    for name in names:
        print(f"{name}: one Gemm per offset {weight_grad_ms(name, False):.1f} ms, "
              f"im2col rows {weight_grad_ms(name, True):.1f} ms (CPU time, 1 thread)")


if __name__ == "__main__":
    main()
