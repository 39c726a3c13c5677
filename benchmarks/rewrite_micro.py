"""CPU time of one rewritten pattern alone: forward + backward (build_vjp) of a one- or few-node graph.

    PYTHONPATH=<worktree> python -m benchmarks.rewrite_micro maxpool|bn|linear|qkv [repeats]

maxpool: 2x2/2 MaxPool on 64x32x28x28 (the small CNN's first pool); bn: training-mode
BatchNormalization on the same shape; linear: MatMul(X, Transpose(W)) on 8x64x768 by 3072x768 (a
BERT-base feed-forward Linear exported without constant folding); qkv: three Gather picks of a
stacked 3x64x64x128 projection. One thread; the median process CPU time over the repeats, so two
worktrees can be compared back to back on a shared machine.
"""
import sys, time, numpy as np, onnx, onnxruntime as ort
from onnx import helper as h, TensorProto as T, numpy_helper as nh
from onnx_autodiff import build_vjp
kind = sys.argv[1] if len(sys.argv) > 1 else 'maxpool'
rng = np.random.default_rng(0)
if kind == "bn":
    C = 32; shape = [64, C, 28, 28]
    inits = [nh.from_array(rng.standard_normal(C).astype(np.float32), "s"), nh.from_array(np.zeros(C, np.float32), "b"),
             nh.from_array(np.zeros(C, np.float32), "m"), nh.from_array(np.ones(C, np.float32), "v")]
    nodes = [h.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"], training_mode=1)]
    wrt = ["x", "s", "b"]; feeds = {"x": rng.standard_normal(shape).astype(np.float32)}
elif kind == "linear":
    shape = [8, 64, 768]
    inits = [nh.from_array((0.02 * rng.standard_normal((3072, 768))).astype(np.float32), "w")]
    nodes = [h.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), h.make_node("MatMul", ["x", "wt"], ["y"])]
    wrt = ["x", "w"]; feeds = {"x": rng.standard_normal(shape).astype(np.float32)}
elif kind == "maxpool":
    shape = [64, 32, 28, 28]; inits = []
    nodes = [h.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2])]
    wrt = ["x"]; feeds = {"x": np.maximum(rng.standard_normal(shape), 0).astype(np.float32)}
elif kind == "qkv":
    shape = [3, 64, 64, 128]; inits = [nh.from_array(np.array(i, np.int64), f"i{i}") for i in range(3)]
    nodes = [h.make_node("Gather", ["x", f"i{i}"], [f"p{i}"], axis=0) for i in range(3)]
    nodes += [h.make_node("Mul", ["p0", "p1"], ["q"]), h.make_node("Mul", ["q", "p2"], ["y"])]
    wrt = ["x"]; feeds = {"x": rng.standard_normal(shape).astype(np.float32)}
g = h.make_graph(nodes, "m", [h.make_tensor_value_info("x", T.FLOAT, shape)], [], inits)
m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)]); m.ir_version = 8
inf = {v.name: v for v in onnx.shape_inference.infer_shapes(m).graph.value_info}
m.graph.output.extend([inf["y"]])
v = build_vjp(m, wrt=wrt)
so = ort.SessionOptions(); so.intra_op_num_threads = 1; so.inter_op_num_threads = 1; so.log_severity_level = 3
fs = ort.InferenceSession(v.forward.SerializeToString(), so, providers=["CPUExecutionProvider"])
bs = ort.InferenceSession(v.backward.SerializeToString(), so, providers=["CPUExecutionProvider"])
fnames = {i.name for i in fs.get_inputs()}
out = dict(zip([o.name for o in fs.get_outputs()], fs.run(None, {k: a for k, a in feeds.items() if k in fnames})))
dy = {f"{o}_grad": rng.standard_normal(out[o].shape).astype(np.float32) for o in v.outputs}
allf = {**feeds, **out, **dy}
bnames = {i.name for i in bs.get_inputs()}
bf = {k: a for k, a in allf.items() if k in bnames}
ts = []
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 20):
    t = time.process_time(); fs.run(None, {k: a for k, a in feeds.items() if k in fnames}); bs.run(None, bf); ts.append(time.process_time() - t)
print(f"{kind}: {1e3 * np.median(ts):.2f} ms CPU (median of {len(ts)}), backward ops {len(v.backward.graph.node)}")
