"""Static shapes for tensors onnx's shape inference leaves open, from the integer shape arithmetic.

Exporters compute reshape targets at run time (``Shape -> Slice -> Mod -> Concat -> Reshape``, as
torch's ``unflatten`` does). When the shapes the arithmetic starts from are static, its value is
known, but onnx's data propagation stops at ops it does not model (Mod, Where, ...), and every tensor
after the Reshape loses its shape, so rules that need a rank fail. ``static_value_info`` evaluates that
integer arithmetic (small int tensors only, one node at a time with ``onnx.reference``), puts the
values in a copy of the graph as initializers, runs inference again and returns the shapes it gained
as value_info. ``lower`` adds them for the lowering and removes them afterwards: nodes never change.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from ..errors import TrainingSpecError

_INTS = {TensorProto.INT64, TensorProto.INT32}
_SMALL = 64  # elements: shape vectors, axes, indices
_ARITH = {"Add", "Sub", "Mul", "Div", "Mod", "Neg", "Abs", "Slice", "Concat", "Gather", "Unsqueeze", "Squeeze",
          "Reshape", "Cast", "Equal", "Where", "Range", "ConstantOfShape", "Expand", "Min", "Max", "Identity",
          "ReduceProd", "Less", "Greater", "Not", "Floor", "Ceil", "Sqrt", "Constant"}


def _static(vi: onnx.ValueInfoProto) -> tuple | None:
    tt = vi.type.tensor_type
    if not tt.HasField("shape") or any(not d.HasField("dim_value") for d in tt.shape.dim):
        return None
    return tuple(d.dim_value for d in tt.shape.dim)


def _types_only(graph: onnx.GraphProto) -> onnx.GraphProto:
    """The graph with large initializers turned into typed inputs: inference needs no weights."""
    g = onnx.GraphProto()
    g.CopyFrom(graph)
    del g.initializer[:]
    inputs = {i.name for i in graph.input}
    for t in graph.initializer:
        if t.data_type in _INTS and np.prod(t.dims) <= _SMALL:
            g.initializer.append(t)
        elif t.name not in inputs:
            g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return g


def _infer(model: onnx.ModelProto, graph: onnx.GraphProto) -> dict[str, onnx.ValueInfoProto]:
    m = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    m.functions.extend(model.functions)
    try:
        g = onnx.shape_inference.infer_shapes(m, data_prop=True).graph
    except Exception:
        return {}
    return {vi.name: vi for vi in list(g.input) + list(g.value_info) + list(g.output)}


def _eval_node(node: onnx.NodeProto, values: dict, opsets) -> list | None:
    try:
        inputs = [numpy_helper.from_array(np.asarray(values[i]), i) for i in node.input if i]
        g = helper.make_graph([node], "n", [], [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None)
                                               for o in node.output if o], inputs)
        m = helper.make_model(g, opset_imports=opsets)
        return ReferenceEvaluator(m).run(None, {})
    except Exception:
        return None


def _known_values(graph: onnx.GraphProto, infos: dict, opsets) -> dict[str, np.ndarray]:
    """Values of the small integer tensors that follow from static shapes and constants."""
    values = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type in ("Shape", "Size"):
            vi = infos.get(node.input[0])
            shape = _static(vi) if vi is not None else None
            if shape is None:
                continue
            if node.op_type == "Size":
                values[node.output[0]] = np.array(int(np.prod(shape)), np.int64)
                continue
            attrs = {a.name: a.i for a in node.attribute}
            start, end = attrs.get("start", 0), attrs.get("end", len(shape))
            values[node.output[0]] = np.array(shape[start:end], np.int64)
        elif node.op_type in _ARITH and all(i in values for i in node.input if i):
            outs = [infos.get(o) for o in node.output]
            if node.op_type != "Constant" and any(vi is None or vi.type.tensor_type.elem_type not in _INTS | {
                    TensorProto.BOOL} for vi in outs):
                continue
            result = _eval_node(node, values, opsets)
            if result is None:
                continue
            for o, v in zip(node.output, result):
                if np.asarray(v).size <= _SMALL:
                    values[o] = np.asarray(v)
    return values


def _may_fold(graph: onnx.GraphProto) -> bool:
    """Whether ``_known_values`` could give any node output a value: a Shape or Size node (its input taken as
    static), or shape arithmetic on the initializers alone. False means it finds none, whatever inference says."""
    known = {t.name for t in graph.initializer}
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type in ("Shape", "Size") or (node.op_type in _ARITH and all(i in known for i in node.input if i)):
            return True
    return False


def symbolic_dims(model: onnx.ModelProto) -> set[str]:
    """The names of the symbolic dims of the inputs and outputs of ``model``'s top graphs."""
    out = set()
    for g in [model.graph] + [ti.algorithm for ti in model.training_info]:
        for vi in list(g.input) + list(g.output):
            out.update(d.dim_param for d in vi.type.tensor_type.shape.dim if d.dim_param)
    return out


