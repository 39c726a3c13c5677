"""Control flow: If through the branch taken; Scan and Loop as a reverse sweep over a tape of the
states entering each iteration.

The backward of a body comes from the engine (``onnx_autodiff.engine.subgraph``: the reverse walk over a copy
of the body, inside a new subgraph or inlined). Tensors a body reads from the outer scope get gradients
too: an If returns its branch's gradient of them, a Scan or Loop carries one accumulator per such tensor
through its reverse sweep.

The tangents (forward mode) go through the bodies too: an If on the same condition whose branches
recompute their values and push the tangents of the outer-scope tensors they read through them; a Scan or
Loop whose body carries each float state's tangent beside the state and takes the tangents of its scan
inputs beside them (``body_jvp``). The values are recomputed inside, so the tangent costs a second pass of
the loop, not a tape and a reverse sweep.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from onnx_autodiff.engine.subgraph import (
    accumulators,
    body_backward,
    body_jvp,
    branch_backward,
    branch_seeds,
    inline_backward,
    loop_prologue,
    make_body,
    output_nodes,
    pass_through,
    renamed,
    scalar_input,
    tape_body,
    type_of,
    value_info,
    wanted_outer,
    with_outer,
)
from onnx_autodiff.rule_api import FLOAT_TYPES, GradBuilder, GradientRuleError, Grads, NodeView, gradient_rule, jvp_rule


def _scan_layout(node: NodeView):
    """``(body, scan inputs, states, scan outputs, input axes, input directions, output axes, output directions)``
    of a Scan, the attributes' defaults filled in."""
    body = node.attr("body")
    n_scan = int(node.attr("num_scan_inputs"))
    n_state = len(node.inputs) - n_scan
    n_out = len(body.output) - n_state
    return (body, n_scan, n_state, n_out, list(node.attr("scan_input_axes") or [0] * n_scan),
            list(node.attr("scan_input_directions") or [0] * n_scan),
            list(node.attr("scan_output_axes") or [0] * n_out),
            list(node.attr("scan_output_directions") or [0] * n_out))


@gradient_rule("Scan", since=9)
def scan_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """A tape Scan saves the state entering each iteration; a reverse Scan then runs the body's backward
    per iteration, carrying the state gradients and emitting the scan-input gradients. Each outer-scope
    tensor the body reads that needs a gradient is one more state of the reverse Scan: a running sum."""
    body, n_scan, n_state, n_out, in_axes, in_dirs, out_axes, out_dirs = _scan_layout(node)
    scope = g.scope
    body_in = [i.name for i in body.input]

    # 1. the tape: the body again, also emitting each incoming state as a scan output
    tapes = []
    if n_state:
        tape, _ = tape_body(g, body, range(n_state))
        outs = g.op("Scan", *node.inputs, outputs=n_state + n_out + n_state, body=tape,
                    num_scan_inputs=n_scan, scan_input_axes=node.attr("scan_input_axes"),
                    scan_input_directions=node.attr("scan_input_directions"),
                    scan_output_axes=out_axes + [0] * n_state, scan_output_directions=out_dirs + [0] * n_state)
        outs = outs if isinstance(outs, tuple) else (outs,)
        tapes = list(outs[n_state + n_out:])
        for k, t in enumerate(tapes):
            g.declare(t, type_of(body.input[k]).dtype)

    # 2. the backward body: states are the state gradients, scan inputs the tapes, the xs and the dys
    d_state_in = [renamed(g, body.input[k], f"d_state{k}") for k in range(n_state)]
    with_grad = [k for k in range(n_out) if dy[n_state + k] is not None]
    d_out_in = [renamed(g, body.output[n_state + k], f"d_out{k}") for k in with_grad]
    seeds = [(body.output[k].name, d_state_in[k]) for k in range(n_state)]
    seeds += [(body.output[n_state + k].name, vi) for k, vi in zip(with_grad, d_out_in)]
    wanted = wanted_outer(node, body)
    acc_names = [name for _, name in wanted]
    nodes, grads, info = body_backward(g, body, body_in + acc_names, seeds, scope)
    acc_in, acc_nodes, acc_out = accumulators(g, acc_names, grads[len(body_in):])
    new_out = [g.fresh(f"d_state_prev{k}") for k in range(n_state)]
    new_out += [g.fresh(f"d_x{j}") for j in range(n_scan)]
    out_nodes, out_vis = output_nodes(new_out, grads[:len(body_in)], info)
    inputs = d_state_in + acc_in + list(body.input) + d_out_in
    bwd_body = make_body(nodes + acc_nodes + out_nodes, f"{body.name}_grad", inputs,
                         out_vis[:n_state] + acc_out + out_vis[n_state:], body.initializer)

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
        g.declare(r, g.dtype(x), g.shape(x))
    return with_outer(g, [r if node.needs_grad(i) else None for i, r in enumerate(res)], wanted, acc)


