"""LSTM, GRU and RNN gradients against torch autograd in float64.

onnxruntime 1.31 runs none of the three in float64 (LSTM and GRU load but fail at run time), so the
float64 finite-difference sweep cannot hold them. Here the lowered gradient runs in float32 onnxruntime
and is compared with torch autograd in float64 on the same inputs, to 1e-4 of the gradient's scale:
- models exported from nn.LSTM / nn.GRU / nn.RNN (torch.onnx.export, dynamo=False, opset 17), gradients
  w.r.t. the input, the initial states and every weight (mapped back to torch's parameter layout);
- one-node models for what the exporter never emits (reverse, layout=1, GRU linear_before_reset=0,
  absent bias or states, single outputs) against a direct torch transcription of the ONNX equations.
"""
from __future__ import annotations

import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import onnx_autodiff as oa
from onnx_autodiff.conformance.cases.recurrent import GATES, T, rnn_case
from onnx_autodiff.errors import OnnxAutodiffError
from tests.rules.test_conv_torch import assert_matches_torch, lowered_gradients

RTOL = 1e-4
TRAIN = "ai.onnx.preview.training"


# ---- a torch transcription of the ONNX equations (float64 reference) ------------------------------
def onnx_reference(op, direction="forward", layout=0, linear_before_reset=0, activation="tanh", check=None):
    """fn(x0, x1, x2, x3=None, x5=None, x6=None) -> the ONNX op's outputs (those in ``check``)."""

    def fn(x0, x1, x2, x3=None, x5=None, x6=None):
        x = x0.transpose(0, 1) if layout else x0
        h0 = x5.transpose(0, 1) if (layout and x5 is not None) else x5
        c0 = x6.transpose(0, 1) if (layout and x6 is not None) else x6
        steps, batch = x.shape[0], x.shape[1]
        dirs = ["forward", "reverse"] if direction == "bidirectional" else [direction]
        hidden = x2.shape[-1]
        ys, hs, cs = [], [], []
        for d, name in enumerate(dirs):
            w, r = x1[d], x2[d]
            gh = GATES[op] * hidden
            wb, rb = (x3[d, :gh], x3[d, gh:]) if x3 is not None else (torch.zeros(gh, dtype=x.dtype),) * 2
            h = h0[d] if h0 is not None else torch.zeros(batch, hidden, dtype=x.dtype)
            c = c0[d] if c0 is not None else torch.zeros(batch, hidden, dtype=x.dtype)
            out = [None] * steps
            for t in (range(steps) if name == "forward" else range(steps - 1, -1, -1)):
                xw = x[t] @ w.T + wb
                if op == "LSTM":
                    i, o, f, cc = (xw + h @ r.T + rb).chunk(4, -1)
                    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(cc)
                    h = torch.sigmoid(o) * torch.tanh(c)
                elif op == "GRU":
                    xz, xr, xh = xw.chunk(3, -1)
                    rz, rr, rh = r.chunk(3, 0)
                    bz, br, bh = rb.chunk(3, -1)
                    z = torch.sigmoid(xz + h @ rz.T + bz)
                    rg = torch.sigmoid(xr + h @ rr.T + br)
                    if linear_before_reset:
                        ht = torch.tanh(xh + rg * (h @ rh.T + bh))
                    else:
                        ht = torch.tanh(xh + (rg * h) @ rh.T + bh)
                    h = (1 - z) * ht + z * h
                else:
                    a = xw + h @ r.T + rb
                    h = {"tanh": torch.tanh, "relu": torch.relu, "sigmoid": torch.sigmoid}[activation](a)
                out[t] = h
            ys.append(torch.stack(out))
            hs.append(h)
            cs.append(c)
        y, yh, yc = torch.stack(ys, 1), torch.stack(hs), torch.stack(cs)
        if layout:
            y, yh, yc = y.permute(2, 0, 1, 3), yh.transpose(0, 1), yc.transpose(0, 1)
        outs = (y, yh, yc) if op == "LSTM" else (y, yh)
        return tuple(outs[k] for k in check)

    return fn


def case_and_reference(op, direction="forward", layout=0, activation="tanh", **kw):
    attrs = {}
    if op == "GRU":
        attrs["linear_before_reset"] = kw.pop("linear_before_reset", 0)
    if op == "RNN" and activation != "tanh":
        attrs["activations"] = [activation.capitalize()] * (2 if direction == "bidirectional" else 1)
    case = rnn_case(op, direction, layout, **kw, **attrs)
    ref = onnx_reference(op, direction, layout, attrs.get("linear_before_reset", 0), activation,
                         case.check_outputs)
    return case, ref


