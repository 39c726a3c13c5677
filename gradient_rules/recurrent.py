"""Recurrent layers: LSTM, GRU, RNN, in every direction and both layouts.

The backward is the unrolled recurrence over a static sequence length: per direction, the forward
step is recomputed from standard ops (the hidden states come from the forward ``Y`` when that output
exists, LSTM's cell states are recomputed), then the reverse sweep carries dH (and dC) from the last
step to the first. Input and weight gradients are one MatMul each over the stacked per-step
pre-activation gradients. Options beyond what PyTorch exports (clip, peepholes, input_forget,
non-default activations, ragged sequence_lens) raise a clear error. Inside ``hvp`` a forward LSTM whose ``Y`` exists
gets the backward of ``lstm_backward`` (its recomputation batched over time, shared with the forward's tangent).

The tangent needs the whole recurrence too: the JVP rule recomputes the steps from standard ops (the same
step as the backward's) and pushes the input tangents through them (``g.push``), so the tangent model
holds the unrolled forward once more besides the node itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnx_autodiff.rule_api import GradBuilder, GradientRuleError, Grads, NodeView, gradient_rule, jvp_rule

_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
_DEFAULT_ACTIVATIONS = {"LSTM": ["sigmoid", "tanh", "tanh"], "GRU": ["sigmoid", "tanh"], "RNN": ["tanh"]}
_RNN_ACTIVATIONS = ("tanh", "relu", "sigmoid")


def _check_options(g, node, steps):
    """Raise on the options this rule does not differentiate; returns the RNN activation name."""
    op = node.op_type
    if node.attr("clip") is not None:
        raise GradientRuleError(f"the {op} gradient does not handle 'clip' (its gradient is zero "
                                "where the pre-activation is clipped); remove the attribute")
    if op == "LSTM" and int(node.attr("input_forget", 0)):
        raise GradientRuleError("the LSTM gradient does not handle input_forget=1")
    if op == "LSTM" and node.input(7) is not None:
        raise GradientRuleError("the LSTM gradient does not handle peephole weights (input P)")
    if node.attr("activation_alpha") is not None or node.attr("activation_beta") is not None:
        raise GradientRuleError(f"the {op} gradient does not handle activation_alpha/activation_beta")
    acts = [a.lower() for a in (node.attr("activations") or [])]
    dirs = 2 if node.attr("direction", "forward") == "bidirectional" else 1
    default = _DEFAULT_ACTIVATIONS[op]
    per_dir = [acts[k * len(default):(k + 1) * len(default)] for k in range(dirs)] if acts else [default] * dirs
    if op == "RNN":
        if any(len(a) != 1 or a[0] != per_dir[0][0] or a[0] not in _RNN_ACTIVATIONS for a in per_dir):
            raise GradientRuleError(f"the RNN gradient handles one of {_RNN_ACTIVATIONS} as activation "
                                    f"(the same in both directions), got {acts}")
        activation = per_dir[0][0]
    else:
        if any(a != default for a in per_dir):
            raise GradientRuleError(f"the {op} gradient handles only the default activations "
                                    f"{default}, got {acts}")
        activation = None
    lens = node.input(4)
    if lens is not None:
        value = g.value(lens)
        if value is None or np.any(np.asarray(value) != steps):
            raise GradientRuleError(
                f"the {op} gradient handles sequence_lens only as a constant equal to the sequence "
                f"length ({steps}) for every batch entry; {lens!r} is "
                + ("not a constant" if value is None else f"{np.asarray(value).tolist()}")
                + ": drop the input or make it a full-length constant")
    return activation


class _Cell:
    """Per-step forward recomputation and backward of one direction of one recurrent op."""

    def __init__(self, g, op, hidden, w, r, wb, rb, activation, linear_before_reset):
        self.g, self.op, self.hidden = g, op, hidden
        self.w, self.r, self.wb, self.rb = w, r, wb, rb  # w: [G*H, I], r: [G*H, H], biases: [G*H] or None
        self.r_t = g.Transpose(r, perm=[1, 0])
        self.activation = activation
        self.lbr = linear_before_reset

    def _split(self, x, parts, axis=-1):
        return [x] if parts == 1 else self.g.split(x, axis, [self.hidden] * parts)

    def _act(self, x):
        return {"tanh": self.g.Tanh, "relu": self.g.Relu, "sigmoid": self.g.Sigmoid}[self.activation](x)

    def step(self, xw, h, c):
        """Forward step from ``xw`` = X_t W^T + Wb: (saved values for the backward, h_t, c_t)."""
        g = self.g
        hr = g.MatMul(h, self.r_t)
        if self.rb is not None:
            hr = g.Add(hr, self.rb)
        if self.op == "RNN":
            h_new = self._act(g.Add(xw, hr))
            return {"h": h, "h_new": h_new}, h_new, None
        if self.op == "LSTM":
            i, o, f, cc = self._split(g.Add(xw, hr), 4)
            i, o, f, cc = g.Sigmoid(i), g.Sigmoid(o), g.Sigmoid(f), g.Tanh(cc)
            c_new = g.Add(g.Mul(f, c), g.Mul(i, cc))
            tc = g.Tanh(c_new)
            return {"h": h, "c": c, "i": i, "o": o, "f": f, "cc": cc, "tc": tc}, g.Mul(o, tc), c_new
        xz, xr, xh = self._split(xw, 3)
        hz, hr_, hh = self._split(hr, 3)
        z, rg = g.Sigmoid(g.Add(xz, hz)), g.Sigmoid(g.Add(xr, hr_))
        if self.lbr:
            rh = None
            ht = g.Tanh(g.Add(xh, g.Mul(rg, hh)))
        else:
            rh = g.Mul(rg, h)
            rec = g.MatMul(rh, self._rh_t())
            if self.rb is not None:
                rec = g.Add(rec, self._split(self.rb, 3)[2])
            ht = g.Tanh(g.Add(xh, rec))
        one = g.const(1.0, like=h)
        h_new = g.Add(g.Mul(g.Sub(one, z), ht), g.Mul(z, h))
        return {"h": h, "z": z, "r": rg, "ht": ht, "hh": hh, "rh": rh}, h_new, None

    def _rh_t(self):
        """Rh^T, the candidate gate's recurrent weight transposed (GRU with linear_before_reset=0)."""
        if not hasattr(self, "_rh_t_cache"):
            g = self.g
            rh = g.slice(self.r, [2 * self.hidden], [3 * self.hidden], [0])
            self._rh = rh
            self._rh_t_cache = g.Transpose(rh, perm=[1, 0])
        return self._rh_t_cache

    def back(self, s, dh, dc):
        """One reverse step: (dA_x, dA_rec, dh_prev, dc_prev), dA_* the gradients of X_t W^T + Wb and
        of h R^T + Rb (the same tensor except in GRU's candidate gate)."""
        g = self.g
        one = g.const(1.0, like=dh)

        def dsig(y):
            return g.Mul(y, g.Sub(one, y))

        def dtanh(y):
            return g.Sub(one, g.Mul(y, y))

        if self.op == "RNN":
            y = s["h_new"]
            d = {"tanh": lambda: dtanh(y), "sigmoid": lambda: dsig(y),
                 "relu": lambda: g.Cast(g.Greater(y, g.const(0.0, like=y)), to=g.dtype(y))}[self.activation]()
            da = g.Mul(dh, d)
            return da, da, g.MatMul(da, self.r), None
        if self.op == "LSTM":
            do = g.Mul(dh, s["tc"])
            dct = g.Mul(g.Mul(dh, s["o"]), dtanh(s["tc"]))
            dct = dct if dc is None else g.Add(dc, dct)
            di, dcc, df = g.Mul(dct, s["cc"]), g.Mul(dct, s["i"]), g.Mul(dct, s["c"])
            da = g.Concat(g.Mul(di, dsig(s["i"])), g.Mul(do, dsig(s["o"])), g.Mul(df, dsig(s["f"])),
                          g.Mul(dcc, dtanh(s["cc"])), axis=-1)
            return da, da, g.MatMul(da, self.r), g.Mul(dct, s["f"])
        z, rg, ht, h = s["z"], s["r"], s["ht"], s["h"]
        dz = g.Mul(dh, g.Sub(h, ht))
        dah = g.Mul(g.Mul(dh, g.Sub(one, z)), dtanh(ht))
        daz = g.Mul(dz, dsig(z))
        if self.lbr:
            dr = g.Mul(dah, s["hh"])
            dar = g.Mul(dr, dsig(rg))
            da_x = g.Concat(daz, dar, dah, axis=-1)
            da_rec = g.Concat(daz, dar, g.Mul(dah, rg), axis=-1)
            dh_prev = g.Add(g.Mul(dh, z), g.MatMul(da_rec, self.r))
            return da_x, da_rec, dh_prev, None
        self._rh_t()
        drh = g.MatMul(dah, self._rh)
        dar = g.Mul(g.Mul(drh, h), dsig(rg))
        da = g.Concat(daz, dar, dah, axis=-1)
        zr = self._split(self.r, 3, axis=0)
        r_zr = g.Concat(zr[0], zr[1], axis=0)
        dh_prev = g.Add(g.Add(g.Mul(dh, z), g.Mul(drh, rg)), g.MatMul(g.Concat(daz, dar, axis=-1), r_zr))
        return da, da, dh_prev, None


