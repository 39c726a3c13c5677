"""Convolution, pooling and normalization gradients against torch autograd.

onnxruntime's CPU provider has no float64 kernel for Conv, ConvTranspose, AveragePool,
GlobalAveragePool, GlobalMaxPool or InstanceNormalization (checked on onnxruntime 1.31), so the
float64 finite-difference sweep in onnx_autodiff/conformance/cases cannot run them. Here the lowered gradient runs in
float32 onnxruntime and is held against torch autograd run in float64 on the same (float32) inputs;
float32 accumulation keeps the error near 1e-6 of the gradient's scale, so 1e-4 is a real check.
The ops that do run in float64 are also checked here when torch has a direct counterpart.
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

import onnx_autodiff as oa
from onnx_autodiff.testing import In, RuleCase, rule_case_model

RTOL = 1e-4
TRAIN = "ai.onnx.preview.training"


def lowered_gradients(case: RuleCase, seed: int = 0):
    """(feeds, vs, {input: gradient of sum_k <y_k, v_k>}) from our lowering, run in onnxruntime.

    The sum runs over the outputs in ``case.check_outputs`` (default: the first)."""
    model, feeds, wrt = rule_case_model(case, seed)
    g = model.graph
    outs = [g.output[k] for k in (case.check_outputs or [0])]
    ys = _run(model, feeds)
    rng = np.random.default_rng(seed + 1)
    vs, terms = {}, []
    for k, y in enumerate(outs):
        v = rng.standard_normal(ys[y.name].shape).astype(ys[y.name].dtype)
        vs[f"v{k}"] = v
        g.input.append(helper.make_tensor_value_info(f"v{k}", y.type.tensor_type.elem_type, list(v.shape)))
        g.node.append(helper.make_node("Mul", [y.name, f"v{k}"], [f"s/prod{k}"], name=f"s/mul{k}"))
        g.node.append(helper.make_node("ReduceSum", [f"s/prod{k}"], [f"s/term{k}"], name=f"s/sum{k}", keepdims=0))
        terms.append(f"s/term{k}")
    g.node.append(helper.make_node("Sum", terms, ["s"], name="s/total"))
    names = [f"{w}_grad" for w in wrt]
    g.node.append(helper.make_node("Gradient", wrt, names, name="grad", domain=TRAIN, xs=wrt, y="s"))
    types = {i.name: i.type.tensor_type for i in g.input}
    for w, n in zip(wrt, names):
        g.output.append(helper.make_tensor_value_info(n, types[w].elem_type, [d.dim_value for d in types[w].shape.dim]))
    model.opset_import.append(helper.make_opsetid(TRAIN, 1))
    lowered = oa.lower(model)
    out = _run(lowered, {**feeds, **vs})
    return feeds, list(vs.values()), {w: out[n] for w, n in zip(wrt, names)}


def _run(model, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in model.graph.output], sess.run(None, feeds)))


def torch_gradients(fn, feeds, vs):
    ts = {k: torch.tensor(a.astype(np.float64), requires_grad=True) for k, a in feeds.items()}
    ys = fn(**ts)
    ys = ys if isinstance(ys, tuple) else (ys,)
    assert len(ys) == len(vs)
    sum((y * torch.tensor(v.astype(np.float64))).sum() for y, v in zip(ys, vs)).backward()
    return {k: t.grad.numpy() if t.grad is not None else np.zeros_like(feeds[k], dtype=np.float64)
            for k, t in ts.items()}


def assert_matches_torch(case, fn, seed=0):
    feeds, vs, ours = lowered_gradients(case, seed)
    ref = torch_gradients(fn, feeds, vs)
    assert ours, "nothing was differentiated"
    for name, got in ours.items():
        want = ref[name]
        assert got.shape == want.shape, name
        scale = np.abs(want).max()
        assert scale > 0, f"the torch gradient of {name} is zero: the case tests nothing"
        err = np.abs(got.astype(np.float64) - want).max() / scale
        assert err <= RTOL, f"{case.name}: gradient of {name} off by {err:.2e} (relative to max |grad|)"


def f32(*shape, **kw):
    return In(shape, dtype="float32", **kw)


def _pads(p, r):
    """ONNX pads [b1.., e1..] as the per-side pads torch's F.pad wants (last axis first)."""
    out = []
    for i in reversed(range(r)):
        out += [p[i], p[r + i]]
    return out


