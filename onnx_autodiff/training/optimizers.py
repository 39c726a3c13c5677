"""The optimizers ``make_training_model`` and ``ForwardBackwardTrainer`` emit: one table, with torch's defaults.

Momentum, Nesterov, Adagrad and Adam are the spec's ops (``ai.onnx.preview.training``, lowered by
``passes/optimizers.py``); SGD and AdamW are standard ops. Every ``emit`` takes the node builder, the
options, the parameters (name, type, shape, gradient), the learning-rate input (a float scalar), the
iteration counter ``t`` (int64, the number of finished steps) and ``state(param, slot)``, which gives
the name of a state tensor (the builder makes a zero initializer, the trainer a graph input). It sets
``param.new`` and returns ``(state, param, new state)`` for every state tensor.

Adam's and AdamW's bias corrections (``1 - beta^T`` and their roots) are scalars of their own that the
graph computes from the counter and that ``GraphBuilder.host_scalars`` records: the drivers (``TrainingSession``,
the step bundle's drivers) feed them computed in float64 on the host instead, as torch computes them. On
WebGPU a device ``Pow(0.999, T)`` is 1-6 ulps off, which ``1 - beta2^T`` amplifies to 2e-5..8e-5 relative
error in the state after a few steps.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from onnx import TensorProto, helper

from ..errors import TrainingBuilderError
from .nodes import GraphBuilder, normalize_name

PREVIEW = "ai.onnx.preview.training"


@dataclass
class Param:
    name: str
    dtype: int
    dims: list[int]
    grad: str = ""
    new: str = ""


StateFn = Callable[[Param, str], str]
States = list[tuple[str, Param, str]]


def _spec_op(b: GraphBuilder, op: str, params: list[Param], lr: str, step: str, extra: list[list[str]],
             attrs: dict) -> States:
    """One spec optimizer node over every parameter; ``extra``: its state tensors, one group per slot."""
    outs = [b.name(f"{p.name}.new") for p in params]
    extra_new = [[b.name(f"{s}.new") for s in group] for group in extra]
    b.op(op, lr, step, *[p.name for p in params], *[p.grad for p in params], *[s for g in extra for s in g],
         domain=PREVIEW, outputs=outs + [s for g in extra_new for s in g], **attrs)
    for p, o in zip(params, outs):
        p.new = o
    return [(s, p, s_new) for group, new_group in zip(extra, extra_new)
            for p, s, s_new in zip(params, group, new_group)]


def _momentum(b, opts, params, lr, t, state, mode="standard") -> States:
    # T = 0 on the first step: V = G, as torch's first momentum buffer
    extra = [[state(p, "momentum_buffer") for p in params]]
    attrs = dict(alpha=float(opts["momentum"]), beta=float(1.0 - opts["dampening"]),
                 norm_coefficient=float(opts["weight_decay"]), mode=mode)
    return _spec_op(b, "Momentum", params, lr, t, extra, attrs)


def _nesterov(b, opts, params, lr, t, state) -> States:
    return _momentum(b, opts, params, lr, t, state, mode="nesterov")


def _adagrad(b, opts, params, lr, t, state) -> States:
    extra = [[state(p, "sum") for p in params]]
    attrs = dict(decay_factor=float(opts["lr_decay"]), epsilon=float(opts["eps"]),
                 norm_coefficient=float(opts["weight_decay"]))
    return _spec_op(b, "Adagrad", params, lr, t, extra, attrs)


def bias_correction(b: GraphBuilder, t: str, factors: list[tuple[float, float]], dtype: int, hint: str) -> str:
    """The scalar ``prod (1 - beta^T) ** power`` over ``factors`` (beta, power), with ``T = t + 1`` (torch's
    step, counting from 1), computed by the graph and recorded in ``b.host_scalars`` under the name
    ``<scope>/<hint>``: a driver that knows ``t`` (the counter of finished steps) feeds it instead, computed in
    float64 on the host (``driver/step_model.host_scalar_value``). Computed on the
    device, ``Pow`` is a few ulps off on some (WebGPU), which the corrections amplify (module docstring)."""
    g = b.under(hint)
    step = g.Cast(g.Add(t, b.initializer(1, TensorProto.INT64, "one")), to=dtype)
    one = g.initializer(1.0, dtype, "one")
    value = None
    for beta, power in factors:
        term = g.Sub(one, g.Pow(g.initializer(beta, dtype, "beta"), step))
        if power == 0.5:
            term = g.Sqrt(term)
        elif power != 1.0:
            term = g.Pow(term, g.initializer(power, dtype, "power"))
        value = term if value is None else g.Mul(value, term)
    out = b.Identity(value, outputs=[b.name(hint)])
    b.host_scalars[out] = {"counter": t, "offset": 1, "dtype": helper.tensor_dtype_to_np_dtype(dtype).name,
                           "factors": [[float(beta), float(power)] for beta, power in factors]}
    return out


def _adam(b, opts, params, lr, t, state) -> States:
    b1, b2 = (float(v) for v in opts["betas"])
    # the spec's Adam corrects the learning rate by sqrt(1 - beta2^T) / (1 - beta1^T) for T > 0: that factor
    # is ours (host-computable, T = t + 1 as torch counts), so the node gets T = 0 and the corrected rate
    dtype = TensorProto.DOUBLE if any(p.dtype == TensorProto.DOUBLE for p in params) else TensorProto.FLOAT
    corr = bias_correction(b, t, [(b1, -1.0), (b2, 0.5)], dtype, "adam/bias_correction")
    g = b.under("adam")
    rate = g.Mul(lr if dtype == TensorProto.FLOAT else g.Cast(lr, to=dtype), corr)
    extra = [[state(p, "exp_avg") for p in params], [state(p, "exp_avg_sq") for p in params]]
    attrs = dict(alpha=b1, beta=b2, epsilon=float(opts["eps"]), norm_coefficient=float(opts["weight_decay"]))
    return _spec_op(b, "Adam", params, rate, g.initializer(0, TensorProto.INT64, "no_correction"), extra, attrs)


def _lr_cast(b: GraphBuilder, lr: str) -> Callable[[int], str]:
    """The learning rate in a parameter's element type (one Cast per type)."""
    lr_of: dict[int, str] = {}

    def lr_as(dtype: int) -> str:
        if dtype not in lr_of:
            lr_of[dtype] = lr if dtype == TensorProto.FLOAT else b.Cast(lr, to=dtype)
        return lr_of[dtype]
    return lr_as


