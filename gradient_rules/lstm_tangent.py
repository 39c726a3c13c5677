"""The LSTM's tangent in closed form (issue 38), for a one-direction forward LSTM in layout 0 with static shapes
and the default activations (what PyTorch exports); ``recurrent.recurrent_jvp`` pushes every other case
through the unrolled recurrence.

The tangent recurrence is linear in (dh, dc) with per-step factors of the primal gates:

    dA_t = P_t + dh_{t-1} R^T,  P = dX W^T + X dW^T + H_prev dR^T + dB   (P over all steps at once)
    dc_t = f_t dc_{t-1} + i'(A_i) cc dA_i + f'(A_f) c_{t-1} dA_f + tanh'(A_c) i dA_c
    dh_t = o'(A_o) tanh(c_t) dA_o + o_t tanh'(c_t) dc_t

and the rule replaces the fused node's outputs (``GradBuilder.replace_outputs``): one recurrence unrolled in
standard ops computes primal and tangent together, step by step (two products by R and a product by dR a step,
X W^T and X dW^T once over all steps), instead of the fused node plus an unrolled copy of it carrying the
tangents. Where the walk cannot drop a node (``jacobian``, a decomposition's inner walk), NotImplemented.
"""
from __future__ import annotations

import numpy as np

from onnx_autodiff.rule_api import GradBuilder, Grads, NodeView


def lstm_jvp(g: GradBuilder, node: NodeView, dx: Grads, check_options) -> Grads:
    """(dY, dY_h, dY_c) with the primal outputs replaced, or NotImplemented where the closed form does not apply
    (the caller then pushes the tangents through the unrolled recurrence beside the fused node)."""
    if (not g.option("lstm_tangent", True) or not g.can_replace_outputs() or node.op_type != "LSTM"
            or node.attr("direction", "forward") != "forward" or int(node.attr("layout", 0))):
        return NotImplemented
    xs = g.shape(node.inputs[0])
    if xs is None or len(xs) != 3 or not all(isinstance(d, int) for d in xs):
        return NotImplemented
    check_options(g, node, xs[0])
    return _Lstm(g, node, xs).run(dict(enumerate(dx)))