@gradient_rule("Loop", since=11)
def loop_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """A tape Loop saves the loop-carried values entering each iteration; a second Loop runs as many
    iterations backwards, recomputing iteration j = n - 1 - i from the tape (iter_num = j, cond = true)
    and carrying the gradients of the loop-carried values, plus a running sum per outer-scope tensor the
    body reads that needs a gradient. The trip count and condition get none."""
    body = node.attr("body")
    n_state = len(node.inputs) - 2
    n_out = len(body.output) - 1 - n_state
    if n_state == 0:
        raise GradientRuleError("the Loop gradient needs loop-carried values (they give the tape)")
    scope = g.scope
    body_in = [i.name for i in body.input]

    tape, _ = tape_body(g, body, range(2, 2 + n_state))
    outs = g.op("Loop", *node.inputs, outputs=n_state + n_out + n_state, body=tape)
    tapes = list(outs[n_state + n_out:])
    for k, t in enumerate(tapes):
        g.declare(t, g.dtype(node.inputs[2 + k]))
    n_iter = g.squeeze(g.slice(g.Shape(tapes[0]), [0], [1], [0]), [0])
    last = g.Sub(n_iter, g.const(1, dtype="int64"))

    d_state_in = [renamed(g, body.input[2 + k], f"d_state{k}") for k in range(n_state)]
    with_grad = [k for k in range(n_out) if dy[n_state + k] is not None]
    seeds = [(body.output[1 + k].name, d_state_in[k]) for k in range(n_state)]
    seed_out = [renamed(g, body.output[1 + n_state + k], f"d_out{k}") for k in with_grad]
    seeds += [(body.output[1 + n_state + k].name, v) for k, v in zip(with_grad, seed_out)]
    wanted = wanted_outer(node, body)
    acc_names = [name for _, name in wanted]
    nodes, grads, info = body_backward(g, body, body_in[2:] + acc_names, seeds, scope)
    acc_in, acc_nodes, acc_out = accumulators(g, acc_names, grads[n_state:])

    # the prologue: iteration j's inputs from the tape (iter_num, cond, carried values, output gradients)
    step, cond_in = g.fresh("i"), g.fresh("cond")
    prologue = loop_prologue(g, last, step, cond_in, body_in, tapes,
                             {v.name: dy[n_state + k] for v, k in zip(seed_out, with_grad)})
    new_out = [g.fresh(f"d_state_prev{k}") for k in range(n_state)]
    out_nodes, out_vis = output_nodes(new_out, grads[:n_state], info)
    cond_out = g.fresh("cond_out")
    out_nodes.append(pass_through(cond_in, cond_out))
    inputs = [scalar_input(step, TensorProto.INT64), scalar_input(cond_in, TensorProto.BOOL)] + d_state_in + acc_in
    outputs = [scalar_input(cond_out, TensorProto.BOOL)] + out_vis + acc_out
    bwd_body = make_body(prologue + nodes + acc_nodes + out_nodes, f"{body.name}_grad", inputs, outputs,
                         body.initializer)
    d_init = [dy[k] if dy[k] is not None else g.zeros_like(node.inputs[2 + k]) for k in range(n_state)]
    acc_init = [g.zeros_like(name) for name in acc_names]
    res = g.op("Loop", n_iter, "", *d_init, *acc_init, outputs=n_state + len(acc_names), body=bwd_body)
    res = list(res) if isinstance(res, tuple) else [res]
    for x, r in zip(node.inputs[2:] + acc_names, res):
        g.declare(r, g.dtype(x), g.shape(x))
    grads = [None, None] + [r if node.needs_grad(2 + k) else None for k, r in enumerate(res[:n_state])]
    return with_outer(g, grads, wanted, res[n_state:])


