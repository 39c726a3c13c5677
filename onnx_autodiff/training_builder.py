"""``make_training_model``: an inference model, a loss and an optimizer -> a spec training model.

The result is the inference model unchanged plus one ``TrainingInfoProto`` as the released ONNX
spec (IR >= 7, domain ``ai.onnx.preview.training``) writes it:

* ``algorithm``: the loss on the chosen outputs, one ``Gradient`` node (``xs`` = the trainable
  initializers, ``y`` = the loss), the optimizer (the spec's ``Adagrad`` / ``Adam`` / ``Momentum``
  ops, or standard ops for SGD and AdamW) and an iteration counter ``T_new = T + 1``. Inputs: the
  labels and ``learning_rate`` (a float scalar whose default is ``lr``; a driver feeds it at every
  step to schedule it; ``lr`` is also recorded in ``metadata_props``).
* ``update_binding``: every trainable weight, every optimizer state tensor and the counter.
* ``initialization`` + ``initialization_binding``: zeros for the optimizer state and the counter
  (the weights keep the inference model's values).

``lower`` / ``TrainingSession`` / any spec reader then trains it. Frozen initializers are not in
``xs``, so the lowering emits no backward computation for them.
"""
from __future__ import annotations

import fnmatch
import json
import logging
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .errors import TrainingBuilderError
from .graph import FLOAT_TYPES
from .parameters import constant_initializers, describe, untie_aliases
from .passes.naming import used_names
from .weights import attach_weights, placeholder, split_model

PREVIEW = "ai.onnx.preview.training"
LEARNING_RATE = "learning_rate"
BUILDER_KEY = "onnx_autodiff.training_builder"

LOSSES = ("cross_entropy", "nll", "mse", "l1", "bce", "bce_with_logits")
_LOSS_ALIASES = {
    "ce": "cross_entropy", "crossentropy": "cross_entropy", "softmax_cross_entropy": "cross_entropy",
    "xent": "cross_entropy", "negative_log_likelihood": "nll", "l2": "mse", "mae": "l1",
    "binary_cross_entropy": "bce", "bce_logits": "bce_with_logits",
    "binary_cross_entropy_with_logits": "bce_with_logits",
}
OPTIMIZERS: dict[str, dict] = {
    "sgd": {"weight_decay": 0.0},
    "momentum": {"momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0},
    "nesterov": {"momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0},
    "adagrad": {"lr_decay": 0.0, "eps": 1e-10, "weight_decay": 0.0},
    "adam": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "adamw": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
}


@dataclass
class _Value:
    name: str
    elem_type: int
    dims: list | None  # int, str (symbolic) or None (unknown) per axis; None for an unknown rank

    def shape_text(self) -> str:
        if self.dims is None:
            return "unknown"
        return "[" + ", ".join("?" if d is None else str(d) for d in self.dims) + "]"


def _dims_of(vi: onnx.ValueInfoProto) -> list | None:
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]


def _value_infos(model: onnx.ModelProto) -> dict[str, _Value]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # best effort; declared types still count
        inferred = model
    out: dict[str, _Value] = {}
    g = inferred.graph
    for vi in list(g.value_info) + list(model.graph.output) + list(g.output) + list(g.input):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            out[vi.name] = _Value(vi.name, vi.type.tensor_type.elem_type, _dims_of(vi))
    return out


def _compatible(a: list | None, b: list | None) -> bool:
    if a is None or b is None:
        return True
    if len(a) != len(b):
        return False
    return all(x == y or x is None or y is None or isinstance(x, str) or isinstance(y, str) for x, y in zip(a, b))


def _norm(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(" ", "_")


class _Graph:
    """Nodes, initializers, inputs and outputs of one graph under construction, with unique names."""

    def __init__(self, taken: set[str], prefix: str):
        self.taken = taken
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.arrays: dict[str, np.ndarray] = {}  # values of detached initializers (optimizer state)

    def name(self, want: str) -> str:
        base = f"{self.prefix}/{want}" if self.prefix else want
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name

    def op(self, op_type: str, inputs: list[str], hint: str, n_out: int = 1, domain: str = "",
           outputs: list[str] | None = None, **attrs) -> list[str] | str:
        outs = outputs or [self.name(f"{hint}_out{k}" if n_out > 1 else hint) for k in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.name(f"{hint}/{op_type}"),
                                           domain=domain, **attrs))
        return outs if n_out > 1 or outputs else outs[0]

    def const(self, value, dtype: int, hint: str = "const") -> str:
        arr = np.array(value, dtype=helper.tensor_dtype_to_np_dtype(dtype))
        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(arr, name))
        return name


