"""The Conv gradient graphs alone, by CPU time: which form is faster for which layer shape.

    python -m benchmarks.conv_grad_micro [SHAPE...] [--input] [--forms F,...] [--weight-forms F,...] [--runs 5]

For each shape (ResNet-18's 7x7/2 stem on 3x64x64, the small CNN's first and second convs, a 64->64 3x3
layer, a 64->128 3x3/2 layer, batch 64; ResNet-18's 3x3 convs of stages 2-4 at batch 32) it builds the backward
of a one-Conv model w.r.t. the weight in each of ``--weight-forms`` (``WEIGHT_FORMS``: one Gemm per kernel offset,
im2col rows per sample, im2col rows by one Gemm, the Conv of x by dz, the rule's choice; default the first two)
and, with ``--input``, w.r.t. the input in each of ``--forms`` (``INPUT_FORMS``: one Gemm over the batch and a
Pad per kernel offset, the same Gemm and one Col2Im (opset 18), a Conv of dy with the flipped kernel (stride 1;
a ConvTranspose where strided), a ConvTranspose, the rule's choice at opset 17 and 18; default the first four),
each form forced at every shape. It times them in onnxruntime (one thread unless ``--threads``), the forms'
sessions run in turn ``--runs`` times, process CPU time (min), so a busy machine inflates it less than wall time
and a load change hits every form alike.
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


INPUT_FORMS = {  # name: (opset, emitter options) of the input gradient's forms, each forced at every shape
    "batched": (17, {"batched_input_grad_max_out": 10**9}),  # one Gemm over the batch + a Pad per offset
    "col2im": (18, {"batched_input_grad_max_out": 10**9}),  # one Gemm over the batch + one Col2Im
    "flipped": (17, {"batched_input_grad_max_out": 0}),  # a Conv of the flipped kernel (stride 1)
    "transpose": (17, {"batched_input_grad_max_out": 0, "flipped_conv_input_grad": False}),  # a ConvTranspose
    "rule": (17, {}),  # what the rule emits at opset 17
    "rule18": (18, {}),  # what the rule emits at opset 18
}


WEIGHT_FORMS = {  # name: emitter options of the weight gradient's forms, each forced at every shape
    "offsets": {"im2col_columns": 0, "im2col_weight_grad_max_out": 0},  # one Gemm per kernel offset over strided slices
    "im2col": {"im2col_columns": 10**9},  # im2col rows and one product (per sample at stride 1)
    "im2col_gemm": {"im2col_columns": 10**9, "im2col_batched": False},  # im2col rows [K*C, out*N], one Gemm
    "conv": {"gemm_weight_grad": False},  # a Conv of x by dz, batch and channel axes swapped
    "wrule": {},  # what the rule emits
}


def weight_grad_ms(name: str, im2col: bool, threads: int = 1) -> float:
    return weight_grad_times(name, ["im2col" if im2col else "offsets"], threads)["im2col" if im2col else "offsets"]


def weight_grad_times(name: str, forms: list[str], threads: int = 1, runs: int = 5) -> dict[str, float]:
    """Min process CPU ms per weight-gradient form of ``runs`` runs, the forms run in turn."""
    return _interleaved({f: _session(name, "w", threads, 17, **WEIGHT_FORMS[f]) for f in forms}, runs)


def input_grad_ms(name: str, form: str, threads: int = 1) -> float:
    """``form``: one of ``INPUT_FORMS``: "batched" (one Gemm over the batch and a per-offset scatter), "col2im"
    (the same Gemm and one Col2Im, opset 18), "flipped" (a Conv of the flipped kernel at stride 1; strided
    shapes take a ConvTranspose), "transpose" (a ConvTranspose), "rule" / "rule18" (the rule's own choice)."""
    return input_grad_times(name, [form], threads)[form]


def input_grad_times(name: str, forms: list[str], threads: int = 1, runs: int = 5) -> dict[str, float]:
    """Min process CPU ms per form of ``runs`` runs, the forms' sessions built first and run in turn."""
    sessions = {f: _session(name, "x", threads, INPUT_FORMS[f][0], **INPUT_FORMS[f][1]) for f in forms}
    return _interleaved(sessions, runs)


def _session(name: str, wrt: str, threads: int, opset: int, **options):
    """The backward of the shape's one-Conv model w.r.t. ``wrt`` in onnxruntime, with its feeds. The weight is
    a graph input, as in a training step (an initializer would let onnxruntime fold the flipped kernel and
    prepack it, which a step cannot)."""
    with emit_options(**options):
        xs, ws, attrs = SHAPES[name]
        graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], **attrs)], "conv",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(xs)),
                                   helper.make_tensor_value_info("w", TensorProto.FLOAT, list(ws))], [])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
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
    return sess, feeds


def _interleaved(sessions: dict, runs: int) -> dict[str, float]:
    """Min process CPU ms of ``runs`` runs per session, the sessions run in turn (a load change hits all)."""
    times = {k: [] for k in sessions}
    for _ in range(runs):
        for k, (sess, feeds) in sessions.items():
            t = time.process_time()
            sess.run(None, feeds)
            times[k].append(time.process_time() - t)
    return {k: 1e3 * min(v) for k, v in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="*", metavar="SHAPE",
                   help=f"layer shapes to time, of {', '.join(SHAPES)} (default all; cnn1 is the smallest)")
    p.add_argument("--input", action="store_true", help="also time the input gradient's forms")
    p.add_argument("--forms", default="batched,col2im,flipped,transpose",
                   help=f"with --input: the input gradient's forms, of {', '.join(INPUT_FORMS)}")
    p.add_argument("--weight-forms", default="offsets,im2col",
                   help=f"the weight gradient's forms, of {', '.join(WEIGHT_FORMS)} ('' for none)")
    p.add_argument("--runs", type=int, default=5, help="timed runs per form, the forms in turn (default 5)")
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (default 1)")
    args = p.parse_args(argv)
    names = args.shapes or list(SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        p.error(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")
    t = args.threads
    where = f"CPU time, {t} thread{'s' if t > 1 else ''}"
    forms = args.forms.split(",")
    wforms = [f for f in args.weight_forms.split(",") if f]
    if any(f not in INPUT_FORMS for f in forms) or any(f not in WEIGHT_FORMS for f in wforms):
        p.error(f"unknown forms in {args.forms!r} / {args.weight_forms!r}; choose from {', '.join(INPUT_FORMS)} "
                f"/ {', '.join(WEIGHT_FORMS)}")
    for name in names:
        if wforms:
            times = weight_grad_times(name, wforms, t, args.runs)
            print(f"{name} weight gradient: " + ", ".join(f"{f} {v:.1f} ms" for f, v in times.items())
                  + f" ({where})", flush=True)
        if args.input:
            times = input_grad_times(name, forms, t, args.runs)
            print(f"{name} input gradient: " + ", ".join(f"{f} {v:.1f} ms" for f, v in times.items())
                  + f" ({where})", flush=True)


if __name__ == "__main__":
    main()