def conv(r, stride=1, padding=(0,), dilation=1, groups=1, bias=True):
    def fn(x0, x1, x2=None):
        pad = list(padding) * (2 * r // len(padding))
        xp = F.pad(x0, _pads(pad, r))
        return [F.conv1d, F.conv2d, F.conv3d][r - 1](xp, x1, x2, stride=stride, dilation=dilation, groups=groups)
    return fn


CONV = [
    (RuleCase("Conv", [f32(2, 3, 7), f32(4, 3, 3), f32(4)], id="1d-bias"), conv(1)),
    (RuleCase("Conv", [f32(2, 4, 6, 5), f32(6, 2, 3, 2)],
              attrs={"group": 2, "strides": [2, 1], "dilations": [1, 2], "pads": [1, 0, 2, 1]},
              id="2d-group-stride-dil"),
     lambda x0, x1: F.conv2d(F.pad(x0, [0, 1, 1, 2]), x1, stride=(2, 1), dilation=(1, 2), groups=2)),
    (RuleCase("Conv", [f32(2, 3, 8, 8), f32(3, 1, 3, 3), f32(3)], attrs={"group": 3, "pads": [1, 1, 1, 1]},
              id="depthwise"),
     lambda x0, x1, x2: F.conv2d(x0, x1, x2, padding=1, groups=3)),
    (RuleCase("Conv", [f32(1, 2, 9, 7), f32(3, 2, 3, 3)], attrs={"strides": [2, 3]}, id="stride-not-dividing"),
     lambda x0, x1: F.conv2d(x0, x1, stride=(2, 3))),
    (RuleCase("Conv", [f32(2, 2, 7, 6), f32(3, 2, 3, 2)], attrs={"auto_pad": "SAME_UPPER", "strides": [2, 2]},
              id="same-upper"),
     lambda x0, x1: F.conv2d(F.pad(x0, [0, 0, 1, 1]), x1, stride=2)),
    (RuleCase("Conv", [f32(2, 2, 6, 6), f32(3, 2, 4, 3)], attrs={"auto_pad": "SAME_LOWER"}, id="same-lower"),
     lambda x0, x1: F.conv2d(F.pad(x0, [1, 1, 2, 1]), x1)),
    (RuleCase("Conv", [f32(1, 2, 6, 5), f32(2, 2, 2, 2)], attrs={"auto_pad": "VALID", "strides": [2, 2]},
              id="valid"),
     lambda x0, x1: F.conv2d(x0, x1, stride=2)),
    (RuleCase("Conv", [f32(1, 2, 5, 4, 6), f32(2, 1, 2, 3, 2), f32(2)],
              attrs={"group": 2, "strides": [1, 2, 2], "pads": [1, 0, 1, 0, 1, 0]}, id="3d-group"),
     lambda x0, x1, x2: F.conv3d(F.pad(x0, [1, 0, 0, 1, 1, 0]), x1, x2, stride=(1, 2, 2), groups=2)),
    (RuleCase("Conv", [f32(3, 4, 7, dims=["N", 4, 7]), f32(6, 2, 3), f32(6)], attrs={"group": 2, "strides": [2]},
              id="symbolic-batch-group"),
     lambda x0, x1, x2: F.conv1d(x0, x1, x2, stride=2, groups=2)),
    (RuleCase("Conv", [f32(2, 3, 8, 8), f32(4, 3, 3, 3)], attrs={"strides": [2, 2], "pads": [1, 1, 1, 1]},
              opset=11, id="opset11"),
     lambda x0, x1: F.conv2d(x0, x1, stride=2, padding=1)),
]

CONV_TRANSPOSE = [
    (RuleCase("ConvTranspose", [f32(2, 3, 5), f32(3, 2, 3), f32(2)], attrs={"strides": [2], "pads": [1, 1]},
              id="1d-stride"),
     lambda x0, x1, x2: F.conv_transpose1d(x0, x1, x2, stride=2, padding=1)),
    (RuleCase("ConvTranspose", [f32(1, 4, 4, 3), f32(4, 1, 3, 2)],
              attrs={"group": 2, "strides": [2, 3], "output_padding": [1, 2], "dilations": [2, 1]},
              id="2d-group-outpad"),
     lambda x0, x1: F.conv_transpose2d(x0, x1, stride=(2, 3), output_padding=(1, 2), dilation=(2, 1), groups=2)),
]

POOL = [
    (RuleCase("MaxPool", [f32(2, 3, 7, 6)], attrs={"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 1, 1]},
              id="overlap-pads"),
     lambda x0: F.max_pool2d(F.pad(x0, [0, 1, 1, 1], value=-float("inf")), (3, 2), stride=2)),
    (RuleCase("MaxPool", [f32(1, 2, 9)], attrs={"kernel_shape": [3], "strides": [2], "dilations": [2],
                                              "ceil_mode": 1}, id="1d-dilated-ceil"),
     lambda x0: F.max_pool1d(x0, 3, stride=2, dilation=2, ceil_mode=True)),
    (RuleCase("AveragePool", [f32(2, 3, 7, 6)], attrs={"kernel_shape": [3, 3], "strides": [2, 2],
                                                    "pads": [1, 1, 1, 1]}, id="exclude-pad"),
     lambda x0: F.avg_pool2d(x0, 3, stride=2, padding=1, count_include_pad=False)),
    (RuleCase("AveragePool", [f32(2, 3, 7, 6)], attrs={"kernel_shape": [3, 2], "strides": [2, 1],
                                                    "pads": [1, 1, 1, 0], "count_include_pad": 1}, id="include-pad"),
     lambda x0: F.avg_pool2d(x0, (3, 2), stride=(2, 1), padding=1, count_include_pad=True)[..., :-1]),
    (RuleCase("AveragePool", [f32(1, 2, 8)], attrs={"kernel_shape": [3], "strides": [2], "ceil_mode": 1},
              id="1d-ceil"),
     lambda x0: F.avg_pool1d(x0, 3, stride=2, ceil_mode=True)),
    (RuleCase("AveragePool", [f32(1, 2, 5, 4, 4)], attrs={"kernel_shape": [2, 2, 2], "strides": [2, 2, 2]},
              id="3d"),
     lambda x0: F.avg_pool3d(x0, 2, stride=2)),
    (RuleCase("GlobalAveragePool", [f32(2, 3, 4, 5)]), lambda x0: x0.mean(dim=(2, 3), keepdim=True)),
    (RuleCase("GlobalAveragePool", [f32(2, 3, 4, 5, dims=["N", "C", "H", "W"])], id="symbolic"),
     lambda x0: x0.mean(dim=(2, 3), keepdim=True)),
    (RuleCase("MaxPool", [f32(2, 3, 6, 6, dims=["N", "C", 6, 6])], attrs={"kernel_shape": [2, 2]}, id="symbolic-batch"),
     lambda x0: F.max_pool2d(x0, 2, stride=1)),
    (RuleCase("GlobalMaxPool", [f32(2, 3, 4, 5)]), lambda x0: x0.amax(dim=(2, 3), keepdim=True)),
    (RuleCase("GlobalMaxPool", [f32(2, 3, 4, dims=["N", "C", "L"])], id="symbolic"),
     lambda x0: x0.amax(dim=2, keepdim=True)),
]


@pytest.mark.parametrize("case,fn", CONV + CONV_TRANSPOSE + POOL, ids=[c.name for c, _ in CONV + CONV_TRANSPOSE + POOL])
def test_pool_conv_matches_torch(case, fn):
    assert_matches_torch(case, fn)


OLD_MAX_POOL = [
    (RuleCase("MaxPool", [f32(2, 3, 7, 6)], attrs={"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
              opset=opset, id=f"overlap-opset{opset}"),
     lambda x0: F.max_pool2d(x0, 3, stride=2, padding=1))
    for opset in (7, 9, 13)
] + [
    (RuleCase("MaxPool", [f32(1, 2, 9)], attrs={"kernel_shape": [3], "strides": [2], "dilations": [2], "ceil_mode": 1},
              opset=10, id="1d-dilated-ceil-opset10"),
     lambda x0: F.max_pool1d(x0, 3, stride=2, dilation=2, ceil_mode=True)),
    (RuleCase("MaxPool", [f32(1, 2, 5, 4, 6)], attrs={"kernel_shape": [2, 2, 3], "auto_pad": "SAME_UPPER"},
              opset=9, id="3d-same-upper-opset9"),
     lambda x0: F.max_pool3d(F.pad(x0, (1, 1, 0, 1, 0, 1), value=-float("inf")), (2, 2, 3), stride=1)),
]


@pytest.mark.parametrize("case,fn", OLD_MAX_POOL, ids=[c.name for c, _ in OLD_MAX_POOL])
def test_max_pool_with_overlapping_windows_below_opset16_matches_torch(case, fn):
    """Below opset 16 (no ScatterElements reduction='add') the gradient goes through per-offset masks."""
    assert_matches_torch(case, fn)


def batch_norm_eval(x0, x1, x2, x3, x4):
    """By hand: torch's batch_norm gives the running mean and var no gradient, ours does."""
    c = [1, -1] + [1] * (x0.dim() - 2)
    return (x0 - x3.view(c)) * torch.rsqrt(x4.view(c) + 1e-5) * x1.view(c) + x2.view(c)


def batch_norm_train(x0, x1, x2, x3=None, x4=None):
    return F.batch_norm(x0, None, None, x1, x2, training=True, eps=1e-5)


def layer_norm_with_statistics(x0, x1, x2):
    mean = x0.mean(dim=-1, keepdim=True)
    invstd = torch.rsqrt(x0.var(dim=-1, unbiased=False, keepdim=True) + 1e-5)
    return (x0 - mean) * invstd * x1 + x2, mean, invstd


_POS = dict(low=0.5, high=1.5)
NORM = [
    (RuleCase("BatchNormalization", [f32(2, 3, 4, 5), f32(3, **_POS), f32(3), f32(3), f32(3, **_POS)],
              id="inference"), batch_norm_eval),
    (RuleCase("BatchNormalization", [f32(4, 3, 5), f32(3, **_POS), f32(3), f32(3, const=True),
                                     f32(3, const=True, **_POS)],
              attrs={"training_mode": 1}, outputs=3, opset=15, id="training"), batch_norm_train),
    (RuleCase("LayerNormalization", [f32(2, 3, 6), f32(6), f32(6)], outputs=3, check_outputs=[0, 1, 2],
              id="statistics-outputs"), layer_norm_with_statistics),
    (RuleCase("LayerNormalization", [f32(2, 3, 6), f32(6, grad=False), f32(6, grad=False)], outputs=3,
              check_outputs=[1, 2],
              id="statistics-only"), lambda x0, x1, x2: layer_norm_with_statistics(x0, x1, x2)[1:]),
    (RuleCase("LayerNormalization", [f32(2, 3, 4), f32(3, 4), f32(3, 4)], attrs={"axis": 1}, id="axis1"),
     lambda x0, x1, x2: F.layer_norm(x0, (3, 4), x1, x2)),
    (RuleCase("InstanceNormalization", [f32(2, 3, 4, 5), f32(3, **_POS), f32(3)]),
     lambda x0, x1, x2: F.instance_norm(x0, weight=x1, bias=x2, eps=1e-5)),
    (RuleCase("InstanceNormalization", [f32(2, 3, 7), f32(3, **_POS), f32(3)], attrs={"epsilon": 1e-2}, id="1d"),
     lambda x0, x1, x2: F.instance_norm(x0, weight=x1, bias=x2, eps=1e-2)),
]


@pytest.mark.parametrize("case,fn", NORM, ids=[c.name for c, _ in NORM])
def test_normalization_matches_torch(case, fn):
    assert_matches_torch(case, fn)


def group_norm_model(shape, groups, params, opset, **attrs):
    """A one-node GroupNormalization model with its output typed by hand (onnx shape inference leaves it
    untyped, so the rule-case harness cannot build it)."""
    d = TensorProto.DOUBLE
    node = helper.make_node("GroupNormalization", ["x", "scale", "bias"], ["y"], num_groups=groups, epsilon=1e-5,
                            **attrs)
    graph = helper.make_graph([node], "gn", [helper.make_tensor_value_info("x", d, shape),
                                             helper.make_tensor_value_info("scale", d, [params]),
                                             helper.make_tensor_value_info("bias", d, [params])],
                              [helper.make_tensor_value_info("y", d, shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def test_group_normalization_gradcheck_float64():
    """GroupNormalization-21 runs in float64 in onnxruntime: the usual finite-difference check. Its default
    stash_type computes the statistics in float32, too coarse for differences, so they are asked in float64.
    (GroupNormalization-18 is deprecated: onnx's checker rejects it, so only the torch test below runs it.)"""
    from onnx_autodiff.check.gradcheck import gradcheck

    shape, groups, params = [2, 6, 2, 2], 3, 6
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal(shape), "scale": rng.uniform(0.5, 1.5, params),
             "bias": rng.standard_normal(params)}
    model = group_norm_model(shape, groups, params, 21, stash_type=TensorProto.DOUBLE)
    report = gradcheck(model, feeds, wrt=["x", "scale", "bias"], of="y")
    assert report.ok and len(report.checks) == 3, str(report)


@pytest.mark.parametrize("opset", [18, 21])
def test_group_normalization_matches_torch(opset):
    """At opset 21 scale and bias are per channel, like torch; at 18 they are per group. The gradient
    graph is ours in float64, so the match is to rounding. onnx's checker rejects the deprecated
    GroupNormalization-18, so that model is lowered unchecked."""
    shape, groups = [2, 6, 2, 2], 3
    params = 6 if opset >= 21 else groups
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape)
    scale, bias = rng.uniform(0.5, 1.5, params), rng.standard_normal(params)
    model = group_norm_model(shape, groups, params, opset)
    v = rng.standard_normal(shape)
    g = model.graph
    g.input.append(helper.make_tensor_value_info("v", TensorProto.DOUBLE, shape))
    g.node.extend([helper.make_node("Mul", ["y", "v"], ["p"]), helper.make_node("ReduceSum", ["p"], ["s"], keepdims=0),
                   helper.make_node("Gradient", ["x", "scale", "bias"], ["dx", "dscale", "dbias"], domain=TRAIN,
                                    xs=["x", "scale", "bias"], y="s")])
    g.output.extend([helper.make_tensor_value_info(n, TensorProto.DOUBLE, s)
                     for n, s in (("dx", shape), ("dscale", [params]), ("dbias", [params]))])
    model.opset_import.append(helper.make_opsetid(TRAIN, 1))
    out = _run(oa.lower(model, check=opset >= 21), {"x": x, "scale": scale, "bias": bias, "v": v})

    ts = [torch.tensor(a, requires_grad=True) for a in (x, scale, bias)]
    per_channel = [t.repeat_interleave(shape[1] // params) for t in ts[1:]]
    (F.group_norm(ts[0], groups, *per_channel, eps=1e-5) * torch.tensor(v)).sum().backward()
    for name, t in zip(("dx", "dscale", "dbias"), ts):
        np.testing.assert_allclose(out[name], t.grad.numpy(), rtol=1e-9, atol=1e-12)


def emitted_op_types(case: RuleCase) -> set[str]:
    """The op types our lowering emits for the gradient of ``case``."""
    model, feeds, wrt = rule_case_model(case)
    g = model.graph
    y = g.output[(case.check_outputs or [0])[0]].name
    g.node.append(helper.make_node("ReduceSum", [y], ["s"], name="s/sum", keepdims=0))
    names = [f"{w}_grad" for w in wrt]
    g.node.append(helper.make_node("Gradient", wrt, names, name="grad", domain=TRAIN, xs=wrt, y="s"))
    g.output.extend(helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in names)
    model.opset_import.append(helper.make_opsetid(TRAIN, 1))
    return {n.op_type for n in oa.lower(model, check=False).graph.node if "/grad/" in n.name}


@pytest.mark.parametrize("case", [c for c, _ in CONV + CONV_TRANSPOSE + POOL + NORM], ids=lambda c: c.name)
def test_emitted_ops_are_differentiable_again(case):
    """Second order: every op a rule emits has a rule of its own or is declared non-differentiable."""
    from onnx_autodiff.engine.registry import find_rule, is_non_differentiable

    ops = emitted_op_types(case)
    assert ops
    missing = sorted(op for op in ops if find_rule("", op, case.opset) is None and not is_non_differentiable("", op))
    assert not missing, f"{case.name} emits ops without a gradient rule: {missing}"


@pytest.mark.parametrize("opset", [9, 12])
def test_batch_normalization_training_by_output_count_gradcheck_float64(opset):
    """Below opset 14 training mode is spelled by asking for all five outputs. onnx shape inference
    leaves the saved statistics untyped, so the model is typed here rather than in the rule-case table."""
    from onnx_autodiff.check.gradcheck import gradcheck

    d = TensorProto.DOUBLE
    outs = ["y", "running_mean", "running_var", "saved_mean", "saved_var"]
    node = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], outs)
    graph = helper.make_graph([node], "bn", [helper.make_tensor_value_info("x", d, [4, 3, 2])] +
                              [helper.make_tensor_value_info(n, d, [3]) for n in ("scale", "bias", "mean", "var")],
                              [helper.make_tensor_value_info("y", d, [4, 3, 2])] +
                              [helper.make_tensor_value_info(n, d, [3]) for n in outs[1:]])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal([4, 3, 2]), "scale": rng.uniform(0.5, 1.5, 3), "bias": rng.standard_normal(3),
             "mean": rng.standard_normal(3), "var": rng.uniform(0.5, 1.5, 3)}
    report = gradcheck(model, feeds, wrt=["x", "scale", "bias"], of="y")
    assert report.ok and len(report.checks) == 3, str(report)