# ---- losses -------------------------------------------------------------------------------------

def _loss_kind(spec, field: str):
    if isinstance(spec, onnx.GraphProto):
        return spec
    if isinstance(spec, onnx.ModelProto):
        return spec.graph
    if not isinstance(spec, str):
        raise TrainingBuilderError(field, f"a loss is a name or an onnx.GraphProto, got {type(spec).__name__}")
    kind = _norm(spec)
    kind = _LOSS_ALIASES.get(kind, kind)
    if kind not in LOSSES:
        raise TrainingBuilderError(field, f"unknown loss {spec!r}; choose one of {', '.join(LOSSES)}, or pass a "
                                          "GraphProto (inputs: model output, label; output: a scalar)")
    return kind


def _label_info(kind, y: _Value, field: str, opset: int) -> tuple[int, list | None]:
    """(element type, dims) the label of a built-in loss must have."""
    if kind in ("cross_entropy", "nll"):
        if opset < 12:
            raise TrainingBuilderError(field, f"{kind} needs opset >= 12 (SoftmaxCrossEntropyLoss / "
                                              f"NegativeLogLikelihoodLoss); the model imports opset {opset}. "
                                              "Convert it with onnx.version_converter first")
        if y.dims is not None and len(y.dims) < 2:
            raise TrainingBuilderError(field, f"{kind} needs class scores of shape [N, C, ...]; output {y.name!r} "
                                              f"has shape {y.shape_text()}. Use mse/l1/bce for it, or a [N, C] output")
        dims = None if y.dims is None else [y.dims[0]] + list(y.dims[2:])
        return TensorProto.INT64, dims
    return y.elem_type, None if y.dims is None else list(y.dims)


def _builtin_loss(b: _Graph, kind: str, y: str, label: str, dtype: int) -> str:
    if kind == "cross_entropy":
        return b.op("SoftmaxCrossEntropyLoss", [y, label], "cross_entropy", reduction="mean")
    if kind == "nll":
        return b.op("NegativeLogLikelihoodLoss", [y, label], "nll", reduction="mean")
    if kind in ("mse", "l1"):
        d = b.op("Sub", [y, label], f"{kind}/diff")
        e = b.op("Mul", [d, d], f"{kind}/square") if kind == "mse" else b.op("Abs", [d], f"{kind}/abs")
        return b.op("ReduceMean", [e], kind, keepdims=0)
    if kind == "bce":  # torch.nn.BCELoss: the logs are clamped at -100
        one, floor = b.const(1.0, dtype, "bce/one"), b.const(-100.0, dtype, "bce/floor")
        log_p = b.op("Max", [b.op("Log", [y], "bce/log_p"), floor], "bce/log_p_clamped")
        q = b.op("Sub", [one, y], "bce/one_minus_p")
        log_q = b.op("Max", [b.op("Log", [q], "bce/log_q"), floor], "bce/log_q_clamped")
        t_log_p = b.op("Mul", [label, log_p], "bce/t_log_p")
        rest = b.op("Mul", [b.op("Sub", [one, label], "bce/one_minus_t"), log_q], "bce/rest")
        mean = b.op("ReduceMean", [b.op("Add", [t_log_p, rest], "bce/sum")], "bce/mean", keepdims=0)
        return b.op("Neg", [mean], "bce")
    # bce_with_logits: softplus(x) - x t, whose derivative is sigmoid(x) - t (onnxruntime's Softplus is stable)
    sp = b.op("Softplus", [y], "bce_with_logits/softplus")
    xt = b.op("Mul", [y, label], "bce_with_logits/x_t")
    return b.op("ReduceMean", [b.op("Sub", [sp, xt], "bce_with_logits/term")], "bce_with_logits", keepdims=0)


