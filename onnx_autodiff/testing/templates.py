"""How to make a valid node of each op, read from its rule cases and its ONNX schema (no table of our own).

A rule case is one valid node: op, attributes, opset, and for each input a shape and a value range (``In``).
``node_templates`` turns each case into a ``NodeTemplate`` that random graphs place anywhere:

- the case's inputs become slots: ``feed`` (a float input the case differentiates: a random graph feeds it
  one of its own tensors), ``input`` (a float input the case does not differentiate: a fresh graph input),
  ``const`` (indices, axes, constant floats: an initializer of the case's value) or ``absent``;
- one run of the node gives the output shapes, and says whether the op is elementwise (its outputs have
  the broadcast shape of the fed inputs, and the schema says multidirectional broadcasting where there are
  several: such a node takes any shapes of rank 0-4 that broadcast);
- the schema names the attribute space beyond the case: FLOAT attributes (scaled), INT flags with a
  default of 0 or 1 (flipped), ``axis`` of an elementwise op (any axis of the rank);
- the op's own backward says whether it is piecewise (it compares values, or reads argmax-like indices): a
  random graph keeps such an op's inputs apart from ties (``piecewise``).

``run_nodes`` evaluates nodes the way gradcheck will (onnxruntime, and onnx's reference evaluator where
onnxruntime has no kernel for the type): a node that neither runs is not a valid node.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import defs, helper

from ..graph import FLOAT_TYPES, node_inputs
from ..ort_options import session_options
from .rule_cases import RuleCase, rule_case_model

# ops whose presence in a backward means the gradient jumps somewhere (at ties or at fixed points)
PIECEWISE_OPS = frozenset({
    "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Sign", "Not", "And", "Or", "Xor", "Where",
    "ArgMax", "ArgMin", "TopK", "Floor", "Ceil", "Round", "Abs", "Relu", "Max", "Min", "Clip", "MaxPool",
    "MaxUnpool", "Mod", "IsNaN", "IsInf",
})


@dataclass(frozen=True)
class Slot:
    """One input of a template: ``kind`` is "feed", "input", "const" or "absent" (see the module doc)."""

    kind: str
    shape: tuple[int, ...] = ()
    spec: object = None  # the case's In
    value: np.ndarray | None = None  # a const slot's value


@dataclass(frozen=True, eq=False)
class NodeTemplate:
    """A valid node of one op, from one rule case: what a random graph needs to place it."""

    case: RuleCase
    slots: tuple[Slot, ...]
    outputs: tuple[int, ...]  # the float outputs that join a graph's tensors (the case's checked ones)
    output_shapes: tuple[tuple[int, ...], ...]  # of every output, at the case's shapes
    elementwise: bool
    since: int  # the op's schema version at the case's opset
    float_attrs: tuple[tuple[str, float], ...]  # (name, value in the case or the schema's default)
    flag_attrs: tuple[tuple[str, int], ...]  # INT attributes whose default is 0 or 1: (name, value)
    has_axis: bool

    @property
    def op(self) -> str:
        return self.case.op

    @property
    def domain(self) -> str:
        return self.case.domain

    @property
    def name(self) -> str:
        return self.case.name

    def usable_at(self, opset: int) -> bool:
        """Whether the case's node may be valid at ``opset``: the op exists there with the case's attributes and
        as many inputs (a new version for new types keeps the node valid; a graph runs each node it places, so
        one that is not valid there is taken back)."""
        return _usable(self.op, self.domain, opset, tuple(sorted(self.case.attrs)), len(self.slots))

    @property
    def piecewise(self) -> bool:
        """Whether the op's backward compares values or reads indices (its gradient jumps somewhere)."""
        return _piecewise(self)


@functools.cache
def _usable(op: str, domain: str, opset: int, attrs: tuple[str, ...], inputs: int) -> bool:
    if _since(op, opset, domain) is None:
        return False
    schema = defs.get_schema(op, opset, domain)
    return set(attrs) <= set(schema.attributes) and inputs <= schema.max_input


def _since(op: str, opset: int, domain: str = "") -> int | None:
    try:
        return defs.get_schema(op, opset, domain).since_version
    except Exception:  # onnx raises SchemaError for an op that does not exist at that opset
        return None


def node_templates(cases: Sequence[RuleCase]) -> list[NodeTemplate]:
    """A template per rule case a float64 graph can hold (cases checked in their own float32 types, and
    cases whose node does not run or has nothing to feed, are left out)."""
    out = []
    for case in cases:
        t = _template(case)
        if t is not None:
            out.append(t)
    return out


