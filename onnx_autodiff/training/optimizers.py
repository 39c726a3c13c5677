"""The optimizers ``make_training_model`` and ``ForwardBackwardTrainer`` emit, with torch's defaults."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper

from ..errors import TrainingBuilderError
from ..weights import placeholder
from .nodes import NodeBuilder, normalize_name

PREVIEW = "ai.onnx.preview.training"
OPTIMIZERS: dict[str, dict] = {
    "sgd": {"weight_decay": 0.0},
    "momentum": {"momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0},
    "nesterov": {"momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0},
    "adagrad": {"lr_decay": 0.0, "eps": 1e-10, "weight_decay": 0.0},
    "adam": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "adamw": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
}


def resolve_optimizer(optimizer: str, options: dict | None) -> tuple[str, dict]:
    if not isinstance(optimizer, str) or normalize_name(optimizer) not in OPTIMIZERS:
        raise TrainingBuilderError("optimizer", f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    name = normalize_name(optimizer)
    opts = dict(OPTIMIZERS[name])
    for k, v in (options or {}).items():
        if k not in opts:
            raise TrainingBuilderError("optimizer_options", f"{name} has no option {k!r}; it takes {sorted(opts)}")
        opts[k] = v
    if "betas" in opts:
        b1, b2 = opts["betas"]
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise TrainingBuilderError("optimizer_options", f"betas must lie in [0, 1), got {opts['betas']}")
    return name, opts


@dataclass
class Param:
    name: str
    dtype: int
    dims: list[int]
    grad: str = ""
    new: str = ""


def emit_optimizer(b: NodeBuilder, name: str, opts: dict, params: list[Param], lr: str, t: str,
                    states: list[tuple[str, Param, str]]) -> None:
    """Append the update nodes; set ``p.new`` and record (state name, param, new value) in ``states``."""
    def state(p: Param, suffix: str) -> str:
        s = b.name(f"{p.name}.{suffix}")
        zeros = np.zeros(p.dims, helper.tensor_dtype_to_np_dtype(p.dtype))  # calloc: no memory until written
        b.inits.append(placeholder(s, zeros))
        b.arrays[s] = zeros
        return s

    one = b.const(1, TensorProto.INT64, "one")
    if name in ("momentum", "nesterov", "adagrad", "adam"):
        if name == "adam":
            b1, b2 = opts["betas"]
            step = b.op("Add", [t, one], "adam/step")  # the spec's T counts from 1 like torch's step
            extra = [[state(p, "exp_avg") for p in params], [state(p, "exp_avg_sq") for p in params]]
            attrs = dict(alpha=float(b1), beta=float(b2), epsilon=float(opts["eps"]),
                         norm_coefficient=float(opts["weight_decay"]))
            op = "Adam"
        elif name == "adagrad":
            step = t
            extra = [[state(p, "sum") for p in params]]
            attrs = dict(decay_factor=float(opts["lr_decay"]), epsilon=float(opts["eps"]),
                         norm_coefficient=float(opts["weight_decay"]))
            op = "Adagrad"
        else:
            step = t  # T = 0 on the first step: V = G, as torch's first momentum buffer
            extra = [[state(p, "momentum_buffer") for p in params]]
            attrs = dict(alpha=float(opts["momentum"]), beta=float(1.0 - opts["dampening"]),
                         norm_coefficient=float(opts["weight_decay"]), mode="standard" if name == "momentum" else "nesterov")
            op = "Momentum"
        outs = [b.name(f"{p.name}.new") for p in params]
        extra_new = [[b.name(f"{s}.new") for s in group] for group in extra]
        b.op(op, [lr, step] + [p.name for p in params] + [p.grad for p in params] + [s for g in extra for s in g],
             name, domain=PREVIEW, outputs=outs + [s for g in extra_new for s in g], **attrs)
        for p, o in zip(params, outs):
            p.new = o
        for group, new_group in zip(extra, extra_new):
            for p, s, s_new in zip(params, group, new_group):
                states.append((s, p, s_new))
        return

    lr_of: dict[int, str] = {}

    def lr_as(dtype: int) -> str:
        if dtype not in lr_of:
            lr_of[dtype] = lr if dtype == TensorProto.FLOAT else b.op("Cast", [lr], "lr_cast", to=dtype)
        return lr_of[dtype]

    if name == "sgd":
        wd = float(opts["weight_decay"])
        for p in params:
            g = p.grad
            if wd:
                g = b.op("Add", [g, b.op("Mul", [b.const(wd, p.dtype, "weight_decay"), p.name], f"{p.name}/decay")],
                         f"{p.name}/grad_decayed")
            p.new = b.op("Sub", [p.name, b.op("Mul", [lr_as(p.dtype), g], f"{p.name}/step")], f"{p.name}.new")
        return

    # adamw, as torch.optim.AdamW: decoupled decay first, then Adam with the bias corrections
    b1, b2 = (float(v) for v in opts["betas"])
    eps, wd = float(opts["eps"]), float(opts["weight_decay"])
    step = b.op("Add", [t, one], "adamw/step")
    corr: dict[int, tuple[str, str]] = {}
    for p in params:
        d = p.dtype
        if d not in corr:
            tf = b.op("Cast", [step], "adamw/step_float", to=d)
            c1 = b.op("Sub", [b.const(1.0, d, "adamw/one"), b.op("Pow", [b.const(b1, d, "adamw/beta1"), tf], "adamw/b1_t")], "adamw/bias1")
            c2 = b.op("Sub", [b.const(1.0, d, "adamw/one"), b.op("Pow", [b.const(b2, d, "adamw/beta2"), tf], "adamw/b2_t")], "adamw/bias2")
            step_size = b.op("Div", [lr_as(d), c1], "adamw/step_size")
            corr[d] = (step_size, b.op("Sqrt", [c2], "adamw/sqrt_bias2"))
        step_size, sqrt_c2 = corr[d]
        m, v = state(p, "exp_avg"), state(p, "exp_avg_sq")
        decayed = b.op("Sub", [p.name, b.op("Mul", [b.op("Mul", [lr_as(d), b.const(wd, d, "adamw/wd")], f"{p.name}/lr_wd"), p.name],
                                            f"{p.name}/decay")], f"{p.name}/decayed")
        m_new = b.op("Add", [b.op("Mul", [b.const(b1, d, "adamw/beta1"), m], f"{m}/old"),
                             b.op("Mul", [b.const(1 - b1, d, "adamw/one_minus_beta1"), p.grad], f"{m}/g")], f"{m}.new")
        v_new = b.op("Add", [b.op("Mul", [b.const(b2, d, "adamw/beta2"), v], f"{v}/old"),
                             b.op("Mul", [b.const(1 - b2, d, "adamw/one_minus_beta2"),
                                          b.op("Mul", [p.grad, p.grad], f"{p.name}/grad_sq")], f"{v}/g")], f"{v}.new")
        denom = b.op("Add", [b.op("Div", [b.op("Sqrt", [v_new], f"{v}/sqrt"), sqrt_c2], f"{v}/corrected"),
                             b.const(eps, d, "adamw/eps")], f"{p.name}/denom")
        upd = b.op("Mul", [step_size, b.op("Div", [m_new, denom], f"{p.name}/ratio")], f"{p.name}/update")
        p.new = b.op("Sub", [decayed, upd], f"{p.name}.new")
        states += [(m, p, m_new), (v, p, v_new)]