def _graph_loss(b: _Graph, graph: onnx.GraphProto, y: _Value, label: str, field: str) -> tuple[str, onnx.ValueInfoProto]:
    """Copy a user loss graph (inputs: model output, label; one scalar output) into the algorithm."""
    inits = {t.name for t in graph.initializer}
    real_inputs = [i for i in graph.input if i.name not in inits]
    if len(real_inputs) != 2 or len(graph.output) != 1:
        raise TrainingBuilderError(field, f"a loss graph takes 2 inputs (model output, label) and has 1 output; "
                                          f"{graph.name!r} has {len(real_inputs)} inputs and {len(graph.output)} outputs")
    for n in graph.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            raise TrainingBuilderError(field, f"loss graph node {n.name or n.op_type!r} has a subgraph; "
                                              "loss graphs with control flow are not supported")
    y_in, t_in = real_inputs
    declared = _dims_of(y_in) if y_in.type.HasField("tensor_type") else None
    if not _compatible(declared, y.dims):
        raise TrainingBuilderError(field, f"loss graph input {y_in.name!r} has shape "
                                          f"{_Value('', 0, declared).shape_text()} but output {y.name!r} has shape "
                                          f"{y.shape_text()}")
    rename = {y_in.name: y.name, t_in.name: label}
    prefix = f"loss_{graph.name}" if graph.name else "loss_graph"
    for t in graph.initializer:
        new = onnx.TensorProto()
        new.CopyFrom(t)
        new.name = rename[t.name] = b.name(f"{prefix}/{t.name}")
        b.inits.append(new)
    for n in graph.node:
        for o in n.output:
            if o:
                rename[o] = b.name(f"{prefix}/{o}")
    for n in graph.node:
        new = onnx.NodeProto()
        new.CopyFrom(n)
        new.name = b.name(f"{prefix}/{n.name or n.op_type}")
        new.input[:] = [rename.get(i, i) if i else "" for i in n.input]
        new.output[:] = [rename.get(o, o) if o else "" for o in n.output]
        b.nodes.append(new)
    out = rename.get(graph.output[0].name, graph.output[0].name)
    label_vi = onnx.ValueInfoProto()
    label_vi.CopyFrom(t_in)
    label_vi.name = label
    return out, label_vi


# ---- trainable selection ------------------------------------------------------------------------

def _ancestors(graph: onnx.GraphProto, outputs: list[str]) -> set[str]:
    producer = {o: n for n in graph.node for o in n.output if o}
    seen: set[str] = set()
    stack = list(outputs)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is not None:
            stack.extend(i for i in node.input if i)
            for a in node.attribute:  # names a subgraph reads from the outer scope
                for sg in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    stack.extend(i for m in sg.node for i in m.input if i)
    return seen


def _running_stats(graph: onnx.GraphProto) -> set[str]:
    return {n.input[k] for n in graph.node if n.op_type == "BatchNormalization" for k in (3, 4) if len(n.input) > k}


_log = logging.getLogger("onnx_autodiff")


def default_frozen(model: onnx.ModelProto, arrays=None) -> dict[str, str]:
    """``{name: reason}``: float initializers the default trainable set leaves out, the running statistics
    of BatchNormalization and the constants exporters store as initializers (see onnx_autodiff.parameters)."""
    out = {n: "batch-norm running statistic" for n in _running_stats(model.graph)}
    out.update(constant_initializers(model, arrays))
    return out


