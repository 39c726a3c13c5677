"""Recurrent ops: onnxruntime 1.31 registers LSTM and GRU for float64 but fails at run time ("does not
support double yet") and has no float64 RNN, so none runs in the float64 sweep. tests/rules/test_recurrent_torch.py
checks them in float32 against torch autograd in float64: exported nn.LSTM / nn.GRU / nn.RNN, and one-node
models (``rnn_case``) of every direction, layout and output subset against an ONNX-semantics torch reference."""
import numpy as np

from onnx_autodiff.testing import In, RuleCase

T, B, I, H = 3, 2, 3, 2  # noqa: E741 (steps, batch, input size, hidden size: the ONNX spec's letters)
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def rnn_case(op, direction="forward", layout=0, bias=True, h0=True, c0=True, outputs=None, check=None,
             lens=False, id="", dtype="float32", **attrs):
    """A one-node (float32 unless ``dtype``) LSTM / GRU / RNN case (inputs x0 X, x1 W, x2 R, x3 B, x4 lens,
    x5 h0, x6 c0)."""
    gates = GATES[op]
    dirs = 2 if direction == "bidirectional" else 1
    w = dict(low=-0.8, high=0.8, dtype=dtype)
    x = (B, T, I) if layout else (T, B, I)
    state = (B, dirs, H) if layout else (dirs, B, H)
    ins = [In(x, dtype=dtype), In((dirs, gates * H, I), **w), In((dirs, gates * H, H), **w),
           In((dirs, 2 * gates * H), **w) if bias else None,
           In(value=np.full(B, T, dtype=np.int32), dtype="int32") if lens else None,
           In(state, dtype=dtype) if h0 else None]
    if op == "LSTM":
        ins.append(In(state, dtype=dtype) if c0 else None)
    while ins and ins[-1] is None:
        ins.pop()
    n_out = outputs or (3 if op == "LSTM" else 2)
    return RuleCase(op, ins, attrs=dict(hidden_size=H, direction=direction, layout=layout or None, **attrs),
                    outputs=n_out, check_outputs=check or list(range(n_out)), opset=14 if layout else 17,
                    id=id or direction)


# float64 one-node cases: onnxruntime fails them at run time, so gradcheck's runtime="auto" runs them
# through onnx's reference evaluator
_F64 = dict(dtype="float64")
CASES = [
    rnn_case("LSTM", **_F64), rnn_case("LSTM", "reverse", **_F64), rnn_case("LSTM", "bidirectional", **_F64),
    rnn_case("LSTM", bias=False, h0=False, c0=False, id="no-bias-no-state", **_F64),
    rnn_case("LSTM", check=[2], id="yc-only", **_F64),
    rnn_case("LSTM", layout=1, id="layout1", **_F64),
    rnn_case("GRU", linear_before_reset=1, **_F64),
    rnn_case("GRU", "bidirectional", linear_before_reset=1, **_F64),
    rnn_case("GRU", id="lbr0", **_F64),
    rnn_case("GRU", "reverse", h0=False, check=[1], id="yh-only", **_F64),
    rnn_case("RNN", **_F64), rnn_case("RNN", "reverse", **_F64),
    # (no Relu/Sigmoid activations: onnx.reference's RNN raises "Unknown activation function 'Relu'")
    rnn_case("RNN", bias=False, h0=False, check=[1], id="no-bias-yh-only", **_F64),
]
