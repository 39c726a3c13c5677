"""Differentiating a subgraph (an If branch, a Loop or Scan body): engine code beside the reverse walk.

The backward of a body is the reverse walk (``reverse.backprop``) run over a copy of the body with a fresh
emitter, inside a new subgraph (or, for
an If on a constant condition, inlined into the outer graph). Tensors a body reads from the outer scope
get gradients too: the control-flow rules (gradient_rules/control.py) route them through ``wanted_outer``
and ``with_outer``. The rules keep the maths of each op (tape, reverse sweep, branch choice); the
protobuf work of building bodies lives here.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import GradientRuleError
from ..graph import (
    GraphView,
    TensorInfo,
    infer_tensor_info,
    info_from_type,
    normalize_domain,
    outer_names,
    rename_outer_reads,
    subgraphs,
)
from .builder import Emitter, GradBuilder, NodeView
from .cleanup import cleanup_nodes
from .forward import small
from .function_ops import expand_function_nodes, expandable, without_subgraphs
from .reverse import backprop

Seeds = list[tuple[str, onnx.ValueInfoProto]]  # (body output, value info of the tensor holding its gradient)


def wanted_outer(node: NodeView, *bodies: onnx.GraphProto) -> list[tuple[int, str]]:
    """(gradient index, name) of each outer-scope tensor the bodies read that needs a gradient.

    A tensor that is also one of the node's own inputs keeps that input's index (the engine lists it
    once), so the rule adds the outer-read gradient to the input's own one; a tensor that fills several
    inputs (a Scan's initial state and its sequence) gets it at the first of them only, once.
    """
    reads = {n for b in bodies for n in outer_names(b)}
    n_in = len(node.inputs)
    out = [(n_in + k, name) for k, name in enumerate(node.outer_inputs)
           if name in reads and node.needs_grad(n_in + k)]
    seen = set()
    for i, name in enumerate(node.inputs):
        if name and name in reads and name not in seen and node.needs_grad(i):
            seen.add(name)
            out.append((i, name))
    return out


def with_outer(g: GradBuilder, grads: list, wanted: list[tuple[int, str]], outer_grads: list[str]) -> list:
    """``grads`` (one per node input) extended by the outer-scope gradients at their indices."""
    out = list(grads) + [None] * (1 + max((i for i, _ in wanted), default=-1) - len(grads))
    for (i, _), d in zip(wanted, outer_grads):
        out[i] = d if out[i] is None else g.Add(out[i], d)
    return out


def value_info(name: str, info: TensorInfo | None) -> onnx.ValueInfoProto:
    if info is None or info.dtype is None:
        raise GradientRuleError(f"the type of subgraph value {name!r} is unknown; annotate the body")
    shape = None if info.shape is None else [d if isinstance(d, (int, str)) else None for d in info.shape]
    return helper.make_tensor_value_info(name, info.dtype, shape)


def type_of(vi: onnx.ValueInfoProto) -> TensorInfo:
    return info_from_type(vi.type)


def renamed(g: GradBuilder, like: onnx.ValueInfoProto, base: str) -> onnx.ValueInfoProto:
    """A copy of value info ``like`` under a fresh name (a seed input of a backward body)."""
    vi = onnx.ValueInfoProto()
    vi.CopyFrom(like)
    vi.name = g.fresh(base)
    return vi


def tape_body(g: GradBuilder, body: onnx.GraphProto, carried: Sequence[int]) -> tuple[onnx.GraphProto, list[str]]:
    """``body`` that also emits, as extra (scan) outputs, the values of body inputs ``carried`` as they
    enter each iteration. Returns the tape body and the names of those extra outputs."""
    tape = onnx.GraphProto()
    tape.CopyFrom(body)
    tape.name = f"{body.name}_tape"
    names = []
    for k, i in enumerate(carried):
        t = g.fresh(f"tape{k}")
        tape.node.append(helper.make_node("Identity", [body.input[i].name], [t], name=t))
        tape.output.append(onnx.ValueInfoProto())
        tape.output[-1].CopyFrom(body.input[i])
        tape.output[-1].name = t
        names.append(t)
    return tape, names


def body_backward(g: GradBuilder, body: onnx.GraphProto, xs: list[str], seeds: Seeds, scope: str):
    """The nodes that recompute ``body`` and give d(sum_k <out_k, seed_k>)/d x for each x in ``xs``.

    ``xs`` may name body inputs and outer-scope tensors. ``seeds``: (body output name, value info of the
    seed tensor, which the new subgraph takes as an input or reads from the outer scope). Returns (nodes,
    gradient names, tensor info); an x the outputs do not depend on gets zeros of its shape.
    """
    em_outer = g.em
    outer = outer_names(body)
    nodes, fresh = _fresh_locals(body, em_outer, scope)
    dot = GradBuilder(Emitter(GraphView([], {}, {}), em_outer.taken), f"{scope}/dot")
    terms = [dot.op("ReduceSum", dot.op("Mul", fresh.get(out, out), seed.name), keepdims=0) for out, seed in seeds]
    y = dot.op("Sum", *terms) if len(terms) > 1 else terms[0]
    nodes += dot.em.nodes

    # the body as a standalone model, for the types and shapes its values have
    opsets = dict(em_outer.view.opsets)
    inputs = list(body.input)
    for _, s in seeds:  # two outputs may share one gradient tensor
        if s.name not in {i.name for i in inputs}:
            inputs.append(s)
    # outer tensors (read, or asked for though unread) become inputs; constants stay values the rules can
    # read (shapes, axes)
    local = {i.name for i in inputs} | {o for n in nodes for o in n.output}
    outer += [x for x in xs if x not in local and x not in outer]
    consts = {n: numpy_helper.from_array(np.asarray(em_outer.view.value(n)), n) for n in outer
              if n not in local and small(em_outer.info.get(n)) and em_outer.view.value(n) is not None}
    inputs += [value_info(n, em_outer.info.get(n)) for n in outer if n not in local and n not in consts]
    inits = list(consts.values())
    model = helper.make_model(helper.make_graph(nodes, "body", inputs, [helper.make_tensor_value_info(y, 0, None)],
                                                initializer=inits),
                              opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    # a function op without a rule (RMSNormalization) is recomputed through its body, as in the outer graph
    if expand_function_nodes(model, lambda n: expandable(n, opsets.get(normalize_domain(n.domain), 0)),
                             em_outer.taken, without_subgraphs):
        nodes = list(model.graph.node)
    info = infer_tensor_info(model)
    for vi in body.value_info:
        info.setdefault(fresh.get(vi.name, vi.name), type_of(vi))
    view = GraphView(nodes, info, opsets, [i.name for i in inputs], [y], {t.name: t for t in inits})
    em = Emitter(view, em_outer.taken, target=em_outer.target, options=em_outer.options)
    gb = GradBuilder(em, f"{scope}/seed")
    grads = backprop(em, nodes, xs, y, gb.const(1.0, like=y), scope)
    zeros = GradBuilder(em, f"{scope}/zeros")
    grads = [d if d is not None else _zeros(zeros, x) for x, d in zip(xs, grads)]
    return nodes + em.nodes, grads, info


def _fresh_locals(body: onnx.GraphProto, em: Emitter, scope: str) -> tuple[list[onnx.NodeProto], dict[str, str]]:
    """Copies of the body's nodes whose outputs have fresh names (and the mapping), its initializers first as
    Constant nodes (the backward body recomputes the forward one and has no initializers of its own): the
    recomputed body lives beside the forward one, where the node's own outputs are defined, and a branch may
    name its outputs like them (Optimum's merged decoders do), which would define a name twice."""
    local = {t.name: em.fresh(f"{scope}/{t.name}") for t in body.initializer}
    nodes = [helper.make_node("Constant", [], [local[t.name]], name=local[t.name], value=t) for t in body.initializer]
    nodes += _copy(body.node)
    local.update({o: em.fresh(f"{scope}/{o}") for n in nodes[len(body.initializer):] for o in n.output if o})
    for n in nodes:
        n.name = em.fresh(f"{scope}/{n.name or n.op_type}")
        n.input[:] = [local.get(i, i) for i in n.input]
        n.output[:] = [local.get(o, o) for o in n.output]
        for sg in subgraphs(n):
            rename_outer_reads(sg, local)
    return nodes, local


def body_jvp(g: GradBuilder, body: onnx.GraphProto, tangents: dict[str, str], scope: str,
             inputs: Sequence[onnx.ValueInfoProto] = ()) -> tuple[list, list[str], dict]:
    """The nodes that recompute ``body`` and give the tangent of each of its outputs (forward mode).

    ``tangents``: body input or outer-scope tensor -> its tangent: a new body input (``inputs``, the value
    infos the new body takes besides the body's own) or a tensor of the outer scope, which the body reads
    from there. Returns (nodes, one tangent per body output, tensor info); an output that depends on no
    tangent gets zeros of its shape. Needs ``g.em.push`` (the forward walk), which the forward engine sets.
    """
    em_outer = g.em
    if em_outer.push is None:
        raise GradientRuleError("body_jvp is for JVP rules: the forward walk sets the emitter's push")
    nodes = _copy(body.node)
    body_inputs = list(body.input) + list(inputs)
    local = {i.name for i in body_inputs} | {o for n in body.node for o in n.output}
    reads = outer_names(body) + [t for t in tangents.values() if t not in local]
    reads = [n for n in dict.fromkeys(reads) if n not in local]
    values = {n: em_outer.constants.get(n) for n in reads}
    values = {n: v if v is not None or not small(em_outer.info.get(n)) else em_outer.view.value(n)
              for n, v in values.items()}
    consts = {n: numpy_helper.from_array(np.asarray(v), n) for n, v in values.items() if v is not None}
    model_inputs = body_inputs + [value_info(n, em_outer.info.get(n)) for n in reads if n not in consts]
    inits = list(body.initializer) + list(consts.values())
    model = helper.make_model(helper.make_graph(nodes, "body", model_inputs, list(body.output), initializer=inits),
                              opset_imports=[helper.make_opsetid(d, v) for d, v in em_outer.view.opsets.items()])
    info = infer_tensor_info(model)
    for vi in body.value_info:
        info.setdefault(vi.name, type_of(vi))
    view = GraphView(nodes, info, dict(em_outer.view.opsets), [i.name for i in model_inputs],
                     [o.name for o in body.output], {t.name: t for t in inits})
    em = Emitter(view, em_outer.taken, target=em_outer.target, options=em_outer.options)
    em.push = em_outer.push
    found = em_outer.push(em, nodes, dict(tangents), scope)
    zeros = GradBuilder(em, f"{scope}/zeros")
    outs = [found.get(o.name) or _zeros(zeros, o.name) for o in body.output]
    return nodes + em.nodes, outs, view.info


def _copy(nodes) -> list[onnx.NodeProto]:
    out = []
    for n in nodes:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        out.append(c)
    return out


def _zeros(g: GradBuilder, x: str) -> str:
    """Zeros shaped like x: a Constant when the shape is static (ConstantOfShape needs opset 9)."""
    shape = g.static_shape(x)
    if shape is not None and g.opset < 9:
        return g.const(np.zeros(shape), like=x)
    return g.zeros_like(x)


def output_nodes(names: list[str], grads: list[str], info: dict) -> tuple[list, list]:
    """Identity nodes writing ``grads`` into the body outputs ``names``, and those outputs' value infos."""
    nodes, vis = [], []
    for name, d in zip(names, grads):
        nodes.append(helper.make_node("Identity", [d], [name], name=f"{name}/out"))
        vis.append(value_info(name, info.get(d)))
    return nodes, vis


def accumulators(g: GradBuilder, names: list[str], grads: list[str]):
    """One running sum per outer-scope tensor: (state inputs, Add nodes, state outputs) of a backward body
    that adds this iteration's gradient ``grads[k]`` of ``names[k]``."""
    ins, nodes, outs = [], [], []
    for k, (name, d) in enumerate(zip(names, grads)):
        info = TensorInfo(g.dtype(name), g.shape(name))
        a_in, a_out = g.fresh(f"acc{k}"), g.fresh(f"acc_next{k}")
        ins.append(value_info(a_in, info))
        outs.append(value_info(a_out, info))
        nodes.append(helper.make_node("Add", [a_in, d], [a_out], name=a_out))
    return ins, nodes, outs


def make_body(nodes: list[onnx.NodeProto], name: str, inputs: list, outputs: list[onnx.ValueInfoProto],
              initializers: Sequence[onnx.TensorProto] = ()) -> onnx.GraphProto:
    """A backward body from its nodes, cleaned up (CSE, dead nodes) down to what its outputs need; the forward
    body's ``initializers`` that they read come along."""
    nodes = cleanup_nodes(nodes, {o.name for o in outputs})
    read = {i for n in nodes for i in n.input} | {r for n in nodes for sg in subgraphs(n) for r in outer_names(sg)}
    return helper.make_graph(nodes, name, inputs, outputs, initializer=[t for t in initializers if t.name in read])


def loop_prologue(g: GradBuilder, last: str, step: str, cond_in: str, body_in: list[str], tapes: list[str],
                  dys: dict[str, str]) -> list[onnx.NodeProto]:
    """Nodes that give a reverse Loop's iteration the forward inputs of iteration j = last - step:
    iter_num = j, cond = ``cond_in``, the carried values gathered from ``tapes`` at j, and each output
    gradient (name in the body -> the stacked gradient in the outer scope) gathered at j."""
    pro = GradBuilder(Emitter(GraphView([], {}, g.em.view.opsets), g.em.taken), f"{g.scope}/step")
    j = pro.op("Sub", last, step)
    nodes = pro.em.nodes + [helper.make_node("Identity", [j], [body_in[0]], name=g.fresh("iter_num"))]
    if body_in[1]:
        nodes.append(helper.make_node("Identity", [cond_in], [body_in[1]], name=g.fresh("cond_in")))
    for tape, name in zip(tapes, body_in[2:]):
        nodes.append(helper.make_node("Gather", [tape, j], [name], axis=0, name=g.fresh("gather")))
    for name, stacked in dys.items():
        nodes.append(helper.make_node("Gather", [stacked, j], [name], axis=0, name=g.fresh("gather")))
    return nodes


def scalar_input(name: str, dtype: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, [])


def pass_through(src: str, dst: str) -> onnx.NodeProto:
    return helper.make_node("Identity", [src], [dst], name=dst)


def branch_seeds(g: GradBuilder, node: NodeView, body: onnx.GraphProto, dy) -> Seeds:
    """(branch output, the If output's gradient as read from the outer scope) for each output with one."""
    seeds = []
    for k, d in enumerate(dy):
        if d is None or k >= len(body.output):
            continue
        info = TensorInfo(g.dtype(node.outputs[k]), g.shape(node.outputs[k]))
        if info.dtype is None:
            info = type_of(body.output[k])
        seeds.append((body.output[k].name, value_info(d, info)))
    return seeds


def inline_backward(g: GradBuilder, body: onnx.GraphProto, xs: list[str], seeds: Seeds, scope: str) -> list[str]:
    """The backward of ``body`` emitted into the outer graph: the branch's own tensors (recomputed there)
    have fresh names and its initializers are Constants (``_fresh_locals``). Returns one gradient per x."""
    nodes, grads, info = body_backward(g, body, xs, seeds, scope)
    nodes = cleanup_nodes(nodes, set(grads))
    em = g.em
    for n in nodes:  # the body's own tensors have fresh names already (_fresh_locals)
        for o in n.output:
            if o in info:
                em.info[o] = info[o]
        em.nodes.append(n)
    return grads


def branch_backward(g: GradBuilder, body: onnx.GraphProto, xs: list[str], seeds: Seeds, scope: str
                    ) -> onnx.GraphProto:
    """A branch graph (no inputs) giving one gradient per x: the backward of ``body``, zeros for an x it
    does not read. Outputs are typed like the xs, so the two branches agree."""
    nodes, grads, info = body_backward(g, body, xs, seeds, scope)
    names = [g.em.fresh(f"{scope}/d{k}") for k in range(len(xs))]
    outs = [pass_through(d, n) for d, n in zip(grads, names)]
    vis = [value_info(n, TensorInfo(g.dtype(x), g.shape(x))) for n, x in zip(names, xs)]
    return make_body(nodes + outs, f"{body.name}_grad", [], vis, [])