def _take(g, x, index, axis):
    """x[index] along ``axis`` (the axis removed)."""
    return g.Gather(x, g.const(np.int64(index)), axis=axis)


def _stack(g, xs, axis=0):
    return g.Concat(*[g.unsqueeze(x, [axis]) for x in xs], axis=axis)


def _zeros_state(g, x, hidden):
    """Zeros of shape [batch, hidden], the batch read from X ([T, B, I]) at run time."""
    xs = g.shape(x)
    if xs is not None and isinstance(xs[1], int):
        return g.const(np.zeros((xs[1], hidden)), like=x)
    g.require(9, "a zero state for a batch size known only at run time")
    batch = g.Gather(g.Shape(x), g.ints([1]), axis=0)
    shape = g.Concat(batch, g.ints([hidden]), axis=0)
    return g.full(shape, 0.0, x)


@dataclass
class _Sequence:
    """One recurrent node in layout 0: X [T, B, I], Y [T, dirs, B, H], states [dirs, B, H]."""

    g: GradBuilder
    node: NodeView
    steps: int
    hidden: int
    activation: str
    x: str
    x_steps: list
    x_flat: str  # X as [T*B, I]
    h0: str | None
    c0: str | None
    y: str | None
    dy: str | None
    dyh: str | None
    dyc: str | None

    @property
    def gh(self) -> int:
        return _GATES[self.node.op_type] * self.hidden


