"""Fixes to a bundle's one-graph step model for runtime quirks that are not a missing op: passes
``(model, ctx) -> bool`` that a runtime's record lists (``Target.step_fixes``, ``runtimes/targets.py``) and
``driver/bundle.py`` runs before writing ``step.onnx`` (``ctx.arrays``: the values of detached weights).

* ``transposed-shared-weight`` (OpenVINO 2026.4, CPU plugin): when one constant is the weight (input B)
  of two products that read it in different orientations (``x @ W`` and ``dy @ Transpose(W)``, or Gemm's
  transB), the second computes with the first one's orientation (silently where the weight is square;
  measured on a LoRA step of a tiny Llama, whose frozen base weights are constants that the backward reads
  transposed). We write the second product with the constant on the left, ``(W @ A^T)^T``, which
  OpenVINO computes right.
* ``shape-arithmetic-on-the-cpu`` (onnxruntime's WebGPU EP): ``Shape``, ``Size`` and the small integer
  arithmetic after them run on the CPU, each a fallback node between device kernels (the EP refuses a
  session with ``session.disable_cpu_ep_fallback`` while one is left). Where the shapes are static their
  values are known: we fold them into initializers.
* ``symbolic-value-info`` (tract 0.23.9): tract plans for concrete input shapes and then cannot unify a
  symbolic dim of an intermediate ``value_info`` (``B,S,64``) with the concrete one (``2,8,64``), nor a rank-0
  ``value_info`` of a product of scalar weights with the shape it infers (found by the conformance run's random
  graphs); we drop the intermediate value_info entries that hold a symbolic dim or have rank 0 (they are hints, not
  part of the step).
* ``counter-fed-as-int64`` (tract 0.23.9): tract types a ``Cast`` to int64 as its symbolic-dim type TDim, and so
  everything computed from one; its public API (Python, C) does not hand a TDim out ("Unsupported DatumType in the
  public API TDim"). The counter's next value, a host scalar fed as int32 and cast to the int64 state (for
  WebGPU, whose int64 Identity runs on the CPU and whose ``CastLike`` moves the layout Transposes there), is fed as
  int64 and passed through an Identity instead; the host scalar's dtype says so.
* ``bfloat16_in_float32`` (onnxruntime's CPU provider, any version to 1.32): no bfloat16 kernels beyond casts
  and data movement; ``TrainingSession`` on the CPU runs a bfloat16 step's arithmetic in float32 between Casts.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..graph import attr_value, fresh_name, infer_tensor_info, node_inputs, set_nodes, used_names
from ..model import metadata
from ..model.weights import is_detached
from .rewrite import Rule, apply_rules
from .static_shapes import shape_arithmetic_values


def drop_symbolic_value_info(model: onnx.ModelProto, ctx=None) -> bool:
    """tract: no intermediate value_info with a symbolic dim or of rank 0 (they are hints, not part of the step)."""
    kept = [vi for vi in model.graph.value_info if not _symbolic(vi)]
    if len(kept) == len(model.graph.value_info):
        return False
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)
    return True


def fold_static_shape_arithmetic(model: onnx.ModelProto, ctx=None) -> bool:
    """WebGPU: every node whose outputs are small integer tensors that static shapes and constants
    determine becomes initializers, and the nodes only they read go (module docstring)."""
    values = shape_arithmetic_values(model)
    g = model.graph
    folded = [n for n in g.node if n.output and all(o in values for o in n.output if o)]
    if not folded:
        return False
    gone = {id(n) for n in folded}
    g.initializer.extend(numpy_helper.from_array(np.asarray(values[o]), o) for n in folded for o in n.output if o)
    kept = [n for n in g.node if id(n) not in gone]
    needed = {o.name for o in g.output}
    live = []
    for n in reversed(kept):  # the nodes nothing reads any more: what only computed the folded values
        if any(o in needed for o in n.output):
            live.append(n)
            needed.update(node_inputs(n))
    del g.node[:]
    g.node.extend(reversed(live))
    used = needed | {i.name for i in g.input}
    inits = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(inits)
    return True


def counter_fed_as_int64(model: onnx.ModelProto, ctx=None) -> bool:
    """tract: a step output that is a Cast to int64 of a host scalar nothing else reads (the counter's next value) takes
    that host scalar fed as int64, through an Identity (module docstring); ``metadata.HOST_SCALARS`` says int64."""
    g = model.graph
    specs = metadata.read_json(model, metadata.HOST_SCALARS, {}) or {}
    outputs = {o.name for o in g.output}
    inputs = {i.name: i for i in g.input}
    readers: dict[str, int] = {}
    for n in g.node:
        for x in node_inputs(n):
            readers[x] = readers.get(x, 0) + 1
    changed = False
    for k, n in enumerate(g.node):
        fed = n.input[0] if n.op_type == "Cast" and n.input else None
        if (fed in specs and fed in inputs and readers.get(fed) == 1 and n.output[0] in outputs
                and attr_value(n, "to") == onnx.TensorProto.INT64 and "factors" not in specs[fed]):
            g.node[k].CopyFrom(helper.make_node("Identity", [fed], [n.output[0]], name=n.name))
            inputs[fed].type.tensor_type.elem_type = onnx.TensorProto.INT64
            specs[fed]["dtype"] = "int64"
            changed = True
    if changed:
        metadata.write(model, {metadata.HOST_SCALARS: json.dumps(specs)})
    return changed


def _symbolic(vi: onnx.ValueInfoProto) -> bool:
    t = vi.type.tensor_type
    return t.HasField("shape") and (not t.shape.dim or any(not d.HasField("dim_value") for d in t.shape.dim))


def _swap_last_two(rank: int) -> list[int]:
    return list(range(rank - 2)) + [rank - 1, rank - 2]


def _misoriented(graph: onnx.GraphProto) -> dict[str, tuple[str, str]]:
    """{node name: (weight, orientation)} of the MatMul/Gemm nodes that read a 2-D initializer as B in
    another orientation than its first use (the forward's): ``N`` for ``W``, ``T`` for ``W^T`` (through a
    Transpose node or Gemm's transB)."""
    inits = {t.name for t in graph.initializer if len(t.dims) == 2}
    producer = {o: n for n in graph.node for o in n.output}
    uses: dict[str, list] = {}
    for n in graph.node:
        if n.op_type not in ("MatMul", "Gemm") or n.domain not in ("", "ai.onnx") or len(n.input) < 2:
            continue
        b, flip = n.input[1], False
        p = producer.get(b)
        if p is not None and p.op_type == "Transpose" and list(attr_value(p, "perm", [])) in ([], [1, 0]):
            b, flip = p.input[0], True
        if b in inits:
            flip ^= n.op_type == "Gemm" and bool(attr_value(n, "transB", 0))
            uses.setdefault(b, []).append((n.name, "T" if flip else "N"))
    out = {}
    for w, found in uses.items():
        first = found[0][1]
        out.update({name: (w, o) for name, o in found if o != first})
    return out


def _wanted(node: onnx.NodeProto, facts, ctx) -> bool:
    if "misoriented" not in facts.memo:
        facts.memo["misoriented"] = _misoriented(facts.graph)
    return node.name in facts.memo["misoriented"]


def _left(g, w: str, orient: str) -> str:
    """``W_eff^T`` for a product that reads ``W_eff`` (``W`` itself when the product reads ``W^T``)."""
    return w if orient == "T" else g.Transpose(w, perm=[1, 0])


def _on_the_left(g, node: onnx.NodeProto, facts, ctx) -> list[str]:
    """``A @ W_eff`` (MatMul) or ``alpha op(A) W_eff`` (Gemm without C) as ``(W_eff^T @ A^T)^T``; where the
    rank of A is unknown or the Gemm adds C, the product reads a copy of the constant in the orientation it
    wants instead."""
    w, orient = facts.memo["misoriented"][node.name]
    a = node.input[0]
    rank = facts.rank(a)
    if node.op_type == "MatMul" and rank is not None and rank >= 2:
        perm = _swap_last_two(rank)
        return [g.Transpose(g.MatMul(_left(g, w, orient), g.Transpose(a, perm=perm)), perm=perm)]
    if node.op_type == "Gemm" and not (len(node.input) > 2 and node.input[2]):
        gemm = g.Gemm(_left(g, w, orient), a, alpha=float(attr_value(node, "alpha", 1.0)),
                      transB=0 if attr_value(node, "transA", 0) else 1)
        return [g.Transpose(gemm, perm=[1, 0])]
    t = next(t for t in facts.graph.initializer if t.name == w)
    arr = (ctx.arrays or {})[w] if is_detached(t) else numpy_helper.to_array(t)
    copy = g.const(np.ascontiguousarray(arr.T if orient == "T" else arr))
    attrs = {k: attr_value(node, k) for k in ("alpha", "beta", "transA") if attr_value(node, k) is not None}
    return [g.op(node.op_type, a, copy, *node.input[2:], **attrs)]


CONSTANT_ON_THE_LEFT = [Rule("MatMul", _on_the_left, _wanted), Rule("Gemm", _on_the_left, _wanted)]


def constant_weight_on_the_left(model: onnx.ModelProto, ctx) -> bool:
    """OpenVINO: each MatMul/Gemm that reads a constant weight in the other orientation than the weight's
    first use computes the product with the constant as its left operand (module docstring)."""
    if not apply_rules(model, CONSTANT_ON_THE_LEFT, ctx, "left"):
        return False
    g = model.graph
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    dead = [n for n in g.node if n.op_type == "Transpose" and not any(o in used for o in n.output)]
    for n in dead:
        g.node.remove(n)
    return True





_BF16_NATIVE = {"Cast", "Constant", "Shape", "Size", "Identity"}  # what runs on bfloat16 on any provider


def bfloat16_in_float32(model: onnx.ModelProto, ctx=None) -> bool:
    """onnxruntime's CPU provider has bfloat16 kernels for casts and data movement only (1.32: no Add, MatMul,
    Softmax, ...): every node of the step that reads or writes bfloat16 computes in float32 between Casts, so the
    values between nodes are still rounded to bfloat16 as a bfloat16 run keeps them, and products accumulate in
    float32 as bfloat16 matrix units do. The step's bfloat16 outputs become float32 (numpy has no bfloat16).
    ``TrainingSession`` runs this on the CPU only; a CUDA run keeps the bfloat16 kernels."""
    bf16, f32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
    info = infer_tensor_info(model)
    g = model.graph
    outputs = {o.name for o in g.output if o.type.tensor_type.elem_type == bf16}
    taken = used_names(model)
    nodes, changed = [], False
    for n in g.node:
        ins = [i for i in n.input if i and info.get(i) is not None and info[i].dtype == bf16]
        outs = [o for o in n.output if o and info.get(o) is not None and info[o].dtype == bf16]
        if n.op_type in _BF16_NATIVE or not (ins or outs) or n.domain not in ("", "ai.onnx"):
            nodes.append(n)
            continue
        changed = True
        wide = {}
        for i in dict.fromkeys(ins):
            wide[i] = fresh_name(taken, f"{i}/float32")
            nodes.append(helper.make_node("Cast", [i], [wide[i]], name=fresh_name(taken, f"{n.name}/widen"), to=f32))
        n.input[:] = [wide.get(i, i) for i in n.input]
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == bf16:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float32), a.t.name))
            elif a.type == onnx.AttributeProto.INT and a.name in ("to", "dtype", "output_dtype") and a.i == bf16:
                a.i = f32
        narrow = []
        for k, o in enumerate(n.output):
            if o in outs and o not in outputs:
                wide_out = fresh_name(taken, f"{o}/float32")
                n.output[k] = wide_out
                narrow.append(helper.make_node("Cast", [wide_out], [o], name=fresh_name(taken, f"{n.name}/narrow"),
                                               to=bf16))
        nodes += [n] + narrow
    for o in g.output:
        if o.name in outputs:
            o.type.tensor_type.elem_type = f32
            changed = True
    set_nodes(g, nodes)
    return changed


# the step fixes by the name a runtime's record (``runtimes/targets.py``) gives them
STEP_FIXES = {f.__name__: f for f in (drop_symbolic_value_info, fold_static_shape_arithmetic, counter_fed_as_int64,
                                      constant_weight_on_the_left)}


def step_fixes(target) -> list:
    """The passes ``target``'s record names in its ``step_fixes``, in its order."""
    return [STEP_FIXES[name] for name in target.step_fixes]


__all__ = ["STEP_FIXES", "step_fixes", "constant_weight_on_the_left", "drop_symbolic_value_info",
           "fold_static_shape_arithmetic",
           "bfloat16_in_float32"]
