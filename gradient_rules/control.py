"""Control flow: If through the branch taken; Scan and Loop as a reverse sweep over a tape of the
states entering each iteration.

The backward of a body is our own reverse walk (``autodiff.backprop``) run over a copy of the body with
a fresh emitter, inside a new subgraph (or, for an If on a constant condition, inlined into the outer
graph). Tensors a body reads from the outer scope get gradients too: an If returns its branch's
gradient of them, a Scan or Loop carries one accumulator per such tensor through its reverse sweep.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_autodiff.autodiff import backprop
from onnx_autodiff.builder import Emitter, GradBuilder
from onnx_autodiff.errors import OnnxAutodiffError
from onnx_autodiff.graph import GraphView, TensorInfo, infer_tensor_info, info_from_type, node_inputs
from onnx_autodiff.cleanup import cleanup_nodes
from onnx_autodiff.registry import gradient_rule


def outer_names(body: onnx.GraphProto) -> list[str]:
    """The outer-scope tensors a subgraph reads (its nodes, nested bodies and outputs), in first-use order."""
    local = {i.name for i in body.input} | {t.name for t in body.initializer}
    out = []
    for n in body.node:
        for i in node_inputs(n):
            if i not in local and i not in out:
                out.append(i)
        local.update(o for o in n.output if o)
    out.extend(o.name for o in body.output if o.name not in local and o.name not in out)
    return out


def wanted_outer(node, *bodies: onnx.GraphProto) -> list[tuple[int, str]]:
    """(gradient index, name) of each outer-scope tensor the bodies read that needs a gradient.

    A tensor that is also one of the node's own inputs keeps that input's index (the engine lists it
    once), so the rule adds the outer-read gradient to the input's own one.
    """
    reads = {n for b in bodies for n in outer_names(b)}
    n_in = len(node.inputs)
    out = [(n_in + k, name) for k, name in enumerate(node.outer_inputs)
           if name in reads and node.needs_grad(n_in + k)]
    out += [(i, name) for i, name in enumerate(node.inputs) if name and name in reads and node.needs_grad(i)]
    return out


def _with_outer(g, grads: list, wanted: list[tuple[int, str]], outer_grads: list[str]) -> list:
    """``grads`` (one per node input) extended by the outer-scope gradients at their indices."""
    out = list(grads) + [None] * (1 + max((i for i, _ in wanted), default=-1) - len(grads))
    for (i, _), d in zip(wanted, outer_grads):
        out[i] = d if out[i] is None else g.Add(out[i], d)
    return out


def _value_info(name, info: TensorInfo | None):
    if info is None or info.dtype is None:
        raise OnnxAutodiffError(f"the type of subgraph value {name!r} is unknown; annotate the body")
    shape = None if info.shape is None else [d if isinstance(d, (int, str)) else None for d in info.shape]
    return helper.make_tensor_value_info(name, info.dtype, shape)


def _type_of(vi: onnx.ValueInfoProto) -> TensorInfo:
    return info_from_type(vi.type)


def _copy(nodes):
    out = []
    for n in nodes:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        out.append(c)
    return out


def body_backward(g, body: onnx.GraphProto, xs: list[str], seeds: list[tuple[str, onnx.ValueInfoProto]],
                  scope: str):
    """The nodes that recompute ``body`` and give d(sum_k <out_k, seed_k>)/d x for each x in ``xs``.

    ``xs`` may name body inputs and outer-scope tensors. ``seeds``: (body output name, value info of the
    seed tensor, which the new subgraph takes as an input or reads from the outer scope). Returns (nodes,
    gradient names, tensor info); an x the outputs do not depend on gets zeros of its shape.
    """
    outer = outer_names(body)
    nodes = _copy(body.node)
    em_outer = g.em
    dot = GradBuilder(Emitter(GraphView([], {}, {}), em_outer.taken), f"{scope}/dot")
    terms = []
    for out, seed in seeds:
        terms.append(dot.op("ReduceSum", dot.op("Mul", out, seed.name), keepdims=0))
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
    local = {i.name for i in inputs} | {o for n in body.node for o in n.output}
    outer += [x for x in xs if x not in local and x not in outer]
    consts = {n: numpy_helper.from_array(np.asarray(em_outer.view.value(n)), n) for n in outer
              if n not in local and em_outer.view.value(n) is not None}
    inputs += [_value_info(n, em_outer.info.get(n)) for n in outer if n not in local and n not in consts]
    inits = list(body.initializer) + list(consts.values())
    model = helper.make_model(helper.make_graph(nodes, "body", inputs, [helper.make_tensor_value_info(y, 0, None)],
                                                initializer=inits),
                              opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    info = infer_tensor_info(model)
    for vi in body.value_info:
        info.setdefault(vi.name, _type_of(vi))
    view = GraphView(nodes, info, opsets, [i.name for i in inputs], [y], {t.name: t for t in inits})
    em = Emitter(view, em_outer.taken)
    gb = GradBuilder(em, f"{scope}/seed")
    grads = backprop(em, nodes, xs, y, gb.const(1.0, like=y), scope)
    zeros = GradBuilder(em, f"{scope}/zeros")
    grads = [d if d is not None else _zeros(zeros, x) for x, d in zip(xs, grads)]
    return nodes + em.nodes, grads, info


def _zeros(g, x: str) -> str:
    """Zeros shaped like x: a Constant when the shape is static (ConstantOfShape needs opset 9)."""
    shape = g.static_shape(x)
    if shape is not None and g.opset < 9:
        return g.const(np.zeros(shape), like=x)
    return g.zeros_like(x)


def _outputs(names, grads, info):
    nodes, vis = [], []
    for name, d in zip(names, grads):
        nodes.append(helper.make_node("Identity", [d], [name], name=f"{name}/out"))
        vis.append(_value_info(name, info.get(d)))
    return nodes, vis


def _accumulators(g, names: list[str], grads: list[str], scope: str):
    """One running sum per outer-scope tensor: (state inputs, Add nodes, state outputs) of a backward body
    that adds this iteration's gradient ``grads[k]`` of ``names[k]``."""
    ins, nodes, outs = [], [], []
    for k, (name, d) in enumerate(zip(names, grads)):
        info = TensorInfo(g.dtype(name), g.shape(name))
        a_in, a_out = g.em.fresh(f"{scope}/acc{k}"), g.em.fresh(f"{scope}/acc_next{k}")
        ins.append(_value_info(a_in, info))
        outs.append(_value_info(a_out, info))
        nodes.append(helper.make_node("Add", [a_in, d], [a_out], name=a_out))
    return ins, nodes, outs