def _sequence(g, node, dy) -> _Sequence:
    """The node's tensors moved to layout 0, its static sequence length and input size checked."""
    op = node.op_type
    layout = int(node.attr("layout", 0))
    x, w = node.inputs[:2]
    xs = g.shape(x)
    if xs is None or not isinstance(xs[1 if layout else 0], int):
        raise GradientRuleError(f"the {op} gradient unrolls the recurrence and needs a static sequence "
                                f"length; the shape of {x!r} is {xs}")
    steps = xs[1 if layout else 0]
    inputs = (g.shape(w) or (None,) * 3)[2]
    inputs = inputs if isinstance(inputs, int) else xs[2]
    if not isinstance(inputs, int):
        raise GradientRuleError(f"the {op} gradient needs the input size (the last dim of {w!r} or {x!r})")
    h0, c0 = node.input(5), node.input(6) if op == "LSTM" else None
    y, (dY, dYh), dYc = node.output(0), dy[:2], dy[2] if op == "LSTM" else None
    if layout:
        states = [g.Transpose(t, perm=[1, 0, 2]) if t else None for t in (x, h0, c0, dYh, dYc)]
        x, h0, c0, dYh, dYc = states
        y, dY = (g.Transpose(t, perm=[1, 2, 0, 3]) if t else None for t in (y, dY))
    return _Sequence(g, node, steps, int(node.attr("hidden_size")), _check_options(g, node, steps), x,
                     [_take(g, x, t, 0) for t in range(steps)], g.Reshape(x, g.ints([-1, inputs])), h0, c0, y,
                     dY, dYh, dYc)