def select_trainable(model: onnx.ModelProto, trainable=None, frozen=None, outputs=None, arrays=None) -> list[str]:
    """The initializers to train: float initializers the outputs depend on, except batch-norm running
    statistics and exporter constants (``default_frozen``), or those matching ``trainable`` (names or
    glob patterns), minus ``frozen``. What is trained and what was left out by default, and why, goes
    to the ``onnx_autodiff`` logger (INFO)."""
    g = model.graph
    floats = [t.name for t in g.initializer if t.data_type in FLOAT_TYPES]
    outs = list(outputs) if outputs else [o.name for o in g.output]
    reach = _ancestors(g, outs)

    def match(patterns, field):
        if isinstance(patterns, str):
            patterns = [patterns]
        chosen = []
        for p in patterns:
            hit = [n for n in floats if fnmatch.fnmatchcase(n, p)]
            if not hit:
                shown = ", ".join(floats[:12]) + (", ..." if len(floats) > 12 else "")
                raise TrainingBuilderError(field, f"{p!r} matches no float initializer; the model has: {shown or 'none'}")
            chosen += [n for n in hit if n not in chosen]
        return chosen

    left_out: dict[str, str] = {}
    if trainable is None:
        skip = default_frozen(model, arrays)
        left_out = {n: r for n, r in skip.items() if n in reach and n in set(floats)}
        chosen = [n for n in floats if n in reach and n not in skip]
    else:
        chosen = match(trainable, "trainable")
        idle = [n for n in chosen if n not in reach]
        if idle:
            raise TrainingBuilderError("trainable", f"{idle} do not affect the output(s) {outs} the loss reads; "
                                                    "their gradient would be zero")
    if frozen is not None:
        off = set(match(frozen, "frozen"))
        chosen = [n for n in chosen if n not in off]
    if not chosen:
        raise TrainingBuilderError("trainable", "no initializer is left to train (the model has no float "
                                                "initializer the loss depends on, or all are frozen)")
    order = {n: k for k, n in enumerate(floats)}
    chosen = sorted(chosen, key=order.__getitem__)
    _log.info("training %d initializers: %s", len(chosen), describe(model, chosen))
    for reason in sorted(set(left_out.values())):
        names = [n for n, r in left_out.items() if r == reason]
        _log.info("frozen by default (%s): %s; name them in trainable= to train them", reason, describe(model, names))
    return chosen


# ---- optimizers ---------------------------------------------------------------------------------