@gradient_rule("If", since=7)
def if_grad(g: GradBuilder, node: NodeView, dy: Grads) -> Grads:
    """Gradients of the outer-scope tensors the branches read, through the branch taken. A constant
    condition inlines that branch's backward; otherwise an If on the same condition holds the backward
    of each branch (reading the output gradients and forward tensors from the outer scope)."""
    branches = (node.attr("then_branch"), node.attr("else_branch"))
    wanted = wanted_outer(node, *branches)
    if not wanted:
        return []
    xs = [name for _, name in wanted]
    scope = g.scope
    cond = g.value(node.inputs[0])
    if cond is not None:
        taken = 0 if bool(np.asarray(cond).reshape(-1)[0]) else 1
        body = branches[taken]
        grads = inline_backward(g, body, xs, branch_seeds(g, node, body, dy), f"{scope}/{('then', 'else')[taken]}")
    else:
        then_g, else_g = (branch_backward(g, b, xs, branch_seeds(g, node, b, dy), f"{scope}/{tag}")
                          for b, tag in zip(branches, ("then", "else")))
        res = g.op("If", node.inputs[0], outputs=len(xs), then_branch=then_g, else_branch=else_g)
        grads = list(res) if isinstance(res, tuple) else [res]
    for x, d in zip(xs, grads):
        g.declare(d, g.dtype(x), g.shape(x))
    return with_outer(g, [None], wanted, grads)


# ---- tangents (forward mode) -----------------------------------------------------------------------
def _outer_tangents(node: NodeView, dx: Grads) -> dict[str, str]:
    """Outer-scope tensor the bodies read -> its tangent."""
    return {name: d for name, d in zip(node.outer_inputs, dx[len(node.inputs):]) if d}


def _named_outputs(g: GradBuilder, tangents: list[str], like: list, base: str) -> tuple[list, list, list]:
    """Identity nodes writing ``tangents`` into fresh body outputs typed like ``like`` (value infos)."""
    names = [g.fresh(f"{base}{k}") for k in range(len(tangents))]
    nodes = [pass_through(t, n) for t, n in zip(tangents, names)]
    vis = [value_info(n, type_of(v)) for n, v in zip(names, like)]
    return nodes, vis, names


@jvp_rule("If", since=7)
def if_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """An If on the same condition: each branch recomputes its values and pushes the tangents of the
    outer-scope tensors it reads through them (zeros for an output they do not reach)."""
    outer = _outer_tangents(node, dx)
    if not outer:
        return []
    made = []
    for tag in ("then", "else"):
        body = node.attr(f"{tag}_branch")
        nodes, outs, _ = body_jvp(g, body, outer, f"{g.scope}/{tag}")
        out_nodes, vis, _ = _named_outputs(g, outs, list(body.output), f"{tag}_tangent")
        made.append(make_body(nodes + out_nodes, f"{body.name}_jvp", [], vis))
    res = g.op("If", node.inputs[0], outputs=len(node.outputs), then_branch=made[0], else_branch=made[1])
    res = list(res) if isinstance(res, tuple) else [res]
    for o, r in zip(node.outputs, res):
        g.declare(r, g.dtype(o), g.shape(o))
    return res


def _tangent_inputs(g: GradBuilder, body_inputs, which: list[int], base: str) -> list:
    return [renamed(g, body_inputs[k], f"{base}{k}") for k in which]


def _jvp_results(g: GradBuilder, node: NodeView, res, n_state: int, states: list[int], n_out: int) -> Grads:
    """The tangents of a Scan's or Loop's outputs from the outputs of its JVP node (``res``: the ``n_state``
    carried values, the tangents of the float ones among them (``states``), the ``n_out`` scan outputs, then
    their tangents), declared with the types and shapes of the outputs they go with."""
    res = list(res) if isinstance(res, tuple) else [res]
    n_carried = n_state + len(states)
    by_state = dict(zip(states, res[n_state:n_carried]))
    result = [by_state.get(k) for k in range(n_state)] + res[n_carried + n_out:]
    for o, r in zip(node.outputs, result):
        if r is not None:
            g.declare(r, g.dtype(o), g.shape(o))
    return result


