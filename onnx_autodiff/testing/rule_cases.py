"""One-node rule cases: ``RuleCase`` describes a one-node model, ``check_rule_case`` lowers its gradient and
checks it against finite differences in float64, ``check_rule_case_jvp`` holds its forward mode against that
gradient. Every built-in rule has its cases in ``onnx_autodiff/conformance/cases/``; the random graphs of
``onnx_autodiff.testing.graphs`` are made from the same cases."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..check.gradcheck import GradcheckReport, gradcheck, jvp_check
from ..errors import GradcheckError
from ..graph import FLOAT_TYPES


@dataclass
class In:
    """One input of a rule case.

    Float inputs are sampled uniformly from [low, high], then pushed ``gap`` away from zero (to stay
    clear of kinks). ``value`` fixes the input (indices, shapes, axes): it becomes an initializer and is
    never differentiated. ``grad=False`` keeps a float input out of ``wrt``. ``dims`` overrides the
    declared shape (e.g. symbolic names) while ``shape`` is what is fed.
    """

    shape: Sequence[int] = ()
    low: float = -2.0
    high: float = 2.0
    gap: float = 0.0
    value: Any = None
    dtype: str = "float64"
    grad: bool = True
    dims: Sequence[Any] | None = None
    const: bool = False  # a float input held as an initializer that is not differentiated

    def sample(self, rng: np.random.Generator) -> np.ndarray:
        if self.value is not None:
            arr = np.asarray(self.value)
            return arr.astype(self.dtype) if self.dtype != "float64" else arr
        x = rng.uniform(self.low, self.high, size=tuple(self.shape))
        if self.gap:
            x = np.sign(x + (x == 0)) * (np.abs(x) + self.gap)
        return np.asarray(x, dtype=self.dtype)


@dataclass
class RuleCase:
    """A one-node model whose gradient is checked by finite differences."""

    op: str
    inputs: Sequence[In | None]
    attrs: dict = field(default_factory=dict)
    opset: int = 17
    domain: str = ""
    outputs: int = 1
    check_outputs: Sequence[int] | None = None  # which outputs feed the check (default: every float one)
    id: str = ""
    rtol: float = 1e-5
    atol: float = 1e-8
    eps: float = 1e-6
    extra_opsets: dict = field(default_factory=dict)
    # False for an op onnxruntime runs in float32 only (contrib ops): the check runs in the case's own types,
    # with eps / rtol chosen for float32 rounding
    float64: bool = True
    # the other way for such an op: ``reference(node) -> nodes``, a standard-ONNX form that writes the node's
    # outputs. It must give what onnxruntime's kernel gives in the case's types (within forward_rtol /
    # forward_atol), then stands in for the kernel in the float64 check (the backward stays the rule's)
    reference: Callable[[onnx.NodeProto], list[onnx.NodeProto]] | None = None
    forward_rtol: float = 1e-5
    forward_atol: float = 1e-6

    @property
    def name(self) -> str:
        return f"{self.op}-{self.id}" if self.id else self.op


def rule_case_model(case: RuleCase, seed: int = 0):
    """(model, feeds, wrt) for a rule case: graph inputs for the differentiated tensors, initializers
    for the fixed ones."""
    rng = np.random.default_rng(seed)
    inputs, inits, feeds, wrt, names = [], [], {}, [], []
    for k, spec in enumerate(case.inputs):
        if spec is None:
            names.append("")
            continue
        name = f"x{k}"
        names.append(name)
        arr = spec.sample(rng)
        fixed = spec.value is not None or spec.const
        if fixed:
            inits.append(numpy_helper.from_array(arr, name))
            continue
        dt = helper.np_dtype_to_tensor_dtype(arr.dtype)
        inputs.append(helper.make_tensor_value_info(name, dt, list(spec.dims or arr.shape)))
        feeds[name] = arr
        if spec.grad and np.issubdtype(arr.dtype, np.floating):
            wrt.append(name)
    while names and names[-1] == "":
        names.pop()
    outs = [f"y{k}" for k in range(case.outputs)]
    node = helper.make_node(case.op, names, outs, name="node", domain=case.domain or None, **case.attrs)
    opsets = [helper.make_opsetid("", case.opset)]
    if case.domain:
        opsets.append(helper.make_opsetid(case.domain, case.extra_opsets.get(case.domain, 1)))
    graph = helper.make_graph([node], case.name, inputs,
                              [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in outs],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=opsets)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    del model.graph.output[:]
    model.graph.output.extend(inferred.graph.output)
    if any(not o.type.tensor_type.elem_type for o in model.graph.output):
        _declare_outputs_by_running(model, feeds)
    model.ir_version = 10
    return model, feeds, wrt


def _declare_outputs_by_running(model: onnx.ModelProto, feeds) -> None:
    """Type the outputs onnx cannot infer (an op onnx has no schema for, such as onnxruntime's contrib
    ops) from one onnxruntime run."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for o in probe.graph.output:
        o.ClearField("type")
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    values = sess.run(None, feeds)
    for o, v in zip(list(model.graph.output), values):
        o.CopyFrom(helper.make_tensor_value_info(o.name, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape))


