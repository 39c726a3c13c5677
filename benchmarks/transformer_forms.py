"""The transformer step's rewritten backward forms alone: each form's backward graph (``build_vjp``) timed
against the old one, which an emitter option switches back on, in one process, alternating.

    python -m benchmarks.transformer_forms layernorm [repeats] [--tiny]

layernorm: LayerNormalization over 64x64x128 (the benchmark TransformerEncoderLayer's norms), option
``layer_norm_kernel_moments``. One thread; the median process CPU time of the backward run over the repeats.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import build_vjp
from onnx_autodiff.engine.builder import emit_options

KINDS = {"layernorm": "layer_norm_kernel_moments"}


def _model(nodes, shape, inits, out_shape):
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(out_shape))], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def layernorm(rng, batch=64, seq=64, d=128):
    inits = [numpy_helper.from_array(rng.standard_normal(d).astype(np.float32), n) for n in ("s", "b")]
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1, epsilon=1e-5)
    return _model([node], (batch, seq, d), inits, (batch, seq, d)), ["x", "s", "b"]


def _session(model):
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = 1, 1, 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def backward(model, wrt, option: str, on: bool):
    """(backward session, its feeds, its op types) of ``model`` lowered with ``option`` on or off."""
    with emit_options(**{option: on}):
        v = build_vjp(model, wrt=wrt)
    rng = np.random.default_rng(1)
    x = rng.standard_normal([d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)
    fwd = dict(zip([o.name for o in v.forward.graph.output], _session(v.forward).run(None, {"x": x})))
    feeds = {"x": x, **fwd, **{f"{o}_grad": rng.standard_normal(fwd[o].shape).astype(np.float32) for o in v.outputs}}
    sess = _session(v.backward)
    names = {i.name for i in sess.get_inputs()}
    return sess, {k: a for k, a in feeds.items() if k in names}, [n.op_type for n in v.backward.graph.node]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=sorted(KINDS))
    p.add_argument("repeats", type=int, nargs="?", default=20)
    p.add_argument("--tiny", action="store_true", help="batch 2, sequence 8, width 16: to see that it runs")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    model, wrt = layernorm(rng, batch=2, seq=8, d=16) if args.tiny else layernorm(rng)
    sides = {on: backward(model, wrt, KINDS[args.kind], on) for on in (False, True)}
    times = {on: [] for on in sides}
    for _ in range(args.repeats):
        for on, (sess, feeds, _) in sides.items():
            sess.run(None, feeds)
            t = time.process_time()
            sess.run(None, feeds)
            times[on].append(time.process_time() - t)
    print(f"{args.kind} backward, 1 thread, process CPU ms (median of {args.repeats}, alternating):")
    for on, label in ((False, "old form"), (True, "new form")):
        ops = sides[on][2]
        print(f"  {label} ({KINDS[args.kind]}={on}): {1e3 * float(np.median(times[on])):.2f} ms, "
              f"{len(ops)} backward nodes")


if __name__ == "__main__":
    main()