@gradient_rule("Scan", since=9)
def scan_grad(g, node, dy):
    """A tape Scan saves the state entering each iteration; a reverse Scan then runs the body's backward
    per iteration, carrying the state gradients and emitting the scan-input gradients. Each outer-scope
    tensor the body reads that needs a gradient is one more state of the reverse Scan: a running sum."""
    body = node.attr("body")
    n_scan = int(node.attr("num_scan_inputs"))
    n_state = len(node.inputs) - n_scan
    n_out = len(body.output) - n_state
    in_axes = list(node.attr("scan_input_axes") or [0] * n_scan)
    in_dirs = list(node.attr("scan_input_directions") or [0] * n_scan)
    out_axes = list(node.attr("scan_output_axes") or [0] * n_out)
    out_dirs = list(node.attr("scan_output_directions") or [0] * n_out)
    scope = f"{node.name}/grad"
    body_in = [i.name for i in body.input]

    # 1. the tape: the body again, also emitting each incoming state as a scan output
    tapes = []
    if n_state:
        tape_body = onnx.GraphProto()
        tape_body.CopyFrom(body)
        tape_body.name = f"{body.name}_tape"
        for k in range(n_state):
            t = g.em.fresh(f"{scope}/tape{k}")
            tape_body.node.append(helper.make_node("Identity", [body_in[k]], [t], name=t))
            tape_body.output.append(helper.make_tensor_value_info(t, body.input[k].type.tensor_type.elem_type, None))
            tape_body.output[-1].type.CopyFrom(body.input[k].type)
        outs = g.op("Scan", *node.inputs, outputs=n_state + n_out + n_state, body=tape_body,
                    num_scan_inputs=n_scan, scan_input_axes=node.attr("scan_input_axes"),
                    scan_input_directions=node.attr("scan_input_directions"),
                    scan_output_axes=out_axes + [0] * n_state, scan_output_directions=out_dirs + [0] * n_state)
        outs = outs if isinstance(outs, tuple) else (outs,)
        tapes = list(outs[n_state + n_out:])
        for k, t in enumerate(tapes):
            s = _type_of(body.input[k])
            g.em.info[t] = TensorInfo(s.dtype, None)

    # 2. the backward body: states are the state gradients, scan inputs the tapes, the xs and the dys
    def seed_vi(name, like):
        vi = onnx.ValueInfoProto()
        vi.CopyFrom(like)
        vi.name = g.em.fresh(f"{scope}/{name}")
        return vi

    d_state_in = [seed_vi(f"d_state{k}", body.input[k]) for k in range(n_state)]
    with_grad = [k for k in range(n_out) if dy[n_state + k] is not None]
    d_out_in = [seed_vi(f"d_out{k}", body.output[n_state + k]) for k in with_grad]
    seeds = [(body.output[k].name, d_state_in[k]) for k in range(n_state)]
    seeds += [(body.output[n_state + k].name, vi) for k, vi in zip(with_grad, d_out_in)]
    wanted = wanted_outer(node, body)
    acc_names = [name for _, name in wanted]
    nodes, grads, info = body_backward(g, body, body_in + acc_names, seeds, scope)
    acc_in, acc_nodes, acc_out = _accumulators(g, acc_names, grads[len(body_in):], scope)
    new_out = [g.em.fresh(f"{scope}/d_state_prev{k}") for k in range(n_state)]
    new_out += [g.em.fresh(f"{scope}/d_x{j}") for j in range(n_scan)]
    out_nodes, out_vis = _outputs(new_out, grads[:len(body_in)], info)
    inputs = d_state_in + acc_in + list(body.input) + d_out_in
    keep = set(new_out) | {v.name for v in acc_out}
    bwd_body = helper.make_graph(cleanup_nodes(nodes + acc_nodes + out_nodes, keep), f"{body.name}_grad",
                                 inputs, out_vis[:n_state] + acc_out + out_vis[n_state:])

    # 3. the reverse Scan
    d_init = [dy[k] if dy[k] is not None else g.zeros_like(node.inputs[k]) for k in range(n_state)]
    scan_in = tapes + list(node.inputs[n_state:]) + [dy[n_state + k] for k in with_grad]
    acc_init = [g.zeros_like(name) for name in acc_names]
    res = g.op("Scan", *d_init, *acc_init, *scan_in, outputs=n_state + len(acc_names) + n_scan, body=bwd_body,
               num_scan_inputs=len(scan_in),
               scan_input_axes=[0] * n_state + in_axes + [out_axes[k] for k in with_grad],
               scan_input_directions=[1] * n_state + [1 - d for d in in_dirs] + [1 - out_dirs[k] for k in with_grad],
               scan_output_axes=in_axes, scan_output_directions=[1 - d for d in in_dirs])
    res = list(res) if isinstance(res, tuple) else [res]
    acc = res[n_state:n_state + len(acc_names)]
    res = res[:n_state] + res[n_state + len(acc_names):]
    for x, r in zip(node.inputs + acc_names, res + acc):
        g.em.info[r] = TensorInfo(g.dtype(x), g.shape(x))
    return _with_outer(g, [r if node.needs_grad(i) else None for i, r in enumerate(res)], wanted, acc)