class _Lstm:
    def __init__(self, g: GradBuilder, node: NodeView, xs):
        self.g, self.node = g, node
        self.t, self.b, inputs = xs
        h = self.h = int(node.attr("hidden_size"))
        x, w, r = node.inputs[:3]
        self.xf = g.Reshape(x, g.ints([self.t * self.b, inputs]))
        self.w = g.Reshape(w, g.ints([4 * h, inputs]))
        self.r = g.Reshape(r, g.ints([4 * h, h]))
        b = node.input(3)
        self.bias = None if b is None else self._bias(b)
        self.h0, self.c0 = (self._state(node.input(k)) for k in (5, 6))
        self.one = g.const(1.0, like=self.xf)

    def _bias(self, b):
        g = self.g
        return g.reduce_sum(g.Reshape(b, g.ints([2, 4 * self.h])), [0], keepdims=False)

    def _state(self, s):
        return None if s is None else self.g.Reshape(s, self.g.ints([self.b, self.h]))

    def _steps(self, x):
        """Per-step [B, n] pieces of a [T*B, n] tensor (None: None per step)."""
        if x is None:
            return [None] * self.t
        return self.g.split(x, 0, [self.b] * self.t) if self.t > 1 else [x]

    def _gemm(self, a, b, c):
        """a b^T + c, each term None when zero."""
        if a is None or b is None:
            return c
        return self.g.Gemm(a, b, c, transB=1) if c is not None else self.g.Gemm(a, b, transB=1)

    def _input_tangent(self, dx: dict):
        """dX W^T + X dW^T + dB over all steps ([T*B, 4H]), or None when all are zero."""
        g, h = self.g, self.h
        acc = None if dx.get(3) is None else self._bias(dx[3])
        if dx.get(0) is not None:
            acc = self._gemm(g.Reshape(dx[0], g.ints([self.t * self.b, -1])), self.w, acc)
        if dx.get(1) is not None:
            acc = self._gemm(self.xf, g.Reshape(dx[1], g.ints([4 * h, -1])), acc)
        if acc is not None and g.shape(acc) != (self.t * self.b, 4 * h):
            acc = g.Expand(acc, g.ints([self.t * self.b, 4 * h]))
        return acc

    def run(self, dx: dict) -> list:
        """The recurrence with its tangent, step by step: replaces the node's outputs, returns their tangents."""
        g = self.g
        dr = None if dx.get(2) is None else g.Reshape(dx[2], g.ints([4 * self.h, self.h]))
        xw = self._steps(self._gemm(self.xf, self.w, self.bias))
        q = self._steps(self._input_tangent(dx))
        h, c, dh, dc = self.h0, self.c0, self._state(dx.get(5)), self._state(dx.get(6))
        hs, dhs = [], []
        for xw_t, q_t in zip(xw, q):
            da = self._gemm(dh, self.r, self._gemm(h, dr, q_t))
            h, c, dh, dc = self.step(self._gemm(h, self.r, xw_t), c, da, dc)
            hs.append(h)
            dhs.append(dh if dh is not None else g.const(np.zeros((self.b, self.h)), like=self.xf))
        return self.outputs(hs, c, dhs, dc)

    def step(self, a, c, da, dc):
        """One step from the pre-activation a (and its tangent da): h, c and their tangents."""
        g, h, one = self.g, self.h, self.one
        sa, ca = g.split(a, 1, [3 * h, h])
        s, cc = g.Sigmoid(sa), g.Tanh(ca)
        i, o, f = g.split(s, 1, [h, h, h])
        ic = g.Mul(i, cc)
        c_new = ic if c is None else g.Add(g.Mul(f, c), ic)
        tc = g.Tanh(c_new)
        terms = [] if dc is None else [g.Mul(f, dc)]
        uo = None
        if da is not None:
            das, dac = g.split(da, 1, [3 * h, h])
            kept = g.Concat(cc, tc, c, axis=1) if c is not None else None
            us = g.Mul(g.Mul(das, g.Mul(s, g.Sub(one, s))), kept) if kept is not None else None
            if us is None:  # c_{t-1} = 0: no forget-gate term
                di, do, _ = g.split(g.Mul(das, g.Mul(s, g.Sub(one, s))), 1, [h, h, h])
                ui, uo, uf = g.Mul(di, cc), g.Mul(do, tc), None
            else:
                ui, uo, uf = g.split(us, 1, [h, h, h])
            terms += [t for t in (ui, uf, g.Mul(g.Mul(dac, g.Sub(one, g.Mul(cc, cc))), i)) if t is not None]
        dc_new = None if not terms else terms[0] if len(terms) == 1 else g.Sum(*terms)
        dh = None if dc_new is None else g.Mul(g.Mul(o, g.Sub(one, g.Mul(tc, tc))), dc_new)
        dh = uo if dh is None else dh if uo is None else g.Add(uo, dh)
        return g.Mul(o, tc), c_new, dh, dc_new

    def outputs(self, hs, c, dhs, dc) -> list:
        g, t, b, h = self.g, self.t, self.b, self.h
        zeros = g.const(np.zeros((b, h)), like=self.xf)
        y = g.Reshape(g.Concat(*hs, axis=0) if t > 1 else hs[0], g.ints([t, 1, b, h]))
        yh, yc = (g.Reshape(v, g.ints([1, b, h])) for v in (hs[-1], c))
        g.replace_outputs(self.node, [y, yh, yc])
        dy = g.Reshape(g.Concat(*dhs, axis=0) if t > 1 else dhs[0], g.ints([t, 1, b, h]))
        dyh, dyc = (g.Reshape(v, g.ints([1, b, h])) for v in (dhs[-1], dc if dc is not None else zeros))
        return [dy if self.node.output(0) else None, dyh if self.node.output(1) else None,
                dyc if self.node.output(2) else None]
