"""Recurrent ops: onnxruntime 1.31 registers LSTM and GRU for float64 but fails at run time ("does not
support double yet") and has no float64 RNN, so none runs in the float64 sweep. tests/test_recurrent_torch.py
checks them in float32 against torch autograd in float64: exported nn.LSTM / nn.GRU / nn.RNN, and one-node
models (``rnn_case``) of every direction, layout and output subset against an ONNX-semantics torch reference."""
import numpy as np

from onnx_autodiff.testing import In, RuleCase

T, B, I, H = 3, 2, 3, 2
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def rnn_case(op, direction="forward", layout=0, bias=True, h0=True, c0=True, outputs=None, check=None,
             lens=False, id="", **attrs):
    """A one-node float32 LSTM / GRU / RNN case (inputs x0 X, x1 W, x2 R, x3 B, x4 lens, x5 h0, x6 c0)."""
    gates = GATES[op]
    dirs = 2 if direction == "bidirectional" else 1
    w = dict(low=-0.8, high=0.8, dtype="float32")
    x = (B, T, I) if layout else (T, B, I)
    state = (B, dirs, H) if layout else (dirs, B, H)
    ins = [In(x, dtype="float32"), In((dirs, gates * H, I), **w), In((dirs, gates * H, H), **w),
           In((dirs, 2 * gates * H), **w) if bias else None,
           In(value=np.full(B, T, dtype=np.int32), dtype="int32") if lens else None,
           In(state, dtype="float32") if h0 else None]
    if op == "LSTM":
        ins.append(In(state, dtype="float32") if c0 else None)
    while ins and ins[-1] is None:
        ins.pop()
    n_out = outputs or (3 if op == "LSTM" else 2)
    return RuleCase(op, ins, attrs=dict(hidden_size=H, direction=direction, layout=layout or None, **attrs),
                    outputs=n_out, check_outputs=check or list(range(n_out)), opset=14 if layout else 17,
                    id=id or direction)


_WHY = ("onnxruntime 1.31 runs no {} in float64; tests/test_recurrent_torch.py holds it against torch autograd "
        "in float64 (exported nn modules and one-node cases of every direction, layout and output subset)")
NOT_CASED = {op: _WHY.format(op) for op in GATES}