@gradient_rule("Loop", since=11)
def loop_grad(g, node, dy):
    """A tape Loop saves the loop-carried values entering each iteration; a second Loop runs as many
    iterations backwards, recomputing iteration j = n - 1 - i from the tape (iter_num = j, cond = true)
    and carrying the gradients of the loop-carried values, plus a running sum per outer-scope tensor the
    body reads that needs a gradient. The trip count and condition get none."""
    body = node.attr("body")
    n_state = len(node.inputs) - 2
    n_out = len(body.output) - 1 - n_state
    if n_state == 0:
        raise OnnxAutodiffError(f"{node}: the Loop gradient needs loop-carried values (they give the tape)")
    scope = f"{node.name}/grad"
    body_in = [i.name for i in body.input]

    tape_body = onnx.GraphProto()
    tape_body.CopyFrom(body)
    tape_body.name = f"{body.name}_tape"
    for k in range(n_state):
        t = g.em.fresh(f"{scope}/tape{k}")
        tape_body.node.append(helper.make_node("Identity", [body_in[2 + k]], [t], name=t))
        tape_body.output.append(onnx.ValueInfoProto())
        tape_body.output[-1].CopyFrom(body.input[2 + k])
        tape_body.output[-1].name = t
    outs = g.op("Loop", *node.inputs, outputs=n_state + n_out + n_state, body=tape_body)
    tapes = list(outs[n_state + n_out:])
    for k, t in enumerate(tapes):
        g.em.info[t] = TensorInfo(g.dtype(node.inputs[2 + k]), None)
    n_iter = g.Squeeze(g.Slice(g.Shape(tapes[0]), g.ints([0]), g.ints([1])), g.ints([0])) \
        if g.opset >= 13 else g.Squeeze(g.Slice(g.Shape(tapes[0]), g.ints([0]), g.ints([1])), axes=[0])
    last = g.Sub(n_iter, g.const(1, dtype="int64"))

    def seed_vi(name, like):
        vi = onnx.ValueInfoProto()
        vi.CopyFrom(like)
        vi.name = g.em.fresh(f"{scope}/{name}")
        return vi

    d_state_in = [seed_vi(f"d_state{k}", body.input[2 + k]) for k in range(n_state)]
    with_grad = [k for k in range(n_out) if dy[n_state + k] is not None]
    d_out = {k: g.em.fresh(f"{scope}/d_out{k}") for k in with_grad}
    seeds = [(body.output[1 + k].name, d_state_in[k]) for k in range(n_state)]
    seed_out = [seed_vi(f"d_out{k}", body.output[1 + n_state + k]) for k in with_grad]
    for v, k in zip(seed_out, with_grad):
        v.name = d_out[k]
    seeds += [(body.output[1 + n_state + k].name, v) for k, v in zip(with_grad, seed_out)]
    wanted = wanted_outer(node, body)
    acc_names = [name for _, name in wanted]
    nodes, grads, info = body_backward(g, body, body_in[2:] + acc_names, seeds, scope)
    acc_in, acc_nodes, acc_out = _accumulators(g, acc_names, grads[n_state:], scope)

    # the prologue: iteration j's inputs from the tape (iter_num, cond, carried values, output gradients)
    step, cond_in = g.em.fresh(f"{scope}/i"), g.em.fresh(f"{scope}/cond")
    pro = GradBuilder(Emitter(GraphView([], {}, g.em.view.opsets), g.em.taken), f"{scope}/step")
    j = pro.op("Sub", last, step)
    prologue = [helper.make_node("Identity", [j], [body_in[0]], name=g.em.fresh(f"{scope}/iter_num"))]
    if body_in[1]:
        prologue.append(helper.make_node("Identity", [cond_in], [body_in[1]], name=g.em.fresh(f"{scope}/cond_in")))
    for k in range(n_state):
        prologue.append(helper.make_node("Gather", [tapes[k], j], [body_in[2 + k]], axis=0,
                                         name=g.em.fresh(f"{scope}/gather")))
    for k in with_grad:
        prologue.append(helper.make_node("Gather", [dy[n_state + k], j], [d_out[k]], axis=0,
                                         name=g.em.fresh(f"{scope}/gather")))
    new_out = [g.em.fresh(f"{scope}/d_state_prev{k}") for k in range(n_state)]
    out_nodes, out_vis = _outputs(new_out, grads[:n_state], info)
    cond_out = g.em.fresh(f"{scope}/cond_out")
    out_nodes.append(helper.make_node("Identity", [cond_in], [cond_out], name=cond_out))
    inputs = [helper.make_tensor_value_info(step, onnx.TensorProto.INT64, []),
              helper.make_tensor_value_info(cond_in, onnx.TensorProto.BOOL, [])] + d_state_in + acc_in
    outputs = [helper.make_tensor_value_info(cond_out, onnx.TensorProto.BOOL, [])] + out_vis + acc_out
    bwd_nodes = pro.em.nodes + prologue + nodes + acc_nodes
    keep = set(new_out) | {cond_out} | {v.name for v in acc_out}
    bwd_body = helper.make_graph(cleanup_nodes(bwd_nodes + out_nodes, keep), f"{body.name}_grad", inputs, outputs)
    d_init = [dy[k] if dy[k] is not None else g.zeros_like(node.inputs[2 + k]) for k in range(n_state)]
    acc_init = [g.zeros_like(name) for name in acc_names]
    res = g.op("Loop", n_iter, "", *d_init, *acc_init, outputs=n_state + len(acc_names), body=bwd_body)
    res = list(res) if isinstance(res, tuple) else [res]
    for x, r in zip(node.inputs[2:] + acc_names, res):
        g.em.info[r] = TensorInfo(g.dtype(x), g.shape(x))
    grads = [None, None] + [r if node.needs_grad(2 + k) else None for k, r in enumerate(res[:n_state])]
    return _with_outer(g, grads, wanted, res[n_state:])


