"""The Conv gradient graphs alone, by CPU time: which form is faster for which layer shape.

    python -m benchmarks.conv_grad_micro [stem cnn1 cnn2 l1 l2s] [--input] [--threads N]

For each shape (ResNet-18's 7x7/2 stem on 3x64x64, the small CNN's first and second convs, a 64->64 3x3
layer, a 64->128 3x3/2 layer; batch 64) it builds the backward of a one-Conv model w.r.t. the weight and
times it in onnxruntime (one thread unless ``--threads``), twice: with the im2col-rows form forced off (one
Gemm per kernel offset) and forced on. ``--input``: also the backward w.r.t. the input in its three forms: one Gemm over
the batch and a per-offset scatter (the rule's form up to ``batched_input_grad_max_out``, 16, output positions),
a Conv of dy with the flipped kernel (the rule's form above that at stride 1) and a ConvTranspose (emitter
option ``flipped_conv_input_grad`` off; strided shapes take it either way). Process CPU time (min of 5), so
a busy machine inflates it less than wall time. The rule picks im2col rows below the emitter option
``im2col_columns`` (256) columns (input channels x kernel offsets).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from onnx_autodiff import build_vjp
from onnx_autodiff.engine.builder import emit_options

SHAPES = {"stem": ((64, 3, 64, 64), (64, 3, 7, 7), {"strides": [2, 2], "pads": [3, 3, 3, 3]}),
          "cnn1": ((64, 1, 28, 28), (32, 1, 3, 3), {"pads": [1, 1, 1, 1]}),
          "cnn2": ((64, 32, 14, 14), (64, 32, 3, 3), {"pads": [1, 1, 1, 1]}),
          "l1": ((64, 64, 16, 16), (64, 64, 3, 3), {"pads": [1, 1, 1, 1]}),
          "l2s": ((64, 64, 16, 16), (128, 64, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
          # ResNet-18 at 3x64x64, batch 32: 3x3 convs of its stages 2 and 3 (8x8, 4x4), its last stage's strided
          # 256->512 conv (2x2 out) and a 512->512 conv
          "l2": ((32, 128, 8, 8), (128, 128, 3, 3), {"pads": [1, 1, 1, 1]}),
          "l3": ((32, 256, 4, 4), (256, 256, 3, 3), {"pads": [1, 1, 1, 1]}),
          "l4s": ((32, 256, 4, 4), (512, 256, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
          "l4": ((32, 512, 2, 2), (512, 512, 3, 3), {"pads": [1, 1, 1, 1]})}


def weight_grad_ms(name: str, im2col: bool, threads: int = 1) -> float:
    return _backward_ms(name, "w", threads, im2col_columns=10**9 if im2col else 0)


def input_grad_ms(name: str, form: str, threads: int = 1) -> float:
    """``form``: "batched" (one Gemm over the batch, where the shape has few output positions: else the rule's
    default), "flipped" (a Conv of the flipped kernel at stride 1) or "transpose" (a ConvTranspose)."""
    options = {} if form == "batched" else {"batched_input_grad_max_out": 0}
    return _backward_ms(name, "x", threads, flipped_conv_input_grad=form != "transpose", **options)


def _backward_ms(name: str, wrt: str, threads: int, **options) -> float:
    """Min process CPU ms of 5 runs of the backward of the shape's one-Conv model w.r.t. ``wrt``. The weight is
    a graph input, as in a training step (an initializer would let onnxruntime fold the flipped kernel and
    prepack it, which a step cannot)."""
    with emit_options(**options):
        xs, ws, attrs = SHAPES[name]
        graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], **attrs)], "conv",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(xs)),
                                   helper.make_tensor_value_info("w", TensorProto.FLOAT, list(ws))], [])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
        model.graph.output.append(inferred["y"])
        backward = build_vjp(model, wrt=[wrt]).backward
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
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
    p.add_argument("--input", action="store_true", help="also time the input gradient's two forms")
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (default 1)")
    args = p.parse_args(argv)
    names = args.shapes or list(SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        p.error(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")
    t = args.threads
    where = f"CPU time, {t} thread{'s' if t > 1 else ''}"
    for name in names:
        print(f"{name}: one Gemm per offset {weight_grad_ms(name, False, t):.1f} ms, "
              f"im2col rows {weight_grad_ms(name, True, t):.1f} ms ({where})")
        if args.input:
            times = {f: input_grad_ms(name, f, t) for f in ("batched", "flipped", "transpose")}
            print(f"{name} input gradient: one Gemm over the batch {times['batched']:.1f} ms, Conv of the flipped "
                  f"kernel {times['flipped']:.1f} ms, ConvTranspose {times['transpose']:.1f} ms ({where})")


if __name__ == "__main__":
    main()