def check_rule_case(case: RuleCase, seed: int = 0) -> GradcheckReport:
    """Gradcheck one rule case (raises GradcheckError on a mismatch). A case with a ``reference`` first
    checks it against onnxruntime's kernel, then gradchecks in float64 with it in the kernel's place."""
    model, feeds, wrt = rule_case_model(case, seed)
    of = [model.graph.output[k].name for k in (case.check_outputs if case.check_outputs is not None
                                               else range(case.outputs))
          if model.graph.output[k].type.tensor_type.elem_type in FLOAT_TYPES]
    expand = None
    if case.reference is not None:
        expand = substitute(case.reference)
        check_reference(case, model, expand, feeds)
    return gradcheck(model, feeds, wrt=wrt, of=of, eps=case.eps, rtol=case.rtol, atol=case.atol, seed=seed,
                     float64=case.float64, expand=expand)


def substitute(reference: Callable[[onnx.NodeProto], list[onnx.NodeProto]], name: str = "node"):
    """``expand(model) -> model``: a copy with the nodes ``reference`` gives in place of node ``name``."""
    def expand(model: onnx.ModelProto) -> onnx.ModelProto:
        out = onnx.ModelProto()
        out.CopyFrom(model)
        nodes = []
        for n in out.graph.node:
            nodes.extend(reference(n) if n.name == name else [n])
        del out.graph.node[:]
        out.graph.node.extend(nodes)
        return out

    return expand


def check_reference(case: RuleCase, model: onnx.ModelProto, expand, feeds) -> None:
    """GradcheckError unless the case's reference form gives onnxruntime's outputs on ``feeds``."""
    import onnxruntime as ort

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)

    for out, kernel, ref in zip(model.graph.output, run(model), run(expand(model))):
        if not np.allclose(ref, kernel, rtol=case.forward_rtol, atol=case.forward_atol):
            err = float(np.max(np.abs(np.asarray(ref, np.float64) - kernel)))
            raise GradcheckError(f"{case.name}: the reference form's {out.name} differs from onnxruntime's kernel "
                                 f"by up to {err:.3g} (rtol {case.forward_rtol:g}, atol {case.forward_atol:g})")


def check_rule_case_jvp(case: RuleCase, seed: int = 0) -> GradcheckReport:
    """The forward mode of one rule case against its reverse mode: <J u, v> = <u, J^T v> exactly (up to
    rounding), no finite differences (raises GradcheckError on a mismatch)."""
    model, feeds, wrt = rule_case_model(case, seed)
    of = [model.graph.output[k].name for k in (case.check_outputs if case.check_outputs is not None
                                               else range(case.outputs))
          if model.graph.output[k].type.tensor_type.elem_type in FLOAT_TYPES]
    rtol = 1e-7 if case.float64 else 1e-4
    expand = substitute(case.reference) if case.reference is not None else None
    return jvp_check(model, feeds, wrt=wrt, of=of, seed=seed, float64=case.float64, rtol=rtol, expand=expand)