def _branch_seeds(g, node, body: onnx.GraphProto, dy) -> list[tuple[str, onnx.ValueInfoProto]]:
    """(branch output, the If output's gradient as read from the outer scope) for each output with one."""
    seeds = []
    for k, d in enumerate(dy):
        if d is None:
            continue
        info = TensorInfo(g.dtype(node.outputs[k]), g.shape(node.outputs[k]))
        if info.dtype is None:
            info = _type_of(body.output[k])
        seeds.append((body.output[k].name, _value_info(d, info)))
    return seeds


def _rename_reads(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Rename the outer-scope tensors a subgraph (and the subgraphs inside it) reads, in place."""
    for n in graph.node:
        _rename_node(n, mapping)
    for o in graph.output:
        o.name = mapping.get(o.name, o.name)


def _rename_node(node: onnx.NodeProto, mapping: dict[str, str]) -> None:
    for k, i in enumerate(node.input):
        node.input[k] = mapping.get(i, i)
    for k, o in enumerate(node.output):
        node.output[k] = mapping.get(o, o)
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            _rename_reads(a.g, mapping)
        elif a.type == onnx.AttributeProto.GRAPHS:
            for sg in a.graphs:
                _rename_reads(sg, mapping)


def _inline_backward(g, body: onnx.GraphProto, xs: list[str], seeds, scope: str) -> list[str]:
    """The backward of ``body`` emitted into the outer graph: the branch's own tensors (recomputed there)
    get fresh names, its initializers become Constants. Returns one gradient per x."""
    nodes, grads, info = body_backward(g, body, xs, seeds, scope)
    nodes = cleanup_nodes(nodes, set(grads))
    mapping = {t.name: g.op("Constant", value=t) for t in body.initializer}
    local = {o for n in body.node for o in n.output if o}
    for n in nodes:
        if any(o in local for o in n.output):
            n.name = g.em.fresh(f"{scope}/{n.name or n.op_type}")
        for o in n.output:
            if o in local:
                mapping[o] = g.em.fresh(f"{scope}/{o}")
    for n in nodes:
        for o in n.output:
            if o in info:
                g.em.info[mapping.get(o, o)] = info[o]
        _rename_node(n, mapping)
        g.em.nodes.append(n)
    return [mapping.get(d, d) for d in grads]


def _branch_backward(g, body: onnx.GraphProto, xs: list[str], seeds, scope: str) -> onnx.GraphProto:
    """A branch graph (no inputs) giving one gradient per x: the backward of ``body``, zeros for an x it
    does not read. Outputs are typed like the xs, so the two branches agree."""
    nodes, grads, info = body_backward(g, body, xs, seeds, scope)
    names = [g.em.fresh(f"{scope}/d{k}") for k in range(len(xs))]
    outs = [helper.make_node("Identity", [d], [n], name=n) for d, n in zip(grads, names)]
    vis = [_value_info(n, TensorInfo(g.dtype(x), g.shape(x))) for n, x in zip(names, xs)]
    return helper.make_graph(cleanup_nodes(nodes + outs, set(names)), f"{body.name}_grad", [], vis)


@gradient_rule("If", since=7)
def if_grad(g, node, dy):
    """Gradients of the outer-scope tensors the branches read, through the branch taken. A constant
    condition inlines that branch's backward; otherwise an If on the same condition holds the backward
    of each branch (reading the output gradients and forward tensors from the outer scope)."""
    branches = (node.attr("then_branch"), node.attr("else_branch"))
    wanted = wanted_outer(node, *branches)
    if not wanted:
        return []
    xs = [name for _, name in wanted]
    scope = f"{node.name}/grad"
    cond = g.value(node.inputs[0])
    if cond is not None:
        taken = 0 if bool(np.asarray(cond).reshape(-1)[0]) else 1
        body = branches[taken]
        grads = _inline_backward(g, body, xs, _branch_seeds(g, node, body, dy), f"{scope}/{('then', 'else')[taken]}")
    else:
        then_g, else_g = (_branch_backward(g, b, xs, _branch_seeds(g, node, b, dy), f"{scope}/{tag}")
                          for b, tag in zip(branches, ("then", "else")))
        res = g.op("If", node.inputs[0], outputs=len(xs), then_branch=then_g, else_branch=else_g)
        grads = list(res) if isinstance(res, tuple) else [res]
    for x, d in zip(xs, grads):
        g.em.info[d] = TensorInfo(g.dtype(x), g.shape(x))
    return _with_outer(g, [None], wanted, grads)
