"""``jacobian(model, of, wrt)``: the model plus dense Jacobians ``d<of>/d<w>``, one plain ONNX model.

Every column of a Jacobian is a JVP along one basis vector of w. The model computes its values once; a
Scan over the rows of an identity matrix (built at run time, EyeLike, so it costs no stored constant and
follows a symbolic w) runs the tangent nodes only, one basis vector per iteration, reading the values from
the outer scope: one session run gives the whole Jacobian. Tangent nodes that do not depend on the tangent
(local derivatives, masks) stay outside the Scan, computed once.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import onnx
from onnx import TensorProto, helper

from ..engine.forward import jvp_nodes
from ..errors import ForwardSpecError, OpsetTooOldError
from ..graph import (
    FLOAT_TYPES,
    TensorInfo,
    finalize,
    fresh_name,
    name_nodes,
    node_inputs,
    set_nodes,
    topological_sort,
    used_names,
)
from ..model.weights import attach_weights, check_model, split_model
from .common import as_model, check_free, checked_wrt, names_of, prepared, tensor_info, upgraded, value_info


def jacobian_name(of: str, w: str) -> str:
    return f"d{of}/d{w}"


def jacobian(model: onnx.ModelProto | str | os.PathLike, of: str | Sequence[str], wrt: str | Sequence[str]
             ) -> onnx.ModelProto:
    """The model plus, for each output y in ``of`` and each w in ``wrt`` (float graph inputs or
    initializers), an output ``d<y>/d<w>`` of shape ``y.shape + w.shape``: the dense Jacobian, entry
    [i..., j...] = d y[i...] / d w[j...]. For small models: it holds numel(w) * numel(y) numbers, and the
    model runs one JVP per element of w (a Scan inside the model, so one session run gives it all).
    The original outputs stay; a name the result would take that the model uses raises ForwardSpecError.
    """
    base = as_model(model)
    wrt = checked_wrt(base, wrt, "jacobian")
    ofs = names_of(of, "jacobian: of")
    info = tensor_info(base)
    outputs = [o.name for o in base.graph.output]
    for y in ofs:
        if y not in outputs:
            raise ForwardSpecError(f"jacobian: of names {y!r}, which is not a graph output; outputs: {outputs}")
        if info[y].dtype not in FLOAT_TYPES:
            raise ForwardSpecError(f"jacobian: of names {y!r}, which is not floating point")
    check_free(base, [jacobian_name(y, w) for w in wrt for y in ofs], "jacobian",
               "rename those tensors in the model first")
    light, weights = split_model(base)
    out = upgraded(light, lambda m: _with_jacobians(m, ofs, wrt))
    attach_weights(out, weights)
    return out


def _with_jacobians(light: onnx.ModelProto, ofs: list[str], wrt: list[str]) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(light)
    name_nodes(m)
    info = tensor_info(m)
    taken = used_names(m) | {jacobian_name(y, w) for w in wrt for y in ofs}
    view = prepared(m, wrt, ofs, taken)
    if view.opset("") < 9:
        raise OpsetTooOldError("jacobian: the Scan over the basis vectors (Scan, EyeLike) needs opset 9", needs=9)
    added, outs = [], []
    for w in wrt:
        nodes, jac = _jacobian_of(view, w, ofs, info, taken)
        added += nodes
        outs += [value_info(j, TensorInfo(info[y].dtype, _joined(info[y].shape, info[w].shape)))
                 for j, y in zip(jac, ofs)]
    g = m.graph
    set_nodes(g, topological_sort(list(g.node) + added))
    g.output.extend(outs)
    finalize(m)
    check_model(m)
    return m


def _joined(a, b):
    return None if a is None or b is None else tuple(a) + tuple(b)


def _jacobian_of(view, w: str, ofs: list[str], info: dict, taken: set[str]) -> tuple[list, list[str]]:
    """The nodes giving d<y>/d<w> for each y in ``ofs``: the tangent nodes split into those that read the
    tangent (the Scan body) and those that do not (outside), the basis, the Scan, the reshape."""
    scope = f"jacobian/{w}"

    def fresh(base: str) -> str:
        return fresh_name(taken, f"{scope}/{base}")

    tangent = fresh("e")
    rows = [fresh(f"row{k}") for k in range(len(ofs))]
    nodes = jvp_nodes(view, [w], [tangent], ofs, rows, taken=taken, scope=scope, where="jacobian")
    inside, outside = _split(nodes, tangent)
    body_nodes = list(inside)
    produced = {o for n in inside for o in n.output if o}
    for k, r in enumerate(rows):
        if r not in produced:  # a tangent that does not depend on w (zeros): pass it through the body
            outer = fresh(f"outer_row{k}")
            for n in outside:
                n.output[:] = [outer if o == r else o for o in n.output]
            body_nodes.append(helper.make_node("Identity", [outer], [r], name=fresh(f"pass{k}")))
    dtype = info[w].dtype
    body = helper.make_graph(
        body_nodes, f"{scope}/body".replace("/", "_"),
        [value_info(tangent, info[w])],
        [value_info(r, TensorInfo(info[y].dtype, info[y].shape)) for r, y in zip(rows, ofs)])

    made = []

    def node(op, inputs, n_out=1, **attrs):
        outs = [fresh(op) for _ in range(n_out)]
        made.append(helper.make_node(op, inputs, outs, name=fresh(f"{op}_node"), **attrs))
        return outs[0] if n_out == 1 else outs

    def ints(values):
        return node("Constant", [], value=helper.make_tensor(fresh("ints"), TensorProto.INT64, [len(values)], values))

    size = node("Reshape", [node("Size", [w]), ints([1])])
    zeros = node("ConstantOfShape", [node("Concat", [size, size], axis=0)],
                 value=helper.make_tensor("zero", dtype, [1], [0]))
    basis = node("Reshape", [node("EyeLike", [zeros]), node("Concat", [size, node("Shape", [w])], axis=0)])
    stacked = node("Scan", [basis], n_out=len(ofs), body=body, num_scan_inputs=1)
    stacked = [stacked] if isinstance(stacked, str) else stacked
    names = []
    for y, s in zip(ofs, stacked):
        flat = node("Reshape", [s, node("Concat", [size, ints([-1])], axis=0)])
        shape = node("Concat", [node("Shape", [y]), node("Shape", [w])], axis=0)
        name = jacobian_name(y, w)
        made.append(helper.make_node("Reshape", [node("Transpose", [flat], perm=[1, 0]), shape], [name],
                                     name=fresh("out")))
        names.append(name)
    return outside + made, names


def _split(nodes: list[onnx.NodeProto], tangent: str) -> tuple[list, list]:
    """(the nodes that depend on ``tangent``, the others), each in the given order."""
    reach = {tangent}
    inside, outside = [], []
    for n in nodes:
        if any(i in reach for i in node_inputs(n)):
            inside.append(n)
            reach.update(o for o in n.output if o)
        else:
            outside.append(n)
    return inside, outside