ONE_NODE = [
    dict(op="LSTM"), dict(op="LSTM", direction="reverse"), dict(op="LSTM", direction="bidirectional"),
    dict(op="LSTM", bias=False, h0=False, c0=False, id="no-bias-no-state"),
    dict(op="LSTM", check=[0], id="y-only"), dict(op="LSTM", check=[2], id="yc-only"),
    dict(op="LSTM", outputs=1, lens=True, id="one-output-full-lens"),
    dict(op="LSTM", direction="bidirectional", check=[1, 2], id="states-only"),
    dict(op="GRU", linear_before_reset=1), dict(op="GRU", direction="reverse", linear_before_reset=1),
    dict(op="GRU", direction="bidirectional", linear_before_reset=1),
    dict(op="GRU", id="lbr0"), dict(op="GRU", direction="bidirectional", bias=False, id="lbr0-no-bias"),
    dict(op="GRU", direction="reverse", h0=False, check=[1], id="yh-only"),
    dict(op="GRU", outputs=1, id="one-output"),
    dict(op="RNN"), dict(op="RNN", direction="reverse"),
    dict(op="RNN", direction="bidirectional", activation="relu", id="bidirectional-relu"),
    dict(op="RNN", activation="sigmoid", id="sigmoid"),
    dict(op="RNN", bias=False, h0=False, check=[1], id="no-bias-yh-only"),
]
ONE_NODE_CASES = [case_and_reference(**dict(kw)) for kw in ONE_NODE]


@pytest.mark.parametrize("case,ref", ONE_NODE_CASES, ids=[c.name for c, _ in ONE_NODE_CASES])
def test_one_node_matches_onnx_reference(case, ref):
    assert_matches_torch(case, ref)


def test_reference_is_onnxruntime_forward():
    """The torch transcription is the ONNX op: it reproduces onnxruntime's forward outputs."""
    from onnx_autodiff.testing import rule_case_model

    for case, ref in ONE_NODE_CASES:
        model, feeds, _ = rule_case_model(case)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        got = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)
        want = ref(**{k: torch.tensor(v.astype(np.float64)) for k, v in feeds.items()})
        for k, w in zip(case.check_outputs, want):
            np.testing.assert_allclose(got[k], w.numpy(), rtol=1e-5, atol=1e-5, err_msg=case.name)


@pytest.mark.parametrize("kw,match", [
    (dict(clip=1.0), "clip"),
    (dict(activations=["Tanh", "Tanh", "Tanh"]), "default activations"),
])
def test_unsupported_options_say_why(kw, match):
    case = rnn_case("LSTM", **kw)
    with pytest.raises(OnnxAutodiffError, match=match):
        lowered_gradients(case)


def test_ragged_sequence_lens_says_why():
    case = rnn_case("GRU", lens=True, linear_before_reset=1)
    case.inputs[4].value = np.array([T, T - 1], dtype=np.int32)
    with pytest.raises(OnnxAutodiffError, match="sequence_lens"):
        lowered_gradients(case)


# ---- exported nn modules ---------------------------------------------------------------------------
_TORCH_ORDER = {"LSTM": [0, 3, 1, 2], "GRU": [1, 0, 2], "RNN": [0]}  # ONNX gate k is torch gate order[k]


def _to_onnx_layout(op, t):
    """A torch weight or bias (gates stacked on dim 0, torch order) in ONNX gate order."""
    return torch.cat([t.chunk(GATES[op])[k] for k in _TORCH_ORDER[op]])


def onnx_weights(op, module, layer):
    """{'W'|'R'|'B': tensor} the exporter builds for one layer, as functions of the torch parameters."""
    sfx = [f"_l{layer}"] + ([f"_l{layer}_reverse"] if module.bidirectional else [])
    p = dict(module.named_parameters())
    return {
        "W": torch.stack([_to_onnx_layout(op, p[f"weight_ih{s}"]) for s in sfx]),
        "R": torch.stack([_to_onnx_layout(op, p[f"weight_hh{s}"]) for s in sfx]),
        "B": torch.stack([torch.cat([_to_onnx_layout(op, p[f"bias_ih{s}"]), _to_onnx_layout(op, p[f"bias_hh{s}"])])
                          for s in sfx]),
    }


MODULES = [
    ("LSTM", dict(num_layers=1, bidirectional=False, batch_first=False), "lstm"),
    ("LSTM", dict(num_layers=2, bidirectional=True, batch_first=True), "lstm-2layer-bidir-batch-first"),
    ("GRU", dict(num_layers=2, bidirectional=True, batch_first=False), "gru-2layer-bidir"),
    ("GRU", dict(num_layers=2, bidirectional=True, batch_first=True), "gru-2layer-bidir-batch-first"),
    ("RNN", dict(num_layers=1, nonlinearity="tanh", bidirectional=True), "rnn-tanh-bidir"),
    ("RNN", dict(num_layers=2, nonlinearity="relu", batch_first=True), "rnn-relu-2layer-batch-first"),
]


