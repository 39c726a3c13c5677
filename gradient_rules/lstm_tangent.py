"""The LSTM's tangent in closed form (issue 38), for a one-direction forward LSTM in layout 0 with static shapes
and the default activations (what PyTorch exports); ``recurrent.recurrent_jvp`` pushes every other case
through the unrolled recurrence.

The tangent recurrence is linear in (dh, dc) with per-step factors of the primal gates:

    dA_t = dX_t W^T + X_t dW^T + h_{t-1} dR^T + dh_{t-1} R^T + dB
    dc_t = f_t dc_{t-1} + i'(A_i) cc dA_i + f'(A_f) c_{t-1} dA_f + tanh'(A_c) i dA_c
    dh_t = o'(A_o) tanh(c_t) dA_o + o_t tanh'(c_t) dc_t

and the rule replaces the fused node's outputs (``GradBuilder.replace_outputs``): one recurrence unrolled in
standard ops computes primal and tangent together, step by step (two products by R and a product by dR a step,
X W^T and X dW^T once over all steps), instead of the fused node plus an unrolled copy of it carrying the
tangents. Where the walk cannot drop a node (``jacobian``, a decomposition's inner walk), NotImplemented.
Outside ``hvp``'s sharing, ``lean_step`` (``lstm_tangent_lean``, default on) takes the step in fewer kernels: the
cell gate's weight rows pre-scaled so that one Sigmoid gives every gate (tanh(a) = 2 sigmoid(2a) - 1).
"""
from __future__ import annotations

import numpy as np

from onnx_autodiff.rule_api import GradBuilder, Grads, NodeView