def _template(case: RuleCase) -> NodeTemplate | None:
    if not case.float64 or _since(case.op, case.opset, case.domain) is None:
        return None
    model, feeds, wrt = rule_case_model(case)
    slots = []
    for k, spec in enumerate(case.inputs):
        name = f"x{k}"
        if spec is None:
            slots.append(Slot("absent"))
        elif name in wrt:
            slots.append(Slot("feed", tuple(spec.shape), spec))
        elif name in feeds and np.issubdtype(feeds[name].dtype, np.floating):
            slots.append(Slot("input", tuple(spec.shape), spec))
        else:
            init = {t.name: t for t in model.graph.initializer}[name]
            slots.append(Slot("const", value=onnx.numpy_helper.to_array(init)))
    while slots and slots[-1].kind == "absent":
        slots.pop()
    if not any(s.kind == "feed" for s in slots):
        return None
    checked = case.check_outputs if case.check_outputs is not None else range(case.outputs)
    outputs = tuple(k for k in checked if model.graph.output[k].type.tensor_type.elem_type in FLOAT_TYPES)
    try:
        values = run_nodes(list(model.graph.node), feeds, model.opset_import,
                           {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer})
    except Exception:
        return None
    shapes = tuple(np.shape(values[o.name]) for o in model.graph.output)
    if not outputs or any(0 in shapes[k] for k in outputs):
        return None
    schema = defs.get_schema(case.op, case.opset, case.domain)
    fed = [s.shape for s in slots if s.kind == "feed"]
    elementwise = (all(s.kind in ("feed", "absent") for s in slots) and len(outputs) == 1
                   and shapes[outputs[0]] == _broadcast(fed)
                   and (len(fed) == 1 or "multidirectional" in schema.doc))
    floats, flags = [], []
    for name, a in schema.attributes.items():
        given = case.attrs.get(name)
        default = a.default_value if a.default_value.name else None
        if a.type == defs.OpSchema.AttrType.FLOAT and (given is not None or default is not None):
            floats.append((name, float(given if given is not None else default.f)))
        elif a.type == defs.OpSchema.AttrType.INT:
            value = given if given is not None else (default.i if default is not None else None)
            if default is not None and default.i in (0, 1) and value in (0, 1):
                flags.append((name, int(value)))
    has_axis = elementwise and "axis" in schema.attributes and len(fed) == 1
    return NodeTemplate(case, tuple(slots), outputs, shapes, elementwise, schema.since_version, tuple(floats),
                        tuple(flags), has_axis)


def _broadcast(shapes) -> tuple[int, ...] | None:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        return None


@functools.cache
def _piecewise_by_id(key) -> bool:
    template = _BY_ID[key]
    from ..passes.pipeline import lower

    if template.op in PIECEWISE_OPS:
        return True
    model, _, wrt = rule_case_model(template.case)
    g = model.graph
    terms = []
    for k in template.outputs:
        terms.append(f"fuzz/sum{k}")
        g.node.append(helper.make_node("ReduceSum", [g.output[k].name], [terms[-1]], keepdims=0))
    g.node.append(helper.make_node("Sum", terms, ["fuzz/y"]))
    g.node.append(helper.make_node("Gradient", wrt, [f"fuzz/d{w}" for w in wrt], domain="ai.onnx.preview.training",
                                   xs=wrt, y="fuzz/y"))
    del g.output[:]
    g.output.extend(helper.make_tensor_value_info(f"fuzz/d{w}", onnx.TensorProto.UNDEFINED, None) for w in wrt)
    model.opset_import.append(helper.make_opsetid("ai.onnx.preview.training", 1))
    try:
        lowered = lower(model, check=False)
    except Exception:
        return True  # the check itself will say what is wrong; keep the inputs apart meanwhile
    return any(n.op_type in PIECEWISE_OPS for n in lowered.graph.node[len(g.node) - 2:])


_BY_ID: dict[int, NodeTemplate] = {}


def _piecewise(template: NodeTemplate) -> bool:
    _BY_ID[id(template)] = template
    return _piecewise_by_id(id(template))


# how onnxruntime says it has no kernel for an op at these types (not that the node is invalid)
_NO_KERNEL = ("NOT_IMPLEMENTED", "Could not find an implementation", "does not support double")


def run_nodes(nodes: Sequence[onnx.NodeProto], feeds: dict[str, np.ndarray], opsets,
              constants: dict[str, np.ndarray] | None = None, used: list[str] | None = None) -> dict[str, np.ndarray]:
    """Every output of ``nodes`` (in order, reading ``feeds`` and ``constants``) by onnxruntime, or by onnx's
    reference evaluator where onnxruntime has no kernel for an op at these types; raises when neither runs.
    ``used`` gets the name of the runtime that ran them."""
    values = {**(constants or {}), **feeds}
    made = {o for n in nodes for o in n.output if o}
    read = [i for n in nodes for i in node_inputs(n) if i and i not in made]
    inputs = [helper.make_tensor_value_info(i, helper.np_dtype_to_tensor_dtype(np.asarray(values[i]).dtype),
                                            np.shape(values[i])) for i in dict.fromkeys(read)]
    outputs = [onnx.ValueInfoProto(name=o) for n in nodes for o in n.output if o]  # untyped: whatever the node makes
    model = helper.make_model(helper.make_graph(list(nodes), "run", inputs, outputs), opset_imports=list(opsets))
    model.ir_version = 10
    given = {i.name: np.asarray(values[i.name]) for i in inputs}
    names = [o.name for o in outputs]
    try:
        import onnxruntime as ort

        so = session_options(graph_optimization_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL, log_severity_level=4)
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        out = dict(zip(names, sess.run(names, given)))
        if used is not None:
            used.append("onnxruntime")
        return out
    except Exception as e:
        if not any(m in str(e) for m in _NO_KERNEL):
            raise
    from onnx.reference import ReferenceEvaluator

    out = dict(zip(names, ReferenceEvaluator(model).run(names, given)))
    if used is not None:
        used.append("onnx.reference")
    return out