def fix_dims(model: onnx.ModelProto, dims: Mapping[str, int]) -> onnx.ModelProto:
    """A copy of ``model`` whose symbolic dims named in ``dims`` have those sizes in every input, output and
    value_info of its top graphs (the inference graph and each training algorithm): the lowering then emits
    the static forms of everything those dims size (no ``Shape``/``Size`` arithmetic at run time), and a
    runtime that runs shape arithmetic elsewhere (WebGPU: on the CPU) gets none."""
    have = symbolic_dims(model)
    unknown = sorted(set(dims) - have)
    if unknown:
        raise TrainingSpecError(f"dims {unknown} are not symbolic dims of the model's inputs and outputs; it has "
                                f"{sorted(have) or 'none'}", hint="name the dims the model declares, e.g. N=32")
    bad = {k: v for k, v in dims.items() if not isinstance(v, (int, np.integer)) or v < 1}
    if bad:
        raise TrainingSpecError(f"dims {bad}: each size must be a positive integer")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for g in [out.graph] + [ti.algorithm for ti in out.training_info]:
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            for d in vi.type.tensor_type.shape.dim:
                if d.dim_param in dims:
                    d.dim_value = int(dims[d.dim_param])
    return out


def shape_arithmetic_values(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The values of the node outputs of ``model.graph`` that are small integer (or boolean) tensors the
    static shapes and constants determine: what ``Shape``/``Size`` of a static tensor and the arithmetic
    after them compute (inference runs once; weights are not read). An input's initializer is a default,
    not a constant (a step counter): it is not folded in."""
    graph = _types_only(model.graph)
    inputs = {i.name for i in graph.input}
    defaults = [t for t in graph.initializer if t.name in inputs]
    if defaults:
        kept = [t for t in graph.initializer if t.name not in inputs]
        del graph.initializer[:]
        graph.initializer.extend(kept)
    values = _known_values(graph, _infer(model, graph), list(model.opset_import))
    made = {o for n in graph.node for o in n.output if o}
    return {k: v for k, v in values.items() if k in made}


def static_value_info(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """value_info for node outputs whose static shape inference cannot tell but the shape arithmetic
    does (empty when inference already knows every shape or the inputs are not static)."""
    graph = _types_only(model.graph)
    if not _may_fold(graph):
        return []  # no node could get a value (most graphs without shape arithmetic): no inference to run
    infos = _infer(model, graph)
    produced = [o for n in graph.node for o in n.output if o]
    open_ = [o for o in produced if o not in infos or _static(infos[o]) is None]
    if not open_:
        return []
    opsets = list(model.opset_import)
    gained: dict[str, onnx.ValueInfoProto] = {}
    made = set(produced)
    folded_before: set[str] = set()
    for _ in range(4):
        values = _known_values(graph, {**infos, **gained}, opsets)
        computed = {k for k in values if k in made}
        if computed == folded_before:
            break  # nothing new to fold in: inference would tell what it told before
        folded_before = computed
        folded = onnx.GraphProto()
        folded.CopyFrom(graph)
        keep = [n for n in graph.node if not (n.output and all(o in computed for o in n.output if o))]
        del folded.node[:]
        folded.node.extend(keep)
        folded.initializer.extend(numpy_helper.from_array(np.asarray(values[k]), k) for k in computed)
        new = _infer(model, folded)
        before = len(gained)
        for o in open_:
            vi = new.get(o)
            if o not in gained and vi is not None and _static(vi) is not None:
                gained[o] = vi
        if len(gained) == before:
            break
    return list(gained.values())


@contextmanager
def shape_hints(model: onnx.ModelProto) -> Iterator[None]:
    """``static_value_info`` in ``model.graph.value_info`` while the block runs, removed again after it:
    the passes see the shapes, the result declares nothing the user's model did not."""
    hints = static_value_info(model)
    model.graph.value_info.extend(hints)
    try:
        yield
    finally:
        if hints:
            hinted = {vi.name for vi in hints}
            kept = [vi for vi in model.graph.value_info if vi.name not in hinted]
            del model.graph.value_info[:]
            model.graph.value_info.extend(kept)