def _cell(seq: _Sequence, d: int) -> _Cell:
    g, node = seq.g, seq.node
    op = node.op_type
    w, r = node.inputs[1:3]
    b = node.input(3)
    wb = rb = None
    if b is not None:
        wb, rb = g.split(_take(g, b, d, 0), 0, [seq.gh, seq.gh])
        if op != "GRU":  # the two biases only ever appear summed
            wb, rb = g.Add(wb, rb), None
    return _Cell(g, op, seq.hidden, _take(g, w, d, 0), _take(g, r, d, 0), wb, rb, seq.activation,
                 int(node.attr("linear_before_reset", 0)))


def _unroll(seq: _Sequence, cell: _Cell, d: int, order: list[int]):
    """The steps of one direction recomputed: (saved values per step, the hidden state entering each step, the
    hidden state after each step, the last hidden and cell states). With ``seq.y`` set, each step starts from
    the node's own Y (the gradient's form); without, from the step before (standard ops only: the JVP's form)."""
    g = seq.g
    w_t = g.Transpose(cell.w, perm=[1, 0])
    h = _take(g, seq.h0, d, 0) if seq.h0 else _zeros_state(g, seq.x, seq.hidden)
    c = None
    if seq.node.op_type == "LSTM":
        c = _take(g, seq.c0, d, 0) if seq.c0 else _zeros_state(g, seq.x, seq.hidden)
    saved, h_prev, h_after = {}, {}, {}
    for t in order:
        xw = g.MatMul(seq.x_steps[t], w_t)
        if cell.wb is not None:
            xw = g.Add(xw, cell.wb)
        h_prev[t] = h
        saved[t], h, c = cell.step(xw, h, c)
        h_after[t] = h
        if seq.y is not None:
            h = _take(g, _take(g, seq.y, t, 0), d, 0)
    return saved, h_prev, h_after, h, c


def _backward(seq: _Sequence, cell: _Cell, d: int, order: list[int], saved: dict, h_prev: dict):
    """The reverse sweep: (dA_x and dA_rec per step, dh0, dc0)."""
    g = seq.g
    dh = _take(g, seq.dyh, d, 0) if seq.dyh else None
    dc = _take(g, seq.dyc, d, 0) if seq.dyc else None
    da_x, da_rec = {}, {}
    for t in reversed(order):
        if seq.dy is not None:
            dyt = _take(g, _take(g, seq.dy, t, 0), d, 0)
            dh = dyt if dh is None else g.Add(dh, dyt)
        if dh is None:
            dh = g.zeros_like(h_prev[t])
        da_x[t], da_rec[t], dh, dc = cell.back(saved[t], dh, dc)
    return da_x, da_rec, dh, dc


def _direction(seq: _Sequence, d: int, name: str) -> dict[str, str]:
    """dx, dw, dr, db, dh0 and dc0 of one direction."""
    g, steps, hidden, gh = seq.g, seq.steps, seq.hidden, seq.gh
    cell = _cell(seq, d)
    order = list(range(steps)) if name == "forward" else list(range(steps - 1, -1, -1))
    # the batched form where hvp shares what it recomputes with a forward LSTM's closed-form tangent (lstm_backward.py,
    # lstm_tangent.py); elsewhere it measured no faster
    shares = (g.option("lstm_preactivations", None) is not None and seq.node.attr("direction", "forward") == "forward"
              and not int(seq.node.attr("layout", 0)))
    batched = g.option("lstm_batched_backward", shares)
    if seq.node.op_type == "LSTM" and seq.y is not None and batched:
        from .lstm_backward import lstm_direction

        return lstm_direction(seq, cell, d, order, _zeros_state)
    saved, h_prev, _, _, _ = _unroll(seq, cell, d, order)
    da_x, da_rec, dh0, dc0 = _backward(seq, cell, d, order, saved, h_prev)
    dax = _stack(g, [da_x[t] for t in range(steps)])  # [T, B, G*H]
    dax_flat = g.Reshape(dax, g.ints([-1, gh]))
    same = all(da_x[t] == da_rec[t] for t in range(steps))
    darec_flat = dax_flat if same else g.Reshape(_stack(g, [da_rec[t] for t in range(steps)]), g.ints([-1, gh]))
    hprev_flat = g.Reshape(_stack(g, [h_prev[t] for t in range(steps)]), g.ints([-1, hidden]))
    if seq.node.op_type == "GRU" and not cell.lbr:  # the candidate's recurrent weight multiplies r * h, not h
        zr, cand = g.split(darec_flat, 1, [2 * hidden, hidden])
        rh_flat = g.Reshape(_stack(g, [saved[t]["rh"] for t in range(steps)]), g.ints([-1, hidden]))
        dr = g.Concat(g.MatMul(g.Transpose(zr, perm=[1, 0]), hprev_flat),
                      g.MatMul(g.Transpose(cand, perm=[1, 0]), rh_flat), axis=0)
    else:
        dr = g.MatMul(g.Transpose(darec_flat, perm=[1, 0]), hprev_flat)
    return {"dx": g.MatMul(dax, cell.w), "dw": g.MatMul(g.Transpose(dax_flat, perm=[1, 0]), seq.x_flat), "dr": dr,
            "db": g.Concat(g.reduce_sum(dax_flat, [0], keepdims=False),
                           g.reduce_sum(darec_flat, [0], keepdims=False), axis=0),
            "dh0": dh0, "dc0": dc0}


