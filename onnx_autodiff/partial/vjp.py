"""Split a model into a forward model and a backward model (a vector-Jacobian product).

This is what lets an ONNX graph be one layer of a bigger model trained elsewhere (PyTorch, a numpy
loop): the caller runs the forward, keeps what it returns, and later hands the backward one gradient
per output. See docs/partial_training.md for the contract.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import onnx
from onnx import helper, numpy_helper

from ..engine.reverse import differentiate, prepare_gradient_path
from ..errors import GradientSpecError
from ..graph import (
    FLOAT_TYPES,
    GraphView,
    TensorInfo,
    ancestors,
    finalize,
    float_parameters,
    infer_tensor_info,
    lift_initializers,
    name_nodes,
    node_inputs,
    set_nodes,
    topological_sort,
    used_names,
)

_SCOPE = "vjp"
# Ops whose output is a tensor's metadata: when the backward reads only the shape of a forward tensor,
# the forward computes the shape and saves that instead of the tensor.
_METADATA_OPS = {"Shape", "Size"}


class VjpModels:
    """The pair build_vjp returns; unpacks as ``forward, backward``.

    ``outputs``: the differentiated outputs, in order (forward outputs come first, then ``saved_outputs``).
    ``wrt``: the tensors the backward returns gradients for, in order (backward output k is ``wrt[k] + "_grad"``).
    ``saved_inputs``: forward inputs the backward reads (the caller passes them on unchanged).
    ``saved_outputs``: the forward outputs the backward reads (some may be among ``outputs``; the forward
    returns each name once).
    """

    def __init__(self, forward, backward, outputs, wrt, saved_inputs, saved_outputs):
        self.forward = forward
        self.backward = backward
        self.outputs = list(outputs)
        self.wrt = list(wrt)
        self.saved_inputs = list(saved_inputs)
        self.saved_outputs = list(saved_outputs)

    @property
    def saved(self) -> list[str]:
        """Every forward tensor the backward reads (its inputs before the output gradients)."""
        return self.saved_inputs + self.saved_outputs

    @property
    def grad_inputs(self) -> list[str]:
        return [grad_name(o) for o in self.outputs]

    @property
    def grad_outputs(self) -> list[str]:
        return [grad_name(x) for x in self.wrt]

    def __iter__(self) -> Iterator[onnx.ModelProto]:
        return iter((self.forward, self.backward))

    def __repr__(self):
        return (f"VjpModels(outputs={self.outputs}, wrt={self.wrt}, saved_inputs={self.saved_inputs}, "
                f"saved_outputs={self.saved_outputs})")


def grad_name(name: str) -> str:
    return f"{name}_grad"


def build_vjp(model, wrt: Sequence[str] | None = None, outputs: Sequence[str] | None = None,
              *, defaults: bool = True, check: bool = True) -> VjpModels:
    """Forward and backward models for the vector-Jacobian product of ``outputs`` w.r.t. ``wrt``.

    Forward: the model's inputs (initializers named in ``wrt`` become inputs too, their values kept as
    defaults) -> ``outputs``, then the saved tensors the backward reads. Backward: the saved tensors
    (forward inputs and forward outputs, under their own names), then ``<output>_grad`` per output ->
    ``<x>_grad`` per x in ``wrt``. No forward node is recomputed by the backward; initializers the
    backward reads are copied into it as initializers (those in ``wrt`` as defaults of its inputs).

    ``wrt`` defaults to every float graph input and float initializer; ``outputs`` to every float graph
    output. With ``defaults=False`` the initializers in ``wrt`` become plain forward inputs (no stored
    value: callers that always feed them save the copy). The input model is not modified.
    """
    base = onnx.ModelProto()
    base.CopyFrom(model)
    name_nodes(base)
    g = base.graph
    outputs, wrt = _checked_request(base, outputs, wrt)
    inits = {t.name: t for t in g.initializer}
    lift_initializers(base, {x for x in wrt if x in inits})
    if not defaults:
        kept = [t for t in g.initializer if t.name not in wrt]
        del g.initializer[:]
        g.initializer.extend(kept)
        inits = {t.name: t for t in g.initializer}
    view, backward_graph = _backward(base, outputs, wrt)

    forward_nodes = list(view.nodes)
    forward_produced = {o for n in forward_nodes for o in n.output if o}
    moved = _move_metadata_reads(backward_graph, forward_produced | set(view.graph_inputs))
    forward_nodes.extend(moved)
    forward_produced.update(o for n in moved for o in n.output if o)
    saved_inputs, saved_outputs, constants = _saved(backward_graph, outputs, view, inits, forward_produced)

    if moved:
        _infer_moved(base, view, forward_nodes, moved)
    forward = _forward_model(base, view, forward_nodes, outputs, saved_outputs)
    backward = _backward_model(base, view, backward_graph, saved_inputs + saved_outputs, outputs, constants)
    if check:
        onnx.checker.check_model(forward, full_check=True)
        onnx.checker.check_model(backward, full_check=True)
    return VjpModels(forward, backward, outputs, wrt, saved_inputs, saved_outputs)


def _checked_request(base: onnx.ModelProto, outputs, wrt) -> tuple[list[str], list[str]]:
    """``outputs`` and ``wrt`` with their defaults filled in; GradientSpecError naming what is wrong."""
    g = base.graph
    float_inputs, float_inits = float_parameters(base)
    graph_outputs = [o.name for o in g.output]
    if outputs is None:
        outputs = [o.name for o in g.output if o.type.tensor_type.elem_type in FLOAT_TYPES]
    outputs = list(outputs)
    if not outputs:
        raise GradientSpecError("the model has no floating-point output to differentiate; pass outputs=...")
    for o in outputs:
        if o not in graph_outputs:
            raise GradientSpecError(f"outputs names {o!r}, which is not a graph output; graph outputs: {graph_outputs}")
    wrt = list(float_inputs + float_inits) if wrt is None else list(wrt)
    allowed = set(float_inputs) | set(float_inits)
    for x in wrt:
        if x not in allowed:
            raise GradientSpecError(
                f"wrt names {x!r}, which is not a floating-point graph input or initializer of the model"
            )
    for field, names in (("outputs", outputs), ("wrt", wrt)):
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise GradientSpecError(f"{field} lists {dup} more than once")
    return outputs, wrt


def _backward(base: onnx.ModelProto, outputs: list[str], wrt: list[str]) -> tuple[GraphView, onnx.GraphProto]:
    """The forward's view (function bodies expanded, Dropout masks exposed) and the backward graph:
    ``<output>_grad`` seeds -> ``<x>_grad``."""
    taken = used_names(base)
    view = prepare_gradient_path(base, wrt, [], outputs, taken)  # function bodies, Dropout masks
    new_names = [grad_name(n) for n in outputs + wrt]
    clash = sorted(set(new_names) & taken) + sorted({n for n in new_names if new_names.count(n) > 1})
    if clash:
        raise GradientSpecError(
            f"the gradient names {clash} are already used in the model (or by both an output and an x); "
            "rename those tensors before building the vjp"
        )
    taken.update(new_names)
    for o in outputs:
        view.info[grad_name(o)] = TensorInfo(view.dtype(o), view.shape(o))
    nodes = differentiate(view, outputs, wrt, [grad_name(x) for x in wrt], taken=taken, scope=_SCOPE,
                          where="build_vjp", seeds=[grad_name(o) for o in outputs])
    graph = helper.make_graph(topological_sort(nodes), "backward", [], [
        _value_info(grad_name(x), view, like=x) for x in wrt])
    return view, graph


def _saved(backward_graph: onnx.GraphProto, outputs: list[str], view: GraphView, inits: dict,
           forward_produced: set[str]) -> tuple[list[str], list[str], list[onnx.TensorProto]]:
    """What the backward reads from outside itself: forward inputs, forward outputs, and the
    initializers it keeps as constants."""
    grad_inputs = {grad_name(o) for o in outputs}
    produced = {o for n in backward_graph.node for o in n.output if o}
    read: list[str] = []
    for n in backward_graph.node:
        for i in node_inputs(n):
            if i not in produced and i not in read:
                read.append(i)
    saved_inputs, saved_outputs, constants = [], [], []
    for name in read:
        if name in grad_inputs:
            continue
        if name in view.graph_inputs:
            saved_inputs.append(name)
            if name in inits:  # a trained initializer keeping its default: the backward keeps it too
                constants.append(inits[name])
        elif name in forward_produced:
            saved_outputs.append(name)
        elif name in inits:
            constants.append(inits[name])
        else:
            raise GradientSpecError(f"the backward reads {name!r}, which nothing in the model defines; "
                                    "this is a bug in onnx-autodiff: please report it with the model")
    return saved_inputs, saved_outputs, constants


def inference_model(vjp: VjpModels, values: dict | None = None) -> onnx.ModelProto:
    """The forward model without its saved outputs (and the nodes only they needed).

    ``values`` (name -> numpy array) become initializers in place of the inputs of those names: the
    trained weights of a model whose forward took them as inputs.
    """
    values = dict(values or {})
    m = onnx.ModelProto()
    m.CopyFrom(vjp.forward)
    g = m.graph
    del g.output[len(vjp.outputs):]
    keep_inputs = [i for i in g.input if i.name not in values]
    del g.input[:]
    g.input.extend(keep_inputs)
    inits = [t for t in g.initializer if t.name not in values]
    inits += [numpy_helper.from_array(v, name) for name, v in values.items()]
    del g.initializer[:]
    g.initializer.extend(inits)
    set_nodes(g, ancestors(list(g.node), [o.name for o in g.output]))
    return m


def _move_metadata_reads(graph: onnx.GraphProto, forward_names: set[str]) -> list[onnx.NodeProto]:
    """Take Shape/Size nodes of forward tensors out of the backward (the forward runs them instead)."""
    moved, kept = [], []
    for n in graph.node:
        if n.op_type in _METADATA_OPS and (n.domain or "") == "" and n.input[0] in forward_names:
            moved.append(n)
        else:
            kept.append(n)
    if moved:
        del graph.node[:]
        graph.node.extend(kept)
    return moved


def _infer_moved(base, view: GraphView, nodes, moved) -> None:
    """Types and shapes of the moved nodes' outputs, by shape inference over the forward nodes."""
    g = base.graph
    probe = helper.make_graph(nodes, "probe", list(g.input), list(g.output), initializer=list(g.initializer))
    m = helper.make_model(probe, opset_imports=list(base.opset_import))
    m.ir_version = base.ir_version
    info = infer_tensor_info(m)
    for n in moved:
        for o in n.output:
            if o in info and info[o].shape is not None:
                view.info[o] = info[o]