def lstm_jvp(g: GradBuilder, node: NodeView, dx: Grads, check_options) -> Grads:
    """(dY, dY_h, dY_c) with the primal outputs replaced, or NotImplemented where the closed form does not apply
    (the caller then pushes the tangents through the unrolled recurrence beside the fused node)."""
    if (not g.option("lstm_tangent", True) or not g.can_replace_outputs() or node.op_type != "LSTM"
            or node.attr("direction", "forward") != "forward" or int(node.attr("layout", 0))
            or node.attr("hidden_size") is None):
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
        self._weights: dict[tuple, str] = {}
        marks = g.option("lstm_preactivations", None)
        self.shared = None if not marks else marks.get((node.name, 0))  # what hvp's LSTM backward recomputes
        self.factors: list[dict] = []  # per step, where shared: the backward's factors and their tangents
        self.lean = self.shared is None and g.option("lstm_tangent_lean", True)

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

    def run(self, dx: dict) -> list:
        """The recurrence with its tangent, step by step: replaces the node's outputs, returns their tangents.
        Each step's products are one Gemm for the primal ([x_t, h] [W, R]^T) and one for the tangent
        ([x_t, h, dh, dx_t] [dW, dR, R, W]^T, the terms with a zero tangent left out)."""
        g, h4 = self.g, 4 * self.h
        weights = {k: None if dx.get(k) is None else g.Reshape(dx[k], g.ints([h4, -1])) for k in (1, 2)}
        dbias = None if dx.get(3) is None else self._bias(dx[3])
        w, r, bias, tw, tr = self.w, self.r, self.bias, self.w, self.r
        if self.lean:  # the cell gate's rows scaled: tanh(a) = 2 sigmoid(2a) - 1, its slope 4 s (1 - s)
            w, r, bias = self._scaled(w, 2.0), self._scaled(r, 2.0), self._scaled(bias, 2.0, rows=False)
            weights = {k: self._scaled(v, 4.0) for k, v in weights.items()}
            dbias = self._scaled(dbias, 4.0, rows=False)
            tw, tr = self._scaled(tw, 4.0), self._scaled(tr, 4.0)
        xs = self._steps(self.xf)
        dxs = self._steps(None if dx.get(0) is None else g.Reshape(dx[0], g.ints([self.t * self.b, -1])))
        h, c, dh, dc = self.h0, self.c0, self._state(dx.get(5)), self._state(dx.get(6))
        hs, dhs, pre = [], [], []
        for x_t, dx_t in zip(xs, dxs):
            a = self._products([(x_t, w), (h, r)], bias)
            da = self._products([(x_t, weights[1]), (h, weights[2]), (dh, tr), (dx_t, tw)], dbias)
            pre.append((a, da))
            h, c, dh, dc = (self.lean_step if self.lean else self.step)(a, c, da, dc)
            hs.append(h)
            dhs.append(dh if dh is not None else self._zeros())
        self._share(pre)
        return self.outputs(hs, c, dhs, dc)

    def _share(self, pre):
        """In ``hvp``: what the LSTM backward recomputed from Y (``lstm_backward``, recorded under
        ``lstm_preactivations``) replaced by this recurrence's values and tangents, so the HVP computes them once:
        the sweep's per-step factors (the nodes that split them into steps), else the pre-activations of all
        steps (the Gemm over [T*B] rows)."""
        g, shared = self.g, self.shared
        if shared is None or any(v is None for pair in pre for v in pair):
            return
        if len(self.factors) == self.t and all(self._pieces_of(shared[k]) for k in ("p", "q", "f")):
            for k in ("p", "q", "f"):
                per_step = [step[k] for step in self.factors]
                g.replace_outputs(self._pieces_of(shared[k]), [g.unsqueeze(v, [0]) for v, _ in per_step],
                                  [g.unsqueeze(t, [0]) for _, t in per_step])
            return
        name = shared["a"]
        producer = g.producer(name)
        if (producer is None or producer.op_type != "Gemm" or list(producer.output) != [name]
                or g.shape(name) not in (None, (self.t * self.b, 4 * self.h))):
            return
        a, da = ([p[k] for p in pre] for k in (0, 1))
        g.replace_outputs(producer, [g.Concat(*a, axis=0) if self.t > 1 else a[0]],
                          [g.Concat(*da, axis=0) if self.t > 1 else da[0]])

    def _scaled(self, v, scale, rows=True):
        """v ([4H, n] rows, else [4H]) with the cell gate's part times ``scale`` (None: None)."""
        if v is None:
            return None
        h, g = self.h, self.g
        col = np.array([1.0] * (3 * h) + [scale] * h).reshape((-1, 1) if rows else (-1,))
        return g.Mul(v, g.const(col, like=self.xf))

    def _pieces_of(self, names):
        """The node whose outputs are exactly ``names`` (a Split into steps, or one node for one step), else None."""
        producer = self.g.producer(names[0])
        return producer if producer is not None and list(producer.output) == list(names) else None

    def _products(self, pairs, bias):
        """sum of a b^T over the pairs with both terms, plus bias (None: zero), as one Gemm over the concatenated
        terms; the weights' concatenation made once per set of terms."""
        g = self.g
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        if not pairs:
            return None if bias is None else g.Expand(bias, g.ints([self.b, 4 * self.h]))
        key = tuple(b for _, b in pairs)
        if key not in self._weights:
            self._weights[key] = key[0] if len(key) == 1 else g.Concat(*key, axis=1)
        lhs = pairs[0][0] if len(pairs) == 1 else g.Concat(*[a for a, _ in pairs], axis=1)
        w = self._weights[key]
        return g.Gemm(lhs, w, bias, transB=1) if bias is not None else g.Gemm(lhs, w, transB=1)

    def _zeros(self):
        return self.g.const(np.zeros((self.b, self.h)), like=self.xf)

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
        sharing = self.shared is not None and da is not None and g.option("lstm_hvp_share_factors", True)
        if da is not None:  # dA times the gates' derivatives times what each gate multiplies
            slopes = g.Concat(g.Mul(s, g.Sub(one, s)), g.Sub(one, g.Mul(cc, cc)), axis=1)
            factors = g.Concat(cc, tc, c if c is not None else self._zeros(), i, axis=1)
            if sharing:
                p = g.Mul(slopes, factors)
                ui, uo, uf, uc = g.split(g.Mul(da, p), 1, [h] * 4)
            else:
                ui, uo, uf, uc = g.split(g.Mul(g.Mul(da, slopes), factors), 1, [h] * 4)
            terms += [ui, uf, uc]
        dc_new = None if not terms else terms[0] if len(terms) == 1 else g.Sum(*terms)
        h_new = g.Mul(o, tc)
        q = g.Sub(o, g.Mul(h_new, tc))  # o (1 - tanh^2 c)
        dh = None if dc_new is None else g.Mul(q, dc_new)
        dh = uo if dh is None else dh if uo is None else g.Add(uo, dh)
        if sharing:
            self.factors.append(self._factor_tangents(s, cc, tc, h_new, f, da, dc, dc_new, slopes, factors, p, q))
        return h_new, c_new, dh, dc_new

    def lean_step(self, a, c, da, dc):
        """``step`` in fewer kernels, from pre-activations whose cell-gate columns are doubled (their tangents
        quadrupled): one Sigmoid gives every gate, the cell gate cc = 2 s - 1, and every gate's slope is
        s (1 - s) (the factor 4 of tanh's is in the tangent's weights); the gate sum as Adds."""
        g, h, one = self.g, self.h, self.one
        s = g.Sigmoid(a)
        i, o, f, sc = g.split(s, 1, [h] * 4)
        cc = g.Sub(g.Add(sc, sc), one)
        ic = g.Mul(i, cc)
        c_new = ic if c is None else g.Add(g.Mul(f, c), ic)
        tc = g.Tanh(c_new)
        h_new = g.Mul(o, tc)
        terms, uo = [] if dc is None else [g.Mul(f, dc)], None
        if da is not None:  # dA times the gates' slopes times what each gate multiplies
            factors = g.Concat(cc, tc, c if c is not None else self._zeros(), i, axis=1)
            ui, uo, uf, uc = g.split(g.Mul(g.Mul(da, g.Sub(s, g.Mul(s, s))), factors), 1, [h] * 4)
            terms += [ui, uf, uc]
        dc_new = None
        for term in terms:
            dc_new = term if dc_new is None else g.Add(dc_new, term)
        dh = None if dc_new is None else g.Mul(g.Sub(o, g.Mul(h_new, tc)), dc_new)  # o (1 - tanh^2 c) dc
        dh = uo if dh is None else dh if uo is None else g.Add(uo, dh)
        return h_new, c_new, dh, dc_new

    def _factor_tangents(self, s, cc, tc, h_new, f, da, dc, dc_new, slopes, factors, p, q) -> dict:
        """The LSTM backward's per-step factors (``lstm_backward``: p = slopes * factors, q = o (1 - tanh^2 c), f)
        with their tangents: v = dA * slopes holds the gates' tangents [di, do, df, dcc]; dtc = (1 - tc^2) dc;
        dq = do (1 - tc^2) - 2 h dtc; dp = v [1 - 2s, -2 cc] * factors + slopes * [dcc, dtc, dc_{t-1}, di]."""
        g, h, one = self.g, self.h, self.one
        v = g.Mul(da, slopes)
        vi, vo, vf, vc = g.split(v, 1, [h] * 4)
        w = g.Sub(one, g.Mul(tc, tc))
        dtc = g.Mul(w, dc_new)
        two = g.const(2.0, like=self.xf)
        dq = g.Sub(g.Mul(vo, w), g.Mul(g.Mul(h_new, dtc), two))
        curvature = g.Concat(g.Sub(one, g.Mul(s, two)), g.Mul(cc, g.const(-2.0, like=self.xf)), axis=1)
        dfactors = g.Concat(vc, dtc, dc if dc is not None else self._zeros(), vi, axis=1)
        dp = g.Add(g.Mul(g.Mul(v, curvature), factors), g.Mul(slopes, dfactors))
        return {"p": (p, dp), "q": (q, dq), "f": (f, vf)}

    def outputs(self, hs, c, dhs, dc) -> list:
        g, t, b, h = self.g, self.t, self.b, self.h
        y = g.Reshape(g.Concat(*hs, axis=0) if t > 1 else hs[0], g.ints([t, 1, b, h]))
        yh, yc = (g.Reshape(v, g.ints([1, b, h])) for v in (hs[-1], c))
        g.replace_outputs(self.node, [y, yh, yc])
        dy = g.Reshape(g.Concat(*dhs, axis=0) if t > 1 else dhs[0], g.ints([t, 1, b, h]))
        dyh, dyc = (g.Reshape(v, g.ints([1, b, h])) for v in (dhs[-1], dc if dc is not None else self._zeros()))
        return [dy if self.node.output(0) else None, dyh if self.node.output(1) else None,
                dyc if self.node.output(2) else None]
