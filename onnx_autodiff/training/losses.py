"""The losses ``make_training_model`` and ``ForwardBackwardTrainer`` put on a model output."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import onnx
from onnx import TensorProto

from ..errors import TrainingBuilderError
from .nodes import GraphBuilder, normalize_name

_log = logging.getLogger("onnx_autodiff")


@dataclass
class Value:
    name: str
    elem_type: int
    dims: list | None  # int, str (symbolic) or None (unknown) per axis; None for an unknown rank

    def shape_text(self) -> str:
        if self.dims is None:
            return "unknown"
        return "[" + ", ".join("?" if d is None else str(d) for d in self.dims) + "]"


def dims_of(vi: onnx.ValueInfoProto) -> list | None:
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]


def value_infos(model: onnx.ModelProto) -> dict[str, Value]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # best effort; declared types still count
        inferred = model
    out: dict[str, Value] = {}
    g = inferred.graph
    for vi in list(g.value_info) + list(model.graph.output) + list(g.output) + list(g.input):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            out[vi.name] = Value(vi.name, vi.type.tensor_type.elem_type, dims_of(vi))
    return out


def compatible(a: list | None, b: list | None) -> bool:
    if a is None or b is None:
        return True
    if len(a) != len(b):
        return False
    return all(x == y or x is None or y is None or isinstance(x, str) or isinstance(y, str) for x, y in zip(a, b))


IGNORE_INDEX = -100  # torch's and transformers' default ignore_index


def _cross_entropy(b: GraphBuilder, y: str, label: str, dtype: int, axis=None) -> str:
    """SoftmaxCrossEntropyLoss, whose classes are axis 1; ``axis=-1`` (or the last axis) flattens the
    scores to [N * ..., C] and the labels to [N * ...] instead (the same mean). Its log_prob output is kept
    for the gradient to read."""
    g = b.under("cross_entropy")
    if axis is not None and axis not in (1,):
        y = g.Flatten(y, axis=-1)
        label = g.Reshape(label, g.initializer([-1], TensorProto.INT64, "flat"))
    return g.SoftmaxCrossEntropyLoss(y, label, outputs=2, reduction="mean")[0]


def _causal_lm(b: GraphBuilder, y: str, label: str, dtype: int, mask=None) -> str:
    """transformers' causal-LM loss: the logits at position t [B, S, V] score the label at t + 1; labels equal
    to -100 (and, with ``mask``, positions where that input is 0) do not count; the mean over counted tokens.
    The labels are shifted (a Slice and a Pad of -100), not the logits, so the [B, S, V] tensor is not copied.
    The loss keeps its log_prob output (as ``_cross_entropy`` does): the gradient reads it rather than computing
    log-softmax again, one vocabulary-sized tensor fewer."""
    g, i64 = b.under("causal_lm"), TensorProto.INT64
    ignore = g.initializer(IGNORE_INDEX, i64, "ignore_index")
    if mask:
        label = g.Where(g.Cast(mask, to=TensorProto.BOOL), label, ignore)
    nxt = g.Slice(label, g.initializer([1], i64, "start"), g.initializer([2**62], i64, "end"),
                  g.initializer([1], i64, "axis"))
    shifted = g.Pad(nxt, g.initializer([0, 0, 0, 1], i64, "pads"), ignore)
    flat = g.Reshape(shifted, g.initializer([-1], i64, "flat"))
    return g.SoftmaxCrossEntropyLoss(g.Flatten(y, axis=2), flat, outputs=2, reduction="mean",
                                     ignore_index=IGNORE_INDEX)[0]


def _nll(b: GraphBuilder, y: str, label: str, dtype: int) -> str:
    return b.under("nll").NegativeLogLikelihoodLoss(y, label, reduction="mean")


def _mse(b: GraphBuilder, y: str, label: str, dtype: int) -> str:
    g = b.under("mse")
    d = g.Sub(y, label)
    return g.ReduceMean(g.Mul(d, d), keepdims=0)


def _l1(b: GraphBuilder, y: str, label: str, dtype: int) -> str:
    g = b.under("l1")
    return g.ReduceMean(g.Abs(g.Sub(y, label)), keepdims=0)


def _elastic(b: GraphBuilder, y: str, label: str, dtype: int, l1: float, l2: float) -> str:
    g = b.under("elastic")
    d = g.Sub(y, label)
    l1_term = g.Mul(g.initializer(l1, dtype, "l1"), g.Abs(d))
    l2_term = g.Mul(g.initializer(l2, dtype, "l2"), g.Mul(d, d))
    return g.ReduceMean(g.Add(l1_term, l2_term), keepdims=0)


def _bce(b: GraphBuilder, y: str, label: str, dtype: int) -> str:
    """torch.nn.BCELoss: the logs are clamped at -100."""
    g = b.under("bce")
    one, floor = g.initializer(1.0, dtype, "one"), g.initializer(-100.0, dtype, "floor")
    log_p = g.Max(g.Log(y), floor)
    log_q = g.Max(g.Log(g.Sub(one, y)), floor)
    t_log_p = g.Mul(label, log_p)
    rest = g.Mul(g.Sub(one, label), log_q)
    return g.Neg(g.ReduceMean(g.Add(t_log_p, rest), keepdims=0))


def _bce_with_logits(b: GraphBuilder, y: str, label: str, dtype: int) -> str:
    """softplus(x) - x t, whose derivative is sigmoid(x) - t (onnxruntime's Softplus is stable)."""
    g = b.under("bce_with_logits")
    return g.ReduceMean(g.Sub(g.Softplus(y), g.Mul(y, label)), keepdims=0)


@dataclass(frozen=True)
class Loss:
    """One loss: ``emit(g, y, label, dtype, **options)`` appends its nodes through ``g`` (a ``GraphBuilder``) and
    returns the scalar loss. ``label``: ``"class"`` (int64 class indices, shape [N, d...] for scores [N, C, d...]),
    ``"tokens"`` (int64 token ids [B, S] for logits [B, S, V]) or ``"like_output"`` (the output's type and shape)."""

    name: str
    emit: Callable[..., str]
    label: str = "like_output"
    aliases: tuple[str, ...] = ()
    options: dict = field(default_factory=dict)  # option -> default
    min_opset: int = 1
    torch: str = ""


LOSSES: dict[str, Loss] = {loss.name: loss for loss in (
    Loss("cross_entropy", _cross_entropy, "class", ("ce", "crossentropy", "softmax_cross_entropy", "xent"),
         options={"axis": None}, min_opset=12, torch="F.cross_entropy"),
    Loss("causal_lm", _causal_lm, "tokens", ("clm", "causal_lm_loss", "lm"), options={"mask": None},
         min_opset=13, torch="transformers ForCausalLMLoss"),
    Loss("nll", _nll, "class", ("negative_log_likelihood",), min_opset=12, torch="F.nll_loss"),
    Loss("mse", _mse, aliases=("l2",), torch="F.mse_loss"),
    Loss("l1", _l1, aliases=("mae",), torch="F.l1_loss"),
    Loss("bce", _bce, aliases=("binary_cross_entropy",), torch="F.binary_cross_entropy"),
    Loss("bce_with_logits", _bce_with_logits, aliases=("bce_logits", "binary_cross_entropy_with_logits"),
         torch="F.binary_cross_entropy_with_logits"),
    Loss("elastic", _elastic, options={"l1": 0.5, "l2": 0.5}),
)}
_ALIASES = {alias: loss.name for loss in LOSSES.values() for alias in loss.aliases}


def find_loss(name: str) -> Loss | None:
    """The table entry for a loss name or alias (any case, ``-`` or space for ``_``), or None."""
    key = normalize_name(name)
    return LOSSES.get(_ALIASES.get(key, key))


def loss_kind(spec, field: str):
    """A built-in loss's name, or the GraphProto of a user loss."""
    spec = getattr(spec, "graph", spec)  # a loss model's graph
    if isinstance(spec, onnx.GraphProto):
        return spec
    if not isinstance(spec, str):
        raise TrainingBuilderError(field, f"a loss is a name or an onnx.GraphProto, got {type(spec).__name__}")
    loss = find_loss(spec)
    if loss is None:
        import difflib

        close = difflib.get_close_matches(normalize_name(spec), [*LOSSES, *_ALIASES], n=1, cutoff=0.6)
        guess = f" (did you mean {_ALIASES.get(close[0], close[0])!r}?)" if close else ""
        raise TrainingBuilderError(field, f"unknown loss {spec!r}{guess}; choose one of {', '.join(LOSSES)} (or an "
                                          "alias of one: see make-training --help), or pass a GraphProto (inputs: "
                                          "model output, label; output: a scalar)")
    return loss.name


def label_info(kind: str, y: Value, field: str, opset: int, options: dict | None = None) -> tuple[int, list | None]:
    """(element type, dims) the label of a built-in loss must have."""
    loss = LOSSES[kind]
    options = {**loss.options, **(options or {})}
    if opset < loss.min_opset:
        raise TrainingBuilderError(field, f"{kind} needs opset >= {loss.min_opset} (SoftmaxCrossEntropyLoss / "
                                          f"NegativeLogLikelihoodLoss); the model imports opset {opset}. "
                                          "Convert it with onnx.version_converter first")
    if loss.label == "tokens":
        if y.dims is not None and len(y.dims) != 3:
            raise TrainingBuilderError(field, f"{kind} needs logits of shape [B, S, V]; output {y.name!r} has shape "
                                              f"{y.shape_text()}")
        return TensorProto.INT64, None if y.dims is None else list(y.dims[:2])
    if loss.label == "class":
        if y.dims is not None and len(y.dims) < 2:
            raise TrainingBuilderError(field, f"{kind} needs class scores of shape [N, C, ...]; output {y.name!r} "
                                              f"has shape {y.shape_text()}. Use mse/l1/bce for it, or a [N, C] output")
        return TensorProto.INT64, _class_label_dims(kind, y, field, options.get("axis"))
    return y.elem_type, None if y.dims is None else list(y.dims)


def _class_label_dims(kind: str, y: Value, field: str, axis) -> list | None:
    """The label dims of scores ``y`` whose classes are on ``axis`` (1 or the last); a rank-3 output needs
    the axis said: ONNX's loss reads [N, C, d] while a language model's logits are [B, S, V]."""
    rank = None if y.dims is None else len(y.dims)
    if axis is None:
        if rank == 3:
            raise TrainingBuilderError(field, f"{kind} on output {y.name!r} of shape {y.shape_text()}: say which "
                                              "axis holds the classes. For a language model's logits [B, S, V] use "
                                              "loss='causal_lm' (--loss causal_lm), or pass "
                                              "LossSpec(options={'axis': -1}) (classes last) or {'axis': 1} "
                                              "(ONNX's [N, C, d] layout)")
        axis = 1
    if axis != 1 and not (axis == -1 or (rank is not None and axis == rank - 1)):
        raise TrainingBuilderError(field, f"{kind}: the class axis is 1 or the last (-1), got {axis}")
    where = "1 (ONNX's [N, C, d...])" if axis == 1 else "-1 (the last)"
    _log.info("%s on %r of shape %s: the classes are on axis %s", kind, y.name, y.shape_text(), where)
    if y.dims is None:
        return None
    if axis == 1:
        return [y.dims[0]] + list(y.dims[2:])
    return list(y.dims[:-1])


def loss_options(kind: str, options: dict | None, field: str) -> dict:
    """The options of built-in loss ``kind``: its defaults overridden by ``options`` (unknown keys refused)."""
    loss = LOSSES[kind]
    unknown = sorted(set(options or {}) - set(loss.options))
    if unknown:
        have = ", ".join(loss.options) or "none"
        raise TrainingBuilderError(field, f"{kind} has no option {', '.join(map(repr, unknown))} (options: {have})")
    return {**loss.options, **(options or {})}


def builtin_loss(b: GraphBuilder, kind: str, y: str, label: str, dtype: int, **options) -> str:
    loss = LOSSES[kind]
    return loss.emit(b, y, label, dtype, **{**loss.options, **options})


def graph_loss(b: GraphBuilder, graph: onnx.GraphProto, y: Value, label: str,
               field: str) -> tuple[str, onnx.ValueInfoProto]:
    """Copy a user loss graph (inputs: model output, label; one scalar output) into the algorithm."""
    inits = {t.name for t in graph.initializer}
    real_inputs = [i for i in graph.input if i.name not in inits]
    if len(real_inputs) != 2 or len(graph.output) != 1:
        raise TrainingBuilderError(field, f"a loss graph takes 2 inputs (model output, label) and has 1 output; "
                                          f"{graph.name!r} has {len(real_inputs)} inputs and "
                                          f"{len(graph.output)} outputs")
    for n in graph.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            raise TrainingBuilderError(field, f"loss graph node {n.name or n.op_type!r} has a subgraph; "
                                              "loss graphs with control flow are not supported")
    y_in, t_in = real_inputs
    declared = dims_of(y_in) if y_in.type.HasField("tensor_type") else None
    if not compatible(declared, y.dims):
        raise TrainingBuilderError(field, f"loss graph input {y_in.name!r} has shape "
                                          f"{Value('', 0, declared).shape_text()} but output {y.name!r} has shape "
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