@pytest.mark.parametrize("op,kw,name", MODULES, ids=[m[2] for m in MODULES])
def test_exported_module_matches_torch(op, kw, name):
    """Gradients w.r.t. the input, the initial states and every W / R / B the exporter writes."""
    torch.manual_seed(0)
    steps, batch, features, hidden = 4, 3, 5, 4
    module = getattr(torch.nn, op)(features, hidden, **kw).float()
    layers, dirs = module.num_layers, 2 if module.bidirectional else 1
    x = torch.randn((batch, steps, features) if module.batch_first else (steps, batch, features))
    states = [torch.randn(layers * dirs, batch, hidden) for _ in range(2 if op == "LSTM" else 1)]
    names = ["x", "h0", "c0"][:1 + len(states)]
    outs = ["y", "hn", "cn"][:1 + len(states)]
    args = (x, tuple(states)) if op == "LSTM" else (x, states[0])
    f = io.BytesIO()
    torch.onnx.export(module, args, f, dynamo=False, opset_version=17, input_names=names, output_names=outs)
    model = onnx.load_from_string(f.getvalue())
    rec = [n for n in model.graph.node if n.op_type == op]
    assert len(rec) == layers

    # the exporter's W / R / B initializers, checked against our mapping of the torch parameters
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    weights = {}
    for layer, node in enumerate(rec):
        for key, name_ in zip("WRB", node.input[1:4]):
            want = onnx_weights(op, module, layer)[key].detach().numpy()
            np.testing.assert_array_equal(inits[name_], want)
            weights[name_] = (layer, key)

    # s = sum_k <out_k, v_k>; Gradient of s w.r.t. inputs and weights; lowered, run in float32
    rng = np.random.default_rng(1)
    with torch.no_grad():
        ys = module(*args)
    ys = (ys[0], *ys[1]) if op == "LSTM" else ys
    vs = [rng.standard_normal(tuple(y.shape)).astype(np.float32) for y in ys]
    g = model.graph
    terms = []
    for k, (o, v) in enumerate(zip(outs, vs)):
        g.input.append(helper.make_tensor_value_info(f"v{k}", TensorProto.FLOAT, list(v.shape)))
        g.node.extend([helper.make_node("Mul", [o, f"v{k}"], [f"s/p{k}"]),
                       helper.make_node("ReduceSum", [f"s/p{k}"], [f"s/t{k}"], keepdims=0)])
        terms.append(f"s/t{k}")
    g.node.append(helper.make_node("Sum", terms, ["s"]))
    wrt = names + list(weights)
    grads = [f"d/{w}" for w in wrt]
    g.node.append(helper.make_node("Gradient", wrt, grads, domain=TRAIN, xs=wrt, y="s"))
    feeds = {"x": x.numpy(), **{n: s.numpy() for n, s in zip(names[1:], states)},
             **{f"v{k}": v for k, v in enumerate(vs)}}
    shapes = {**{k: v.shape for k, v in feeds.items()}, **{k: v.shape for k, v in inits.items()}}
    g.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, list(shapes[w])) for w, n in zip(wrt, grads))
    model.opset_import.append(helper.make_opsetid(TRAIN, 1))
    lowered = oa.lower(model)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    got = dict(zip(grads, ort.InferenceSession(lowered.SerializeToString(), so,
                                               providers=["CPUExecutionProvider"]).run(grads, feeds)))

    # torch autograd in float64 on the same values
    m64 = module.double()
    x64 = x.double().requires_grad_()
    s64 = [s.double().requires_grad_() for s in states]
    y64 = m64(x64, tuple(s64)) if op == "LSTM" else m64(x64, s64[0])
    y64 = (y64[0], *y64[1]) if op == "LSTM" else y64
    sum((y * torch.tensor(v, dtype=torch.float64)).sum() for y, v in zip(y64, vs)).backward()
    want = {"x": x64.grad, **{n: s.grad for n, s in zip(names[1:], s64)}}
    for name_, (layer, key) in weights.items():
        sfx = [f"_l{layer}"] + ([f"_l{layer}_reverse"] if module.bidirectional else [])
        p = dict(m64.named_parameters())
        grad = {"W": lambda s, p=p: _to_onnx_layout(op, p[f"weight_ih{s}"].grad),
                "R": lambda s, p=p: _to_onnx_layout(op, p[f"weight_hh{s}"].grad),
                "B": lambda s, p=p: torch.cat([_to_onnx_layout(op, p[f"bias_ih{s}"].grad),
                                               _to_onnx_layout(op, p[f"bias_hh{s}"].grad)])}[key]
        want[name_] = torch.stack([grad(s) for s in sfx])
    for w in wrt:
        ref = want[w].numpy()
        scale = np.abs(ref).max()
        assert scale > 0, w
        err = np.abs(got[f"d/{w}"].astype(np.float64) - ref).max() / scale
        assert err <= RTOL, f"{name}: gradient of {w} off by {err:.2e} (relative to max |grad|)"
