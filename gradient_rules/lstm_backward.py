"""The LSTM's backward with the recomputation batched over time (issue 38), for every direction and layout
where the node's ``Y`` output exists. ``recurrent._direction`` picks it inside ``hvp`` for a forward LSTM in layout
0 (whose closed-form tangent, ``lstm_tangent.py``, supplies what it recomputes); every other case keeps the
step-by-step form, which measured as fast or faster (its elementwise work stays in cache).
``lstm_batched_backward`` in ``emit_options`` forces either form.

``Y`` holds every hidden state, so the pre-activations of all steps are two products over [T*B] rows
(``X W^T + B`` and ``H_prev R^T``), and the gates' nonlinearities and the per-step factors of the reverse sweep
are elementwise over all steps at once; only the cell state's recurrence (a Mul and an Add a step) and the sweep
itself stay step by step. With

    q_t = o (1 - tanh^2 c_t)              p_t = [s'(A_i) cc, s'(A_o) tanh c_t, s'(A_f) c_{t-1}, tanh'(A_c) i]

a reverse step is ``dc~ = dh q_t + dc``, ``dA_t = [dc~, dh, dc~, dc~] p_t``, ``dh <- dA_t R + dy_{t-1}``,
``dc <- dc~ f_t``: seven kernels a step instead of the step's recomputation and the cell's backward (about
thirty), and a tangent through it (``hvp``'s forward over reverse) that follows the same few ops.
"""
from __future__ import annotations

import numpy as np

from onnx_autodiff.rule_api import GradBuilder


def _pieces(g: GradBuilder, x: str, steps: int, width: int) -> list[str]:
    """A [T*B, width] tensor as T pieces [1, B, width], in time order."""
    x = g.Reshape(x, g.ints([steps, -1, width]))
    return g.split(x, 0, [1] * steps)


def _shifted(g: GradBuilder, first: str, after: list[str], forward: bool) -> str:
    """The states entering each step, in time order, [T, B, H], from ``first`` (the initial state) and ``after``
    (the state after each step, in time order): a forward direction's step t starts from step t - 1's state, a
    reverse direction's from step t + 1's."""
    if len(after) == 1:
        return first
    return g.Concat(*([first] + after[:-1] if forward else after[1:] + [first]), axis=0)


def lstm_direction(seq, cell, d: int, order: list[int], zeros_state) -> dict[str, str]:
    """dx, dw, dr, db, dh0 and dc0 of direction ``d`` of an LSTM whose ``Y`` (``seq.y``, [T, dirs, B, H]) exists."""
    g, steps, hh = seq.g, seq.steps, seq.hidden
    forward = order[0] == 0
    y = g.Gather(seq.y, g.ints([d]), axis=1)  # [T, 1, B, H]
    y = g.Reshape(y, g.ints([steps, -1, hh]))
    h0, c0 = (g.unsqueeze(g.Gather(s, g.const(np.int64(d)), axis=0), [0]) if s else None for s in (seq.h0, seq.c0))
    if h0 is None:
        h0 = g.unsqueeze(zeros_state(g, seq.x, hh), [0])
    ys = g.split(y, 0, [1] * steps)
    hprev = g.Reshape(_shifted(g, h0, ys, forward), g.ints([-1, hh]))
    a = g.Gemm(seq.x_flat, cell.w, cell.wb, transB=1) if cell.wb is not None else g.Gemm(seq.x_flat, cell.w, transB=1)
    a = g.Gemm(hprev, cell.r, a, transB=1)  # [T*B, 4H]: every step's pre-activation
    sa, ca = g.split(a, 1, [3 * hh, hh])
    s, cc = g.Sigmoid(sa), g.Tanh(ca)
    i, o, f = g.split(s, 1, [hh] * 3)
    ics, fs = _pieces(g, g.Mul(i, cc), steps, hh), _pieces(g, f, steps, hh)
    c, cs = c0, {}
    for t in order:
        c = ics[t] if c is None else g.Add(g.Mul(fs[t], c), ics[t])
        cs[t] = c
    first_c = c0 if c0 is not None else g.unsqueeze(zeros_state(g, seq.x, hh), [0])
    c_all = g.Reshape(g.Concat(*[cs[t] for t in range(steps)], axis=0) if steps > 1 else cs[0], g.ints([-1, hh]))
    cprev = g.Reshape(_shifted(g, first_c, [cs[t] for t in range(steps)], forward), g.ints([-1, hh]))
    tc = g.Tanh(c_all)
    one = g.const(1.0, like=tc)
    qs = _pieces(g, g.Mul(o, g.Sub(one, g.Mul(tc, tc))), steps, hh)
    slopes = g.Concat(g.Mul(s, g.Sub(one, s)), g.Sub(one, g.Mul(cc, cc)), axis=1)
    ps = _pieces(g, g.Mul(slopes, g.Concat(cc, tc, cprev, i, axis=1)), steps, 4 * hh)
    marks = g.option("lstm_preactivations", None)
    if marks is not None:  # hvp: the forward's closed-form tangent computes these already (lstm_tangent.py)
        marks[(seq.node.name, d)] = {"a": a, "q": [qs[t] for t in range(steps)], "p": [ps[t] for t in range(steps)],
                                     "f": [fs[t] for t in range(steps)]}
    das, dh0, dc0 = _sweep(seq, cell, d, order, qs, ps, fs)
    dax = g.Concat(*[das[t] for t in range(steps)], axis=0) if steps > 1 else das[0]  # [T, B, 4H]
    dax_flat = g.Reshape(dax, g.ints([-1, 4 * hh]))
    db = g.reduce_sum(dax_flat, [0], keepdims=False)
    return {"dx": g.MatMul(dax, cell.w), "dw": g.Gemm(dax_flat, seq.x_flat, transA=1),
            "dr": g.Gemm(dax_flat, hprev, transA=1), "db": g.Concat(db, db, axis=0), "dh0": dh0, "dc0": dc0}


def _sweep(seq, cell, d: int, order: list[int], qs, ps, fs):
    """The reverse sweep over the precomputed factors: (dA per step [1, B, 4H], dh0 and dc0 [B, H])."""
    g, steps, hh = seq.g, seq.steps, seq.hidden

    def state(s):
        return None if s is None else g.unsqueeze(g.Gather(s, g.const(np.int64(d)), axis=0), [0])

    dh, dc = state(seq.dyh), state(seq.dyc)
    dys = None
    if seq.dy is not None:
        dy = g.Reshape(g.Gather(seq.dy, g.ints([d]), axis=1), g.ints([steps, -1, hh]))
        dys = g.split(dy, 0, [1] * steps)
    das = {}
    for t in reversed(order):
        if dys is not None:
            dh = dys[t] if dh is None else g.Add(dh, dys[t])
        if dh is None:
            dh = g.zeros_like(qs[t])
        dct = g.Mul(dh, qs[t])
        dct = dct if dc is None else g.Add(dct, dc)
        das[t] = g.Mul(g.Concat(dct, dh, dct, dct, axis=-1), ps[t])
        dh, dc = g.MatMul(das[t], cell.r), g.Mul(dct, fs[t])
    flat = g.ints([-1, hh])
    return das, g.Reshape(dh, flat), g.Reshape(dc, flat)