@jvp_rule("Scan", since=9)
def scan_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """A Scan over the same inputs whose body also carries the tangent of each float state and reads the
    tangents of the scan inputs that have one; its scan outputs' tangents are scanned out beside them."""
    body, n_scan, n_state, n_out, in_axes, in_dirs, out_axes, out_dirs = _scan_layout(node)
    states = [k for k in range(n_state) if g.dtype(node.inputs[k]) in FLOAT_TYPES]
    scanned = [j for j in range(n_scan) if dx[n_state + j]]
    d_state = _tangent_inputs(g, body.input, states, "d_state")
    d_scan = _tangent_inputs(g, body.input, [n_state + j for j in scanned], "d_x")
    tangents = {body.input[k].name: t.name for k, t in zip(states, d_state)}
    tangents.update({body.input[n_state + j].name: t.name for j, t in zip(scanned, d_scan)})
    tangents.update(_outer_tangents(node, dx))
    nodes, outs, _ = body_jvp(g, body, tangents, g.scope, d_state + d_scan)
    state_nodes, state_vis, _ = _named_outputs(g, [outs[k] for k in states], [body.output[k] for k in states],
                                               "d_state_next")
    out_nodes, out_vis, _ = _named_outputs(g, outs[n_state:], list(body.output[n_state:]), "d_y")
    inputs = list(body.input[:n_state]) + d_state + list(body.input[n_state:]) + d_scan
    outputs = list(body.output[:n_state]) + state_vis + list(body.output[n_state:]) + out_vis
    new_body = make_body(nodes + state_nodes + out_nodes, f"{body.name}_jvp", inputs, outputs)
    init = [dx[k] or g.zeros_like(node.inputs[k]) for k in states]
    res = g.op("Scan", *node.inputs[:n_state], *init, *node.inputs[n_state:], *[dx[n_state + j] for j in scanned],
               outputs=n_state + len(states) + 2 * n_out, body=new_body,
               num_scan_inputs=n_scan + len(scanned),
               scan_input_axes=in_axes + [in_axes[j] for j in scanned],
               scan_input_directions=in_dirs + [in_dirs[j] for j in scanned],
               scan_output_axes=out_axes + out_axes, scan_output_directions=out_dirs + out_dirs)
    return _jvp_results(g, node, res, n_state, states, n_out)


@jvp_rule("Loop", since=11)
def loop_jvp(g: GradBuilder, node: NodeView, dx: Grads) -> Grads:
    """A Loop with the same trip count and condition whose body also carries the tangent of each float
    loop-carried value; its scan outputs' tangents are stacked beside them."""
    body = node.attr("body")
    n_state = len(node.inputs) - 2
    n_out = len(body.output) - 1 - n_state
    states = [k for k in range(n_state) if g.dtype(node.inputs[2 + k]) in FLOAT_TYPES]
    d_state = _tangent_inputs(g, body.input, [2 + k for k in states], "d_state")
    tangents = {body.input[2 + k].name: t.name for k, t in zip(states, d_state)}
    tangents.update(_outer_tangents(node, dx))
    nodes, outs, _ = body_jvp(g, body, tangents, g.scope, d_state)
    state_nodes, state_vis, _ = _named_outputs(g, [outs[1 + k] for k in states],
                                               [body.output[1 + k] for k in states], "d_state_next")
    out_nodes, out_vis, _ = _named_outputs(g, outs[1 + n_state:], list(body.output[1 + n_state:]), "d_y")
    inputs = list(body.input) + d_state
    outputs = list(body.output[:1 + n_state]) + state_vis + list(body.output[1 + n_state:]) + out_vis
    new_body = make_body(nodes + state_nodes + out_nodes, f"{body.name}_jvp", inputs, outputs)
    init = [dx[2 + k] or g.zeros_like(node.inputs[2 + k]) for k in states]
    res = g.op("Loop", *node.inputs, *init, outputs=n_state + len(states) + 2 * n_out, body=new_body)
    return _jvp_results(g, node, res, n_state, states, n_out)
