"""The losses ``make_training_model`` and ``ForwardBackwardTrainer`` put on a model output."""
from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import TensorProto

from ..errors import TrainingBuilderError
from .nodes import NodeBuilder, normalize_name

LOSSES = ("cross_entropy", "nll", "mse", "l1", "bce", "bce_with_logits")
LOSS_ALIASES = {
    "ce": "cross_entropy", "crossentropy": "cross_entropy", "softmax_cross_entropy": "cross_entropy",
    "xent": "cross_entropy", "negative_log_likelihood": "nll", "l2": "mse", "mae": "l1",
    "binary_cross_entropy": "bce", "bce_logits": "bce_with_logits",
    "binary_cross_entropy_with_logits": "bce_with_logits",
}


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


def loss_kind(spec, field: str):
    if isinstance(spec, onnx.GraphProto):
        return spec
    if isinstance(spec, onnx.ModelProto):
        return spec.graph
    if not isinstance(spec, str):
        raise TrainingBuilderError(field, f"a loss is a name or an onnx.GraphProto, got {type(spec).__name__}")
    kind = normalize_name(spec)
    kind = LOSS_ALIASES.get(kind, kind)
    if kind not in LOSSES:
        raise TrainingBuilderError(field, f"unknown loss {spec!r}; choose one of {', '.join(LOSSES)}, or pass a "
                                          "GraphProto (inputs: model output, label; output: a scalar)")
    return kind


def label_info(kind, y: Value, field: str, opset: int) -> tuple[int, list | None]:
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


def builtin_loss(b: NodeBuilder, kind: str, y: str, label: str, dtype: int) -> str:
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


def graph_loss(b: NodeBuilder, graph: onnx.GraphProto, y: Value, label: str, field: str) -> tuple[str, onnx.ValueInfoProto]:
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

