"""Forms of the 2x2/2 MaxPool gradient in standard ONNX, timed in onnxruntime: which one the rule should emit.

    python -m benchmarks.maxpool_forms [threads] [N,C,H,W] [webgpu]

Each form is one graph from x and dy to the pooled y and dx (PyTorch's tie rule: a window's dy goes to
its first maximum). The input is ReLU'd noise with whole rows of ones, so windows with ties occur. Every
form must give the same dx as the first, which is what ``gradient_rules/pooling.py`` emits for disjoint
windows. Prints the median wall time of 40 runs per form; results are in docs/benchmarks.md. ``webgpu``: on
onnxruntime's WebGPU plugin EP instead (driver/devices.py; where MaxPool has no Indices output, so the forms
that read it are left out), 10 runs per form.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def _model(shape, nodes, inits=()):
    n, c, h, w = shape
    g = helper.make_graph(nodes, "maxpool_grad",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, c, h, w]),
                           helper.make_tensor_value_info("dy", TensorProto.FLOAT, [n, c, h // 2, w // 2])],
                          [helper.make_tensor_value_info("dx", TensorProto.FLOAT, [n, c, h, w]),
                           helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, c, h // 2, w // 2])],
                          list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _pool(*outputs):
    return helper.make_node("MaxPool", ["x"], list(outputs), kernel_shape=[2, 2], strides=[2, 2])


def forms(shape) -> dict:
    n, c, h, w = shape
    zero = numpy_helper.from_array(np.array(0, np.float32), "zero")
    unpool = [helper.make_node("Shape", ["x"], ["sx"]),
              helper.make_node("MaxUnpool", ["dy", "i", "sx"], ["dx"], kernel_shape=[2, 2], strides=[2, 2])]
    out = {"MaxPool with Indices + MaxUnpool (the rule)": _model(shape, [_pool("y", "i")] + unpool),
           "plain MaxPool + MaxPool with Indices + MaxUnpool (the step before the forward gave the Indices)":
               _model(shape, [_pool("y"), _pool("y2", "i")] + unpool)}
    window6 = [n, c, h // 2, 2, w // 2, 2]
    out["windows last, ArgMax, Equal(Range), Where, back"] = _model(shape, [
        _pool("y"), helper.make_node("Reshape", ["x", "s6"], ["x6"]),
        helper.make_node("Transpose", ["x6"], ["xt"], perm=[0, 1, 2, 4, 3, 5]),
        helper.make_node("Reshape", ["xt", "s5"], ["x5"]),
        helper.make_node("ArgMax", ["x5"], ["am"], axis=-1, keepdims=1),
        helper.make_node("Equal", ["am", "r4"], ["hit"]),
        helper.make_node("Unsqueeze", ["dy", "last"], ["dy5"]),
        helper.make_node("Where", ["hit", "dy5", "zero"], ["g5"]),
        helper.make_node("Reshape", ["g5", "s6t"], ["g6"]),
        helper.make_node("Transpose", ["g6"], ["gt"], perm=[0, 1, 2, 4, 3, 5]),
        helper.make_node("Reshape", ["gt", "sx"], ["dx"])],
        [_ints("s6", window6), _ints("s5", [n, c, h // 2, w // 2, 4]), _ints("r4", [0, 1, 2, 3]),
         _ints("last", [-1]), zero, _ints("s6t", [n, c, h // 2, w // 2, 2, 2]), _ints("sx", shape)])
    nodes = [_pool("y")]
    inits = [_ints("axes", [2, 3]), _ints("steps", [2, 2]), _ints("ends", [h, w]), zero]
    for k, (a, b) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        inits.append(_ints(f"start{k}", [a, b]))
        nodes += [helper.make_node("Slice", ["x", f"start{k}", "ends", "axes", "steps"], [f"x{k}"]),
                  helper.make_node("Equal", [f"x{k}", "y"], [f"e{k}"])]
    nodes += [helper.make_node("Not", ["e0"], ["n0"]), helper.make_node("And", ["e1", "n0"], ["f1"]),
              helper.make_node("Not", ["e1"], ["ne1"]), helper.make_node("And", ["n0", "ne1"], ["n01"]),
              helper.make_node("And", ["e2", "n01"], ["f2"]), helper.make_node("Not", ["e2"], ["ne2"]),
              helper.make_node("And", ["n01", "ne2"], ["n012"]), helper.make_node("And", ["e3", "n012"], ["f3"])]
    nodes += [helper.make_node("Where", [f, "dy", "zero"], [f"g{k}"]) for k, f in enumerate(["e0", "f1", "f2", "f3"])]
    nodes += [helper.make_node("Concat", ["g0", "g1", "g2", "g3"], ["gc"], axis=1),
              helper.make_node("DepthToSpace", ["gc"], ["dx"], blocksize=2, mode="DCR")]
    out["strided Slices, first-maximum And/Not chain, Where, Concat, DepthToSpace"] = _model(shape, nodes, inits)
    out.update(_space_to_depth_forms(shape))
    out.update(_upsampled_forms(shape))
    out.update(_split_chain_form(shape))
    out["per-offset one-hot Conv masks, ConvTranspose (the webgpu rule's form for windows that overlap)"] = \
        _rule_form(shape, "webgpu", 10)
    out["strided Slices, Equal y, first-maximum chain, Where, Concat, DepthToSpace (the webgpu rule's form)"] = \
        _rule_form(shape, "webgpu", 17)
    return out


def _space_to_depth_forms(shape) -> dict:
    """SpaceToDepth lays each window's 4 offsets out as 4 channel blocks (row-major, the tie rule's order); ArgMax
    over them picks the first maximum, dy goes there by Equal(Range) + Where or by ScatterElements, DepthToSpace."""
    n, c, h, w = shape
    rest = c * (h // 2) * (w // 2)
    head = [_pool("y"), helper.make_node("SpaceToDepth", ["x"], ["xs"], blocksize=2),
            helper.make_node("Reshape", ["xs", "b4"], ["xb"]),
            helper.make_node("ArgMax", ["xb"], ["am"], axis=1, keepdims=1),
            helper.make_node("Reshape", ["dy", "b1"], ["dyb"])]
    tail = [helper.make_node("Reshape", ["gb", "sc"], ["gc"]),
            helper.make_node("DepthToSpace", ["gc"], ["dx"], blocksize=2, mode="DCR")]
    inits = [_ints("b4", [n, 4, rest]), _ints("b1", [n, 1, rest]), _ints("sc", [n, 4 * c, h // 2, w // 2])]
    where = [helper.make_node("Equal", ["am", "r4"], ["hit"]),
             helper.make_node("Where", ["hit", "dyb", "zero"], ["gb"])]
    scatter = [helper.make_node("ScatterElements", ["zeros", "am", "dyb"], ["gb"], axis=1)]
    return {"SpaceToDepth, ArgMax, Equal(Range), Where, DepthToSpace": _model(
                shape, head + where + tail, inits + [_ints("r4", np.arange(4).reshape(1, 4, 1)),
                                                     numpy_helper.from_array(np.array(0, np.float32), "zero")]),
            "SpaceToDepth, ArgMax, ScatterElements into zeros, DepthToSpace": _model(
                shape, head + scatter + tail, inits + [numpy_helper.from_array(np.zeros([n, 4, rest], np.float32),
                                                                               "zeros")])}


def _split_chain_form(shape) -> dict:
    """SpaceToDepth lays each window's 4 offsets out as 4 channel blocks (row-major: the tie rule's order), a Split
    takes them apart (contiguous runs), each is compared with y, a first-maximum And/Not chain keeps the first, and
    Cast + Mul put dy there (no ArgMax, no Where, no strided Slice); Concat and DepthToSpace put the blocks back."""
    n, c, h, w = shape
    rest = c * (h // 2) * (w // 2)
    nodes = [_pool("y"), helper.make_node("SpaceToDepth", ["x"], ["xs"], blocksize=2),
             helper.make_node("Reshape", ["xs", "b4"], ["xb"]),
             helper.make_node("Split", ["xb"], ["x0", "x1", "x2", "x3"], axis=1),
             helper.make_node("Reshape", ["y", "b1"], ["yb"]), helper.make_node("Reshape", ["dy", "b1"], ["dyb"])]
    nodes += [helper.make_node("Equal", [f"x{k}", "yb"], [f"m{k}"]) for k in range(4)]
    nodes += [helper.make_node("Not", ["m0"], ["n0"]), helper.make_node("And", ["m1", "n0"], ["s1"]),
              helper.make_node("Or", ["m0", "m1"], ["o1"]), helper.make_node("Not", ["o1"], ["n1"]),
              helper.make_node("And", ["m2", "n1"], ["s2"]), helper.make_node("Or", ["o1", "m2"], ["o2"]),
              helper.make_node("Not", ["o2"], ["n2"]), helper.make_node("And", ["m3", "n2"], ["s3"]),
              helper.make_node("Identity", ["m0"], ["s0"])]
    for k in range(4):
        nodes += [helper.make_node("Cast", [f"s{k}"], [f"f{k}"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", [f"f{k}", "dyb"], [f"g{k}"])]
    nodes += [helper.make_node("Concat", [f"g{k}" for k in range(4)], ["gb"], axis=1),
              helper.make_node("Reshape", ["gb", "sc"], ["gc"]),
              helper.make_node("DepthToSpace", ["gc"], ["dx"], blocksize=2, mode="DCR")]
    inits = [_ints("b4", [n, 4, rest]), _ints("b1", [n, 1, rest]), _ints("sc", [n, 4 * c, h // 2, w // 2])]
    return {"plain MaxPool; SpaceToDepth, Split, Equal y, first-maximum And/Not chain, Cast, Mul, Concat, DepthToSpace":
            _model(shape, nodes, inits)}


def _upsampled_forms(shape) -> dict:
    """Forms that compare x with y brought back to x's size (no Indices): the maxima are ``x == up(y)``; the
    first of a window's maxima is the one whose offset code (K - offset, > 0) equals the window's largest
    code among its maxima, itself a plain MaxPool of the codes."""
    n, c, h, w = shape
    codes = np.tile(np.array([[4, 3], [2, 1]], np.float32), (h // 2, w // 2))[None, None]
    inits = [numpy_helper.from_array(codes, "code"), numpy_helper.from_array(np.array(0, np.float32), "zero"),
             numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")]
    out = {}
    for name, up in (("Resize", _resize_up), ("Reshape + Expand", _expand_up)):
        nodes, more = [_pool("y")], []
        nodes += up("y", "yu", shape, more)
        nodes += [helper.make_node("Equal", ["x", "yu"], ["m"]), helper.make_node("Cast", ["m"], ["mf"], to=1),
                  helper.make_node("Mul", ["mf", "code"], ["mc"]),
                  helper.make_node("MaxPool", ["mc"], ["first"], kernel_shape=[2, 2], strides=[2, 2])]
        nodes += up("first", "fu", shape, more)
        nodes += [helper.make_node("Equal", ["mc", "fu"], ["sel"]), helper.make_node("Cast", ["sel"], ["self"], to=1)]
        nodes += up("dy", "du", shape, more)
        nodes += [helper.make_node("Mul", ["self", "du"], ["dx"])]
        out[f"up(y) by {name}, Equal, Cast, offset codes, MaxPool of codes, up, Equal, Cast, up(dy), Mul"] = \
            _model(shape, nodes, inits + more)
    return out


def _resize_up(src, dst, shape, inits):
    return [helper.make_node("Resize", [src, "", "scales"], [dst], mode="nearest")]


def _expand_up(src, dst, shape, inits):
    n, c, h, w = shape
    if not inits:
        inits += [_ints("s6", [n, c, h // 2, 1, w // 2, 1]), _ints("e6", [n, c, h // 2, 2, w // 2, 2]),
                  _ints("sx", shape)]
    return [helper.make_node("Reshape", [src, "s6"], [dst + "6"]),
            helper.make_node("Expand", [dst + "6", "e6"], [dst + "e"]),
            helper.make_node("Reshape", [dst + "e", "sx"], [dst])]


def _rule_form(shape, target: str, opset: int):
    """What the MaxPool rule emits for ``target``: the lowered Gradient of sum(MaxPool(x) * dy) w.r.t. x (below
    opset 11, the per-offset masks)."""
    from onnx_autodiff import lower

    n, c, h, w = shape
    pooled = [n, c, h // 2, w // 2]
    g = helper.make_graph([_pool("y"), helper.make_node("Mul", ["y", "dy"], ["yd"]),
                           helper.make_node("ReduceSum", ["yd"], ["s"], keepdims=0),
                           helper.make_node("Gradient", ["x"], ["dx"], domain="ai.onnx.preview.training", xs=["x"],
                                            y="s")], "rule",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
                           helper.make_tensor_value_info("dy", TensorProto.FLOAT, pooled)],
                          [helper.make_tensor_value_info("dx", TensorProto.FLOAT, shape),
                           helper.make_tensor_value_info("y", TensorProto.FLOAT, pooled)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset),
                                            helper.make_opsetid("ai.onnx.preview.training", 1)])
    m.ir_version = 9
    return lower(m, target=target)


def _session(model, opts, webgpu: bool):
    if not webgpu:
        return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    from onnx_autodiff.driver.devices import WEBGPU, resolve_device

    device = resolve_device([WEBGPU])
    return device.session(model.SerializeToString(), device.add_to(opts))


def main(threads: int, shape: list[int], webgpu: bool = False) -> None:
    rng = np.random.default_rng(0)
    x = np.maximum(rng.standard_normal(shape), 0).astype(np.float32)
    x[:, :, :4] = 1.0  # whole windows of equal values: the tie rule matters
    dy = rng.standard_normal([shape[0], shape[1], shape[2] // 2, shape[3] // 2]).astype(np.float32)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads, opts.log_severity_level = threads, 1, 3
    where = "the WebGPU plugin EP" if webgpu else f"{threads} thread(s)"
    print(f"MaxPool 2x2/2 gradient on {'x'.join(map(str, shape))}, {where}, onnxruntime {ort.__version__}")
    reference = forms(shape)["MaxPool with Indices + MaxUnpool (the rule)"]
    reference = ort.InferenceSession(reference.SerializeToString(), opts).run(["dx"], {"x": x, "dy": dy})[0]
    for name, model in forms(shape).items():
        if webgpu and any(len(n.output) > 1 for n in model.graph.node if n.op_type == "MaxPool"):
            continue  # WebGPU's MaxPool has no Indices output
        sess = _session(model, opts, webgpu)
        dx = sess.run(["dx"], {"x": x, "dy": dy})[0]
        assert np.array_equal(dx, reference), f"{name}: another dx than the rule's form"
        times = []
        for _ in range(10 if webgpu else 40):
            t0 = time.perf_counter()
            sess.run(["dx", "y"], {"x": x, "dy": dy})
            times.append(time.perf_counter() - t0)
        print(f"{np.median(times) * 1e3:8.2f} ms  {name}")


def cli(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("threads", nargs="?", type=int, default=2, help="onnxruntime intra-op threads (default 2)")
    p.add_argument("shape", nargs="?", default="64,32,28,28",
                   help="N,C,H,W of the input, H and W even (default 64,32,28,28; 8,4,8,8 runs in a blink)")
    p.add_argument("device", nargs="?", choices=["cpu", "webgpu"], default="cpu",
                   help="webgpu: onnxruntime's WebGPU plugin EP (the webgpu extra and an adapter)")
    args = p.parse_args(argv)
    try:
        shape = [int(v) for v in args.shape.split(",")]
    except ValueError:
        shape = []
    if len(shape) != 4 or shape[2] % 2 or shape[3] % 2 or min(shape) < 1:
        p.error(f"shape {args.shape!r}: expected N,C,H,W with H and W even, such as 64,32,28,28")
    main(args.threads, shape, args.device == "webgpu")


if __name__ == "__main__":
    cli()