def _value_info(name: str, view: GraphView, like: str | None = None) -> onnx.ValueInfoProto:
    info = view.info.get(like or name)
    if info is None or info.dtype is None or info.shape is None:
        raise GradientSpecError(
            f"the element type or rank of {name!r} is unknown, so it cannot cross between the forward and "
            "the backward model; annotate it in the model's value_info or outputs"
        )
    return helper.make_tensor_value_info(name, info.dtype, None if info.shape is None else list(info.shape))


def _forward_model(base, view, nodes, outputs, saved_outputs) -> onnx.ModelProto:
    g = base.graph
    declared = {o.name: o for o in g.output}
    wanted = list(outputs) + [s for s in saved_outputs if s not in outputs]
    graph = helper.make_graph(
        topological_sort(ancestors(nodes, wanted)), f"{g.name or 'model'}_forward",
        list(g.input), [declared[o] for o in outputs] + [_value_info(s, view) for s in wanted[len(outputs):]],
        initializer=list(g.initializer),
    )
    return _model_like(base, graph, functions=True)


def _backward_model(base, view, graph, saved, outputs, constants) -> onnx.ModelProto:
    graph.name = f"{base.graph.name or 'model'}_backward"
    graph.input.extend([_value_info(s, view) for s in saved]
                       + [_value_info(grad_name(o), view, like=o) for o in outputs])
    graph.initializer.extend(constants)
    return _model_like(base, graph, functions=False)


def _model_like(base: onnx.ModelProto, graph: onnx.GraphProto, functions: bool) -> onnx.ModelProto:
    m = helper.make_model(graph, opset_imports=list(base.opset_import))
    m.ir_version = base.ir_version
    m.producer_name = "onnx-autodiff"
    if functions:
        m.functions.extend(base.functions)
    finalize(m)
    return m


__all__ = ["build_vjp", "VjpModels", "grad_name", "inference_model"]