def _sgd(b, opts, params, lr, t, state) -> States:
    lr_as = _lr_cast(b, lr)
    wd = float(opts["weight_decay"])
    for p in params:
        g = b.under(p.name)
        grad = p.grad
        if wd:
            grad = g.Add(grad, g.Mul(b.initializer(wd, p.dtype, "weight_decay"), p.name))
        p.new = b.Sub(p.name, g.Mul(lr_as(p.dtype), grad), outputs=[b.name(f"{p.name}.new")])
    return []


def _adamw(b, opts, params, lr, t, state) -> States:
    """As torch.optim.AdamW: decoupled decay first, then Adam with the bias corrections."""
    lr_as = _lr_cast(b, lr)
    states: States = []
    b1, b2 = (float(v) for v in opts["betas"])
    eps, wd = float(opts["eps"]), float(opts["weight_decay"])
    corr: dict[int, tuple[str, str]] = {}
    a = b.under("adamw")
    for p in params:
        d = p.dtype
        if d not in corr:
            c1 = bias_correction(b, t, [(b1, 1.0)], d, "adamw/bias1")
            step_size = a.Div(lr_as(d), c1)
            corr[d] = (step_size, bias_correction(b, t, [(b2, 0.5)], d, "adamw/sqrt_bias2"))
        step_size, sqrt_c2 = corr[d]
        m, v = state(p, "exp_avg"), state(p, "exp_avg_sq")
        g = b.under(p.name)
        lr_wd = g.Mul(lr_as(d), a.initializer(wd, d, "wd"))
        decayed = g.Sub(p.name, g.Mul(lr_wd, p.name))
        m_new = b.Add(g.Mul(a.initializer(b1, d, "beta1"), m),
                      g.Mul(a.initializer(1 - b1, d, "one_minus_beta1"), p.grad), outputs=[b.name(f"{m}.new")])
        v_new = b.Add(g.Mul(a.initializer(b2, d, "beta2"), v),
                      g.Mul(a.initializer(1 - b2, d, "one_minus_beta2"), g.Mul(p.grad, p.grad)),
                      outputs=[b.name(f"{v}.new")])
        denom = g.Add(g.Div(g.Sqrt(v_new), sqrt_c2), a.initializer(eps, d, "eps"))
        upd = g.Mul(step_size, g.Div(m_new, denom))
        p.new = b.Sub(decayed, upd, outputs=[b.name(f"{p.name}.new")])
        states += [(m, p, m_new), (v, p, v_new)]
    return states


@dataclass(frozen=True)
class Optimizer:
    """One optimizer: torch's defaults (every option it takes), its state slots, and how to emit it."""

    name: str
    defaults: dict
    slots: tuple[str, ...]
    emit: Callable[..., States]
    torch: str = ""


OPTIMIZERS: dict[str, Optimizer] = {o.name: o for o in (
    Optimizer("sgd", {"weight_decay": 0.0}, (), _sgd, "torch.optim.SGD"),
    Optimizer("momentum", {"momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0}, ("momentum_buffer",), _momentum,
              "torch.optim.SGD(momentum=...)"),
    Optimizer("nesterov", {"momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0}, ("momentum_buffer",), _nesterov,
              "torch.optim.SGD(nesterov=True)"),
    Optimizer("adagrad", {"lr_decay": 0.0, "eps": 1e-10, "weight_decay": 0.0}, ("sum",), _adagrad,
              "torch.optim.Adagrad"),
    Optimizer("adam", {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}, ("exp_avg", "exp_avg_sq"), _adam,
              "torch.optim.Adam"),
    Optimizer("adamw", {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}, ("exp_avg", "exp_avg_sq"), _adamw,
              "torch.optim.AdamW"),
)}


def resolve_optimizer(optimizer: str, options: dict | None) -> tuple[str, dict]:
    """(table name, torch's defaults overridden by ``options``), or a TrainingBuilderError."""
    if not isinstance(optimizer, str) or normalize_name(optimizer) not in OPTIMIZERS:
        raise TrainingBuilderError("optimizer",
                                   f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    name = normalize_name(optimizer)
    opts = dict(OPTIMIZERS[name].defaults)
    for k, v in (options or {}).items():
        if k not in opts:
            raise TrainingBuilderError("OptimizerSpec.options", f"{name} has no option {k!r}; it takes {sorted(opts)}")
        opts[k] = v
    if "betas" in opts:
        b1, b2 = opts["betas"]
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise TrainingBuilderError("OptimizerSpec.options", f"betas must lie in [0, 1), got {opts['betas']}")
    return name, opts


def emit_optimizer(b: GraphBuilder, name: str, opts: dict, params: list[Param], lr: str, t: str,
                   state: StateFn) -> States:
    """Append the update nodes of optimizer ``name``; sets ``p.new``, returns (state, param, new state)."""
    return OPTIMIZERS[name].emit(b, opts, params, lr, t, state)


__all__ = ["OPTIMIZERS", "Optimizer", "Param", "PREVIEW", "emit_optimizer", "resolve_optimizer", "bias_correction"]
