"""Control flow: Scan and Loop, each a reverse sweep over a tape of the states entering each iteration.

The backward of a body is our own reverse walk (``autodiff.backprop``) run over a copy of the body with
a fresh emitter, inside a new subgraph. Tensors the body reads from the outer scope cannot get a
gradient yet (the engine routes gradients along ``node.input`` only), so a body that reads a floating
outer-scope tensor that is not a constant is refused rather than given a silently wrong gradient.
If has no rule for the same reason: its branches read everything from the outer scope.
"""
from __future__ import annotations

import onnx
from onnx import helper

from onnx_autodiff.autodiff import backprop
from onnx_autodiff.builder import Emitter, GradBuilder
from onnx_autodiff.errors import OnnxAutodiffError
from onnx_autodiff.graph import FLOAT_TYPES, GraphView, TensorInfo, infer_tensor_info, node_inputs
from onnx_autodiff.passes.cleanup import cleanup_nodes
from onnx_autodiff.registry import gradient_rule


def outer_names(body: onnx.GraphProto) -> list[str]:
    """The outer-scope tensors a subgraph reads, in first-use order."""
    local = {i.name for i in body.input} | {t.name for t in body.initializer}
    out = []
    for n in body.node:
        for i in node_inputs(n):
            if i not in local and i not in out:
                out.append(i)
        local.update(o for o in n.output if o)
    return out


def _refuse_differentiable_outer(g, node, body):
    bad = [n for n in outer_names(body) if g.dtype(n) in FLOAT_TYPES and g.value(n) is None]
    if bad:
        raise OnnxAutodiffError(
            f"{node}: its body reads the floating-point outer-scope tensors {bad}; gradients do not flow to "
            "outer-scope tensors yet, so pass them to the node explicitly (as loop-carried state)")


def _value_info(name, info: TensorInfo | None):
    if info is None or info.dtype is None:
        raise OnnxAutodiffError(f"the type of subgraph value {name!r} is unknown; annotate the body")
    shape = None if info.shape is None else [d if isinstance(d, (int, str)) else None for d in info.shape]
    return helper.make_tensor_value_info(name, info.dtype, shape)


def _type_of(vi: onnx.ValueInfoProto) -> TensorInfo:
    from onnx_autodiff.graph import _info_from_type

    return _info_from_type(vi.type)


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

    ``seeds``: (body output name, value info of the seed tensor the new subgraph takes as input).
    Returns (nodes, gradient names); a gradient x does not get is zeros of x's shape.
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
    inputs = list(body.input) + [s for _, s in seeds]
    inputs += [_value_info(n, em_outer.info.get(n)) for n in outer if n not in {i.name for i in inputs}]
    model = helper.make_model(helper.make_graph(nodes, "body", inputs, [helper.make_tensor_value_info(y, 0, None)],
                                                initializer=list(body.initializer)),
                              opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    info = infer_tensor_info(model)
    for vi in body.value_info:
        info.setdefault(vi.name, _type_of(vi))
    view = GraphView(nodes, info, opsets, [i.name for i in inputs], [y],
                     {t.name: t for t in body.initializer})
    em = Emitter(view, em_outer.taken)
    gb = GradBuilder(em, f"{scope}/seed")
    grads = backprop(em, nodes, xs, y, gb.const(1.0, like=y), scope)
    zeros = GradBuilder(em, f"{scope}/zeros")
    grads = [d if d is not None else zeros.zeros_like(x) for x, d in zip(xs, grads)]
    return nodes + em.nodes, grads, info


def _outputs(names, grads, info):
    nodes, vis = [], []
    for name, d in zip(names, grads):
        nodes.append(helper.make_node("Identity", [d], [name], name=f"{name}/out"))
        vis.append(_value_info(name, info.get(d)))
    return nodes, vis


@gradient_rule("Scan", since=9)
def scan_grad(g, node, dy):
    """A tape Scan saves the state entering each iteration; a reverse Scan then runs the body's backward
    per iteration, carrying the state gradients and emitting the scan-input gradients."""
    body = node.attr("body")
    _refuse_differentiable_outer(g, node, body)
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
    nodes, grads, info = body_backward(g, body, body_in, seeds, scope)
    new_out = [g.em.fresh(f"{scope}/d_state_prev{k}") for k in range(n_state)]
    new_out += [g.em.fresh(f"{scope}/d_x{j}") for j in range(n_scan)]
    out_nodes, out_vis = _outputs(new_out, grads, info)
    inputs = d_state_in + list(body.input) + d_out_in
    bwd_body = helper.make_graph(cleanup_nodes(nodes + out_nodes, set(new_out)), f"{body.name}_grad",
                                 inputs, out_vis)

    # 3. the reverse Scan
    d_init = [dy[k] if dy[k] is not None else g.zeros_like(node.inputs[k]) for k in range(n_state)]
    scan_in = tapes + list(node.inputs[n_state:]) + [dy[n_state + k] for k in with_grad]
    res = g.op("Scan", *d_init, *scan_in, outputs=n_state + n_scan, body=bwd_body,
               num_scan_inputs=len(scan_in),
               scan_input_axes=[0] * n_state + in_axes + [out_axes[k] for k in with_grad],
               scan_input_directions=[1] * n_state + [1 - d for d in in_dirs] + [1 - out_dirs[k] for k in with_grad],
               scan_output_axes=in_axes, scan_output_directions=[1 - d for d in in_dirs])
    res = res if isinstance(res, tuple) else (res,)
    for x, r in zip(node.inputs, res):
        g.em.info[r] = TensorInfo(g.dtype(x), g.shape(x))
    return [r if node.needs_grad(i) else None for i, r in enumerate(res)]


@gradient_rule("Loop", since=11)
def loop_grad(g, node, dy):
    """A tape Loop saves the loop-carried values entering each iteration; a second Loop runs as many
    iterations backwards, recomputing iteration j = n - 1 - i from the tape (iter_num = j, cond = true)
    and carrying the gradients of the loop-carried values. The trip count and condition get none."""
    body = node.attr("body")
    _refuse_differentiable_outer(g, node, body)
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
    nodes, grads, info = body_backward(g, body, body_in[2:], seeds, scope)

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
    out_nodes, out_vis = _outputs(new_out, grads, info)
    cond_out = g.em.fresh(f"{scope}/cond_out")
    out_nodes.append(helper.make_node("Identity", [cond_in], [cond_out], name=cond_out))
    inputs = [helper.make_tensor_value_info(step, onnx.TensorProto.INT64, []),
              helper.make_tensor_value_info(cond_in, onnx.TensorProto.BOOL, [])] + d_state_in
    outputs = [helper.make_tensor_value_info(cond_out, onnx.TensorProto.BOOL, [])] + out_vis
    bwd_nodes = pro.em.nodes + prologue + nodes
    bwd_body = helper.make_graph(cleanup_nodes(bwd_nodes + out_nodes, set(new_out) | {cond_out}),
                                 f"{body.name}_grad", inputs, outputs)
    d_init = [dy[k] if dy[k] is not None else g.zeros_like(node.inputs[2 + k]) for k in range(n_state)]
    res = g.op("Loop", n_iter, "", *d_init, outputs=n_state, body=bwd_body)
    res = res if isinstance(res, tuple) else (res,)
    for k, r in enumerate(res):
        g.em.info[r] = TensorInfo(g.dtype(node.inputs[2 + k]), g.shape(node.inputs[2 + k]))
    return [None, None] + [r if node.needs_grad(2 + k) else None for k, r in enumerate(res)]