def _optimizer_options(optimizer: str, options: dict | None) -> tuple[str, dict]:
    if not isinstance(optimizer, str) or _norm(optimizer) not in OPTIMIZERS:
        raise TrainingBuilderError("optimizer", f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    name = _norm(optimizer)
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
class _Param:
    name: str
    dtype: int
    dims: list[int]
    grad: str = ""
    new: str = ""


def _emit_optimizer(b: _Graph, name: str, opts: dict, params: list[_Param], lr: str, t: str,
                    states: list[tuple[str, _Param, str]]) -> None:
    """Append the update nodes; set ``p.new`` and record (state name, param, new value) in ``states``."""
    def state(p: _Param, suffix: str) -> str:
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


# ---- the builder --------------------------------------------------------------------------------

def _opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    return 1


def _as_mapping(value, outputs: list[str], default, field: str) -> dict:
    if isinstance(value, dict):
        unknown = [k for k in value if k not in outputs]
        if unknown:
            raise TrainingBuilderError(field, f"keys {unknown} are not among the loss outputs {outputs}")
        return {o: value.get(o, default(o)) for o in outputs}
    if value is None:
        return {o: default(o) for o in outputs}
    if len(outputs) > 1 and field == "label":
        raise TrainingBuilderError(field, f"several outputs {outputs} need one label each: pass a dict")
    return {o: value for o in outputs}



def _untyped_output(graph, name: str, info) -> str:
    """Why the loss cannot go on ``name`` (no known type, or not floating point) and what to do."""
    if info is not None and info.elem_type:
        kind = onnx.TensorProto.DataType.Name(info.elem_type)
        return f"{name!r} is a {kind} tensor; a loss needs a floating-point output (pick it with outputs=...)"
    node = next((n for n in graph.node if name in n.output), None)
    fix = (f"declare its type in graph.value_info or graph.output, e.g. "
           f"helper.make_tensor_value_info({name!r}, TensorProto.FLOAT, shape)")
    if node is None:
        return f"{name!r} has no known type; {fix}"
    domain = node.domain or "ai.onnx"
    return (f"{name!r} has no known type: it is output {list(node.output).index(name)} of node {node.name!r} "
            f"(op {node.op_type!r}, domain {domain!r}), whose output type onnx shape inference cannot infer "
            f"(a custom-domain op has no schema); {fix}")


def make_training_model(
    inference_model: onnx.ModelProto,
    loss="cross_entropy",
    optimizer: str = "adam",
    *,
    lr: float = 1e-3,
    optimizer_options: dict | None = None,
    trainable=None,
    frozen=None,
    outputs=None,
    label=None,
    label_shape=None,
    loss_weights: dict | None = None,
    check: bool = True,
    untie: bool = True,
    weights: dict | None = None,
) -> onnx.ModelProto:
    """The inference model plus a TrainingInfoProto that trains it (see the module docstring).

    ``loss``: a name (``cross_entropy``, ``nll``, ``mse``, ``l1``, ``bce``, ``bce_with_logits``), a
    GraphProto (inputs: model output, label; output: a scalar), or a dict ``{output: loss}`` for a
    weighted sum over several outputs (weights in ``loss_weights``, default 1). ``outputs``: the
    output(s) the loss reads when ``loss`` is not a dict (default: the first graph output).
    ``label``: the label input's name (default ``labels``; ``<output>_labels`` for several outputs),
    or a dict per output. ``label_shape``: the label shape the data will have, checked against the
    loss. ``optimizer``: ``sgd``, ``momentum``, ``nesterov``, ``adagrad``, ``adam`` or ``adamw`` with
    torch's defaults, overridden by ``optimizer_options``. ``lr``: the learning rate a driver feeds
    when told nothing else (recorded in ``metadata_props``; ``learning_rate`` is an input whose default is ``lr``; feed it to schedule). ``trainable`` / ``frozen``: names or glob patterns of initializers.
    With ``check`` the result is lowered once, so an op without a gradient rule fails here
    (``UnsupportedOperatorError``) and not at the first step. With ``untie`` every Identity alias of an
    initializer (the TorchScript exporter's merging of parameters that were equal at export) becomes an
    initializer of its own, so they train apart; ``untie=False`` keeps them tied.

    The weights are never copied into another protobuf message while building. ``weights``: for a
    light model (``onnx_autodiff.weights``), the dict of its arrays; the optimizer state is added to
    it and a light model is returned (``onnx_autodiff.io.save_model_atomic(model, path, weights=...)``
    writes it). Without it the result holds every tensor inline, optimizer state included.
    """
    if not isinstance(inference_model, onnx.ModelProto):
        raise TrainingBuilderError("inference_model", f"expected an onnx.ModelProto, got {type(inference_model).__name__}")
    if len(inference_model.training_info):
        raise TrainingBuilderError("inference_model", "the model already has training_info; start from the "
                                                      "inference model (onnx-autodiff export gives one)")
    opt_name, opts = _optimizer_options(optimizer, optimizer_options)
    if not np.isfinite(lr) or lr < 0:
        raise TrainingBuilderError("lr", f"the learning rate must be a finite number >= 0, got {lr}")
    inference_model, found = split_model(inference_model)  # a light copy: building never touches the bytes
    if untie:
        pairs = untie_aliases(inference_model)
        for alias, source in pairs:  # the alias starts from the same values (the arrays are read-only)
            for store in (found, weights):
                if store is not None and source in store:
                    store[alias] = store[source]
        if pairs:
            _log.info("untied %d Identity aliases of initializers (each trains on its own; untie=False keeps "
                      "them tied): %s", len(pairs), ", ".join(f"{a} <- {b}" for a, b in pairs))
    g = inference_model.graph
    infos = _value_infos(inference_model)
    graph_outputs = [o.name for o in g.output]
    if isinstance(loss, dict):
        out_names = list(loss)
    elif outputs is not None:
        out_names = [outputs] if isinstance(outputs, str) else list(outputs)
    else:
        out_names = graph_outputs[:1]
    if not out_names:
        raise TrainingBuilderError("outputs", "the model has no graph output to put a loss on")
    defined = {o for n in g.node for o in n.output if o} | {i.name for i in g.input}
    for o in out_names:
        if o not in defined:
            raise TrainingBuilderError("outputs", f"{o!r} is not a tensor of the inference graph; graph outputs: {graph_outputs}")
        if o not in infos or infos[o].elem_type not in FLOAT_TYPES:
            raise TrainingBuilderError("outputs", _untyped_output(g, o, infos.get(o)))
    losses = _as_mapping(loss, out_names, lambda o: loss, "loss")
    labels = _as_mapping(label, out_names, lambda o: "labels" if len(out_names) == 1 else f"{o}_labels", "label")
    shapes = _as_mapping(label_shape, out_names, lambda o: None, "label_shape") if label_shape is not None else {}
    if isinstance(label_shape, (list, tuple)) and len(out_names) == 1:
        shapes = {out_names[0]: list(label_shape)}
    term_weights = _as_mapping(loss_weights, out_names, lambda o: 1.0, "loss_weights")
    if len(set(labels.values())) != len(labels):
        raise TrainingBuilderError("label", f"each output needs its own label input, got {labels}")

    taken = used_names(inference_model)
    for o, lab in labels.items():
        if lab in taken:
            raise TrainingBuilderError("label", f"{lab!r} is already a name in the inference graph; pick another label name")
    trainable_names = select_trainable(inference_model, trainable, frozen, out_names, {**(weights or {}), **found})

    alg = _Graph(taken, "train")
    for lab in labels.values():
        taken.add(lab)
    lr_name = LEARNING_RATE if LEARNING_RATE not in taken else alg.name(LEARNING_RATE)
    taken.add(lr_name)
    opset = _opset(inference_model)
    terms = []
    for o in out_names:
        field = f"loss[{o!r}]" if isinstance(loss, dict) else "loss"
        kind = _loss_kind(losses[o], field)
        y = infos[o]
        if isinstance(kind, onnx.GraphProto):
            term, label_vi = _graph_loss(alg, kind, y, labels[o], field)
            lab_dims = _dims_of(label_vi)
        else:
            lab_type, lab_dims = _label_info(kind, y, field, opset)
            term = _builtin_loss(alg, kind, o, labels[o], y.elem_type)
            label_vi = helper.make_tensor_value_info(labels[o], lab_type, lab_dims)
        if o in shapes and shapes[o] is not None and not _compatible(list(shapes[o]), lab_dims):
            raise TrainingBuilderError("label_shape", f"the label of {o!r} has shape {list(shapes[o])}, but "
                                                      f"the loss needs {_Value('', 0, lab_dims).shape_text()}")
        alg.inputs.append(label_vi)
        w = float(term_weights[o])
        if len(out_names) > 1 or w != 1.0:
            term = alg.op("Mul", [term, alg.const(w, y.elem_type, f"weight_{o}")], f"weighted_{o}")
        terms.append(term)
    loss_dtype = infos[out_names[0]].elem_type
    if len({infos[o].elem_type for o in out_names}) > 1:
        terms = [alg.op("Cast", [t], "loss_cast", to=loss_dtype) for t in terms]
    loss_name = "loss" if "loss" not in taken else alg.name("loss")
    taken.add(loss_name)
    alg.op("Sum" if len(terms) > 1 else "Identity", terms, "loss", outputs=[loss_name])

    lr_vi = helper.make_tensor_value_info(lr_name, TensorProto.FLOAT, [])
    alg.inputs.append(lr_vi)
    alg.inits.append(numpy_helper.from_array(np.array(lr, np.float32), lr_name))  # the default; feed to override
    counter = alg.name("iteration")
    alg.inits.append(numpy_helper.from_array(np.array(0, np.int64), counter))

    inits = {t.name: t for t in g.initializer}
    params = [_Param(n, inits[n].data_type, list(inits[n].dims)) for n in trainable_names]
    for p in params:
        p.grad = alg.name(f"{p.name}_grad")
    alg.op("Gradient", [p.name for p in params], "gradient", domain=PREVIEW, outputs=[p.grad for p in params],
           xs=[p.name for p in params], y=loss_name)
    states: list[tuple[str, _Param, str]] = []
    _emit_optimizer(alg, opt_name, opts, params, lr_name, counter, states)
    counter_new = alg.op("Add", [counter, alg.const(1, TensorProto.INT64, "one")], "iteration.new")

    alg.outputs.append(helper.make_tensor_value_info(loss_name, loss_dtype, []))
    for p in params:
        alg.outputs.append(helper.make_tensor_value_info(p.new, p.dtype, p.dims))
    for s, p, s_new in states:
        alg.outputs.append(helper.make_tensor_value_info(s_new, p.dtype, p.dims))
    alg.outputs.append(helper.make_tensor_value_info(counter_new, TensorProto.INT64, []))
    update = [(p.name, p.new) for p in params] + [(s, s_new) for s, _, s_new in states] + [(counter, counter_new)]

    init = _Graph(taken, "init")
    init_binding = []
    for s, p, _ in states:
        shape = init.const(np.array(p.dims, np.int64), TensorProto.INT64, f"{s}/shape")
        zero = helper.make_tensor("value", p.dtype, [1], [0])
        out = init.op("ConstantOfShape", [shape], f"{s}.zeros", value=zero)
        init.outputs.append(helper.make_tensor_value_info(out, p.dtype, p.dims))
        init_binding.append((s, out))
    t0 = init.op("Constant", [], "iteration.zero", value=numpy_helper.from_array(np.array(0, np.int64)))
    init.outputs.append(helper.make_tensor_value_info(t0, TensorProto.INT64, []))
    init_binding.append((counter, t0))

    algorithm = helper.make_graph(alg.nodes, f"{g.name or 'model'}_training", alg.inputs, alg.outputs, alg.inits)
    initialization = helper.make_graph(init.nodes, f"{g.name or 'model'}_initialization", [], init.outputs, init.inits)
    model = inference_model
    model.ir_version = max(model.ir_version, 7)
    if not any(o.domain == PREVIEW for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(PREVIEW, 1))
    model.training_info.append(helper.make_training_info(algorithm, update, initialization, init_binding))
    record = {
        "loss": loss_name, "outputs": out_names, "labels": [labels[o] for o in out_names],
        "learning_rate": lr_name, "lr": float(lr), "optimizer": opt_name,
        "optimizer_options": {k: list(v) if isinstance(v, tuple) else v for k, v in opts.items()},
        "trainable": trainable_names, "iteration": counter,
    }
    props = [p for p in model.metadata_props if p.key != BUILDER_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(props)
    model.metadata_props.append(onnx.StringStringEntryProto(key=BUILDER_KEY, value=json.dumps(record)))
    if check:
        from .lower import lower

        lower(model)
    if weights is not None:
        weights.update(alg.arrays)
        if found:
            attach_weights(model, found)  # what was inline in the model given stays inline
    else:
        attach_weights(model, {**found, **alg.arrays})
    return model


def builder_record(model: onnx.ModelProto) -> dict | None:
    """What ``make_training_model`` recorded (loss, labels, learning-rate input, ...), or None."""
    for p in model.metadata_props:
        if p.key == BUILDER_KEY:
            return json.loads(p.value)
    return None


__all__ = ["make_training_model", "select_trainable", "builder_record", "TrainingBuilderError",
           "LOSSES", "OPTIMIZERS", "LEARNING_RATE"]