@gradient_rule("RNN", "GRU", "LSTM", since=7)
def recurrent_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Unrolled backward of LSTM / GRU / RNN over a static sequence length, one direction at a time."""
    seq = _sequence(g, node, dy)
    direction = node.attr("direction", "forward")
    dirs = ["forward", "reverse"] if direction == "bidirectional" else [direction]
    out = [_direction(seq, d, name) for d, name in enumerate(dirs)]

    def per_dir(key):
        parts = [o[key] for o in out]
        return _stack(g, parts) if len(parts) > 1 else g.unsqueeze(parts[0], [0])

    dx = out[0]["dx"] if len(dirs) == 1 else g.Add(*[o["dx"] for o in out])
    dh0 = per_dir("dh0") if node.needs_grad(5) else None
    dc0 = per_dir("dc0") if node.op_type == "LSTM" and node.needs_grad(6) else None
    if int(node.attr("layout", 0)):
        dx, dh0, dc0 = (g.Transpose(t, perm=[1, 0, 2]) if t else None for t in (dx, dh0, dc0))
    return [dx if node.needs_grad(0) else None,
            per_dir("dw") if node.needs_grad(1) else None,
            per_dir("dr") if node.needs_grad(2) else None,
            per_dir("db") if node.needs_grad(3) else None,
            None, dh0, dc0]


@jvp_rule("RNN", "GRU", "LSTM", since=7)
def recurrent_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """The recurrence unrolled in standard ops (Y, Y_h, Y_c in the node's layout), the tangents of X, W, R,
    B, initial_h and initial_c pushed through it; a forward LSTM's tangent in closed form (``lstm_tangent``)."""
    from .lstm_tangent import lstm_jvp

    fast = lstm_jvp(g, node, dx, _check_options)
    if fast is not NotImplemented:
        return fast
    start = g.mark()
    seq = _sequence(g, node, [None, None, None])
    seq.y = None
    direction = node.attr("direction", "forward")
    dirs = ["forward", "reverse"] if direction == "bidirectional" else [direction]
    ys, hs, cs = [], [], []
    for d, name in enumerate(dirs):
        order = list(range(seq.steps)) if name == "forward" else list(range(seq.steps - 1, -1, -1))
        _, _, per_step, h, c = _unroll(seq, _cell(seq, d), d, order)
        ys.append(_stack(g, [per_step[t] for t in range(seq.steps)]))  # [T, B, H]
        hs.append(h)
        cs.append(c)
    y = _stack(g, ys, axis=1)  # [T, dirs, B, H]
    yh = _stack(g, hs)
    yc = _stack(g, cs) if node.op_type == "LSTM" else None
    if int(node.attr("layout", 0)):
        y = g.Transpose(y, perm=[2, 0, 1, 3])
        yh, yc = (g.Transpose(t, perm=[1, 0, 2]) if t else None for t in (yh, yc))
    found = g.push(start, {x: d for x, d in zip(node.inputs, dx) if x and d})
    return [found.get(t) if t else None for t in (y, yh, yc)]
