"""If, Loop and Scan nodes in the random graphs of ``graphs.py``: a few templates placed in a body that reads the
outer graph (a child of the graph's builder), wrapped in the control-flow node."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper


class Invalid(Exception):
    """A node that does not run, or makes values a graph should not hold: it is taken back."""


def _body(b, templates, inputs: list[tuple[str, np.ndarray]]):
    """A child builder whose pool holds the body's inputs first (and the outer graph's tensors), with
    one or two templates placed."""
    child = type(b)(b.draw, b.rng, b.opset, b.names, b.symbolic, outer=b)
    for name, value in inputs:
        child.values[name] = value
        if np.issubdtype(np.asarray(value).dtype, np.floating):
            child.pool.append(name)
    for _ in range(b.draw(b.st.integers(1, 2))):
        child.place(b.draw(b.st.sampled_from(templates)))
    if not child.made:
        raise Invalid("empty body")
    return child


def _graph_of(child, inputs, outputs, name: str) -> onnx.GraphProto:
    vis = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.asarray(v).dtype), np.shape(v))
           for n, v in inputs]
    outs = [helper.make_tensor_value_info(o, helper.np_dtype_to_tensor_dtype(child.values[o].dtype),
                                          np.shape(child.values[o])) for o in outputs]
    return helper.make_graph(child.nodes, name, vis, outs, child.inits)


def place_control(b, templates) -> bool:
    kind = b.draw(b.st.sampled_from(["If", "Loop", "Scan"]))
    mark = b.mark()
    try:
        out = {"If": _place_if, "Loop": _place_loop, "Scan": _place_scan}[kind](b, templates)
    except Invalid:
        b.rollback(mark)
        return False
    b.placed.append(out)
    return True


def _place_if(b, templates) -> str:
    st = b.st
    then = _body(b, templates, [])
    y = then.made[-1]
    shape = tuple(np.shape(then.values[y]))
    then_out = then.add("Identity", [y])[0]
    other = _body(b, templates, [])
    else_out = other.add("Tanh", [other.reshape_to(other.made[-1], shape)])[0]
    value = b.draw(st.booleans())
    cond = b.bool_input(value) if b.draw(st.booleans()) else b.const(np.array(value))
    out = b.add("If", [cond], then_branch=_graph_of(then, [], [then_out], "then"),
                   else_branch=_graph_of(other, [], [else_out], "else"))[0]
    b.pool.append(out)
    b.made.append(out)
    return f"If[{', '.join(then.placed)} | {', '.join(other.placed)}]"


def _place_loop(b, templates) -> str:
    st = b.st
    init = b.draw(st.sampled_from(b.pool))
    v0 = b.values[init]
    it, cond, v = b.names.fresh("iter"), b.names.fresh("cond"), b.names.fresh("v")
    inputs = [(it, np.array(0, np.int64)), (cond, np.array(True)), (v, v0)]
    child = _body(b, templates, inputs)
    nxt = child.add("Tanh", [child.add("Add", [child.reshape_to(child.made[-1], np.shape(v0)), v])[0]])[0]
    cond_out = child.add("Identity", [cond])[0]
    # a body output listed twice (state and scan output) makes onnxruntime 1.32 return uninitialized memory
    scan_out = child.made[-2] if len(child.made) > 1 else child.add("Identity", [nxt])[0]
    outputs = [cond_out, nxt] + ([scan_out] if b.draw(st.booleans()) else [])
    trips = b.ints(np.array(b.draw(st.integers(1, 3))))
    # an explicit condition: onnx's reference evaluator runs no iteration of a Loop without one
    outs = b.add("Loop", [trips, b.const(np.array(True)), init], len(outputs) - 1,
                    body=_graph_of(child, inputs, outputs, "loop_body"))
    b.pool.extend(outs)
    b.made.extend(outs)
    return f"Loop[{', '.join(child.placed)}]"


def _place_scan(b, templates) -> str:
    st = b.st
    seqs = [p for p in b.pool if 1 <= len(b.shape(p)) and b.shape(p)[0] <= 4]
    if not seqs:
        raise Invalid("nothing to scan")
    xs, init = b.draw(st.sampled_from(seqs)), b.draw(st.sampled_from(b.pool))
    s, x = b.names.fresh("s"), b.names.fresh("x_t")
    inputs = [(s, b.values[init]), (x, b.values[xs][0])]
    child = _body(b, templates, inputs)
    nxt = child.add("Tanh", [child.add("Add", [child.reshape_to(child.made[-1], b.shape(init)), s])[0]])[0]
    y = child.made[-2] if len(child.made) > 1 else child.add("Identity", [nxt])[0]
    reverse = b.draw(st.booleans())
    outs = b.add("Scan", [init, xs], 2, num_scan_inputs=1, scan_input_directions=[int(reverse)],
                    body=_graph_of(child, inputs, [nxt, y], "scan_body"))
    b.pool.extend(outs)
    b.made.extend(outs)
    return f"Scan[{', '.join(child.placed)}]"
