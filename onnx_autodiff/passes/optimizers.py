"""Lower the optimizer ops of ai.onnx.preview.training (Adagrad, Adam, Momentum) to standard ops.

The emitted arithmetic follows the operator schemas' pseudo code (and onnx's reference
implementation) term by term, in the element type of the optimized tensor X. Scalars that depend
only on R and T (learning-rate corrections) are computed once per node and shared by all its tensors.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..engine.builder import Emitter, GradBuilder
from ..errors import TrainingSpecError
from ..graph import TRAINING_DOMAINS, GraphView, decoded, set_nodes, topological_sort
from .context import LoweringContext

OPTIMIZERS = {"Adagrad": 3, "Adam": 4, "Momentum": 3}  # op -> tensors per optimized X (X, G, [V], H)
_DEFAULTS = {
    "Adagrad": {"decay_factor": 0.0, "epsilon": 1e-6, "norm_coefficient": 0.0},
    "Adam": {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-6, "norm_coefficient": 0.0, "norm_coefficient_post": 0.0},
    "Momentum": {},
}
_REQUIRED = {"Momentum": ("alpha", "beta", "mode", "norm_coefficient")}


def is_optimizer(node: onnx.NodeProto) -> bool:
    return node.op_type in OPTIMIZERS and node.domain in TRAINING_DOMAINS


def _attrs(node: onnx.NodeProto) -> dict:
    where = f"{node.op_type} node {node.name!r}"
    got = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    out = dict(_DEFAULTS[node.op_type])
    for k, v in got.items():
        if k not in out and k not in _REQUIRED.get(node.op_type, ()):
            raise TrainingSpecError(f"{where}: unknown attribute {k!r}")
        out[k] = decoded(v)
    missing = [k for k in _REQUIRED.get(node.op_type, ()) if k not in out]
    if missing:
        raise TrainingSpecError(f"{where}: required attribute(s) {missing} are missing")
    if node.op_type == "Momentum" and out["mode"] not in ("standard", "nesterov"):
        raise TrainingSpecError(f"{where}: mode is {out['mode']!r}; use 'standard' or 'nesterov'")
    return out


class _Lowering:
    """Builds the plain nodes for one optimizer node."""

    def __init__(self, view: GraphView, node: onnx.NodeProto, taken: set[str]):
        self.node = node
        self.where = f"{node.op_type} node {node.name!r}"
        self.em = Emitter(view, taken)
        self.g = GradBuilder(self.em, node.name or node.op_type)
        per = OPTIMIZERS[node.op_type]
        ins = list(node.input)
        if len(ins) < 2 + per or (len(ins) - 2) % per:
            raise TrainingSpecError(
                f"{self.where}: has {len(ins)} inputs; expected R, T and then {per} groups of n tensors"
            )
        self.n = (len(ins) - 2) // per
        if len(node.output) > (per - 1) * self.n:
            raise TrainingSpecError(f"{self.where}: has {len(node.output)} outputs, expected {(per - 1) * self.n}")
        self.r, self.t = ins[0], ins[1]
        self.groups = [ins[2 + k * self.n: 2 + (k + 1) * self.n] for k in range(per)]
        self.attrs = _attrs(node)
        self._t_float: dict[int, str] = {}
        self._outs: list[tuple[str, str]] = []

    def dtype(self, *names: str) -> int:
        for n in names:
            dt = self.g.dtype(n)
            if dt:
                return dt
        raise TrainingSpecError(
            f"{self.where}: the element type of {names[0]!r} is unknown; give it a type (value_info, "
            "graph input or initializer)"
        )

    def c(self, value: float, like: str) -> str:
        return self.g.const(float(value), like=like)

    def as_type_of(self, name: str, like: str) -> str:
        """``name`` cast to the element type of ``like`` (no node when they already agree)."""
        want = self.dtype(like)
        have = self.g.dtype(name)
        return name if have == want else self.g.Cast(name, to=want)

    def t_positive(self) -> str:
        if not hasattr(self, "_tpos"):
            self._tpos = self.g.Greater(self.t, self.g.const(0, dtype=helper.tensor_dtype_to_np_dtype(
                self.g.dtype(self.t) or TensorProto.INT64)))
        return self._tpos

    def t_never_positive(self) -> bool:
        """T is a constant <= 0: no correction term at all."""
        t = self.g.value(self.t)
        return t is not None and int(np.asarray(t).reshape(-1)[0]) <= 0

    def t_as(self, like: str) -> str:
        dt = self.dtype(like)
        if dt not in self._t_float:
            self._t_float[dt] = self.g.Cast(self.t, to=dt)
        return self._t_float[dt]

    def regularized(self, x: str, grad: str, coef: float) -> str:
        return grad if coef == 0.0 else self.g.Add(self.g.Mul(self.c(coef, x), x), grad)

    def emit_out(self, k: int, src: str) -> None:
        """Output k of the optimizer node is ``src``: its producer is renamed to write it (``run`` does
        that), so no Identity copies a whole tensor."""
        if k < len(self.node.output) and self.node.output[k]:
            self._outs.append((src, self.node.output[k]))

    # ---- the three optimizers ---------------------------------------------------------------------
    def adagrad(self) -> None:
        a, g = self.attrs, self.g
        xs, gs, hs = self.groups
        for i, (x, dx, h) in enumerate(zip(xs, gs, hs)):
            r = self.as_type_of(self.r, x)
            denom = g.Add(self.c(1.0, x), g.Mul(self.t_as(x), self.c(a["decay_factor"], x)))
            rate = g.Div(r, denom)
            gr = self.regularized(x, dx, a["norm_coefficient"])
            h_new = g.Add(h, g.Mul(gr, gr))
            h_adaptive = g.Add(g.Sqrt(h_new), self.c(a["epsilon"], x))
            x_new = g.Sub(x, g.Div(g.Mul(rate, gr), h_adaptive))
            self.emit_out(i, x_new)
            self.emit_out(self.n + i, h_new)

    def adam(self) -> None:
        a, g = self.attrs, self.g
        alpha, beta = a["alpha"], a["beta"]
        xs, gs, vs, hs = self.groups
        for i, (x, dx, v, h) in enumerate(zip(xs, gs, vs, hs)):
            gr = self.regularized(x, dx, a["norm_coefficient"])
            v_new = g.Add(g.Mul(self.c(alpha, x), v), g.Mul(self.c(1.0 - alpha, x), gr))
            h_new = g.Add(g.Mul(self.c(beta, x), h), g.Mul(self.c(1.0 - beta, x), g.Mul(gr, gr)))
            h_sqrt = g.Add(g.Sqrt(h_new), self.c(a["epsilon"], x))
            r = self.as_type_of(self.r, x)
            if self.t_never_positive():  # R comes corrected (make_training_model's Adam: T = 0)
                r_adjusted = r
            else:
                tf = self.t_as(x)
                one = self.c(1.0, x)
                correction = g.Div(g.Sqrt(g.Sub(one, g.Pow(self.c(beta, x), tf))),
                                   g.Sub(one, g.Pow(self.c(alpha, x), tf)))
                r_adjusted = g.Where(self.t_positive(), g.Mul(r, correction), r)
            x_new = g.Sub(x, g.Mul(r_adjusted, g.Div(v_new, h_sqrt)))
            if a["norm_coefficient_post"] != 0.0:
                x_new = g.Mul(self.c(1.0 - a["norm_coefficient_post"], x), x_new)
            self.emit_out(i, x_new)
            self.emit_out(self.n + i, v_new)
            self.emit_out(2 * self.n + i, h_new)

    def momentum(self) -> None:
        a, g = self.attrs, self.g
        xs, gs, vs = self.groups
        for i, (x, dx, v) in enumerate(zip(xs, gs, vs)):
            r = self.as_type_of(self.r, x)
            gr = self.regularized(x, dx, a["norm_coefficient"])
            beta_adjusted = g.Where(self.t_positive(), self.c(a["beta"], x), self.c(1.0, x))
            v_new = g.Add(g.Mul(self.c(a["alpha"], x), v), g.Mul(beta_adjusted, gr))
            if a["mode"] == "standard":
                step = v_new
            else:
                step = g.Add(gr, g.Mul(self.c(a["alpha"], x), v_new))
            x_new = g.Sub(x, g.Mul(r, step))
            self.emit_out(i, x_new)
            self.emit_out(self.n + i, v_new)

    def run(self) -> list[onnx.NodeProto]:
        getattr(self, self.node.op_type.lower())()
        nodes = self.em.nodes
        producer = {o: n for n in nodes for o in n.output[:] if o}  # [:]: see graph.py's docstring
        rename: dict[str, str] = {}
        for src, out in self._outs:
            if src in producer and src not in rename:
                rename[src] = out
            else:  # a graph value, or one value that is two outputs: copy it
                nodes.append(helper.make_node("Identity", [src], [out], name=self.em.fresh(f"{self.g.scope}/out")))
        for n in nodes:  # only the names renamed are written back
            ins, outs = n.input[:], n.output[:]
            if not rename.keys().isdisjoint(ins):
                n.input[:] = [rename.get(name, name) for name in ins]
            if not rename.keys().isdisjoint(outs):
                n.output[:] = [rename.get(name, name) for name in outs]
        return nodes


def lower_optimizer_node(view: GraphView, node: onnx.NodeProto, taken: set[str]) -> list[onnx.NodeProto]:
    """The plain nodes that replace one Adagrad/Adam/Momentum node (its outputs keep their names)."""
    if view.opset("") < 9:
        raise TrainingSpecError(
            f"{node.op_type} node {node.name!r}: lowering needs default-domain opset 9 or newer (Where), "
            f"the model imports opset {view.opset('')}"
        )
    return _Lowering(view, node, taken).run()


def lower_optimizers(model: onnx.ModelProto, ctx: LoweringContext) -> bool:
    """Replace every optimizer node of ``model.graph`` (the names of the nodes added go to ``ctx.added``)."""
    if not any(is_optimizer(n) for n in model.graph.node):
        return False
    if not any(o.domain in ("", "ai.onnx") for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("", 13))
    view = GraphView.of_model(model)
    nodes = []
    for n in model.graph.node:
        if not is_optimizer(n):
            nodes.append(n)
            continue
        new = lower_optimizer_node(view, n, ctx.taken)
        ctx.added.update(m.name for m in new)
        nodes.extend(new)
    set_nodes(model.graph, topological_sort(nodes))
    return True
