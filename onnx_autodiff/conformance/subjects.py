"""What a conformance run puts through a runtime: every rule case (``cases/``), random graphs, and probes of
features a runtime may refuse although it has the op.

Random graphs: a source is ``(count, seed) -> subjects`` (``SOURCES``; ``conformance --graphs-from``).
``chain_graphs`` (the default, ``GRAPHS``): chains of 2-7 ops over x [N, F] (N symbolic) drawn from unary
elementwise ops, broadcasting binary ops against weights or other tensors, products with weights and of two
computed tensors (``Q @ Transpose(K)``, then ``@ V``), reductions and Softmax, every input and weight
differentiated; numpy draws them, so they stay the same across library versions and a table's diff means the
runtime changed. ``registry_graphs``: the registry fuzz of ``onnx_autodiff.testing`` (``rule_graphs``: graphs of
every rule case's op, control flow too), drawn by hypothesis with a fixed seed (a hypothesis upgrade may draw
others). A subject of kind "graph" names its ops for the table.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..graph import FLOAT_TYPES
from ..runtimes.targets import RUN_TIME_AXES, attribute_text
from .run import Subject

D = TensorProto.DOUBLE
_UNORDERED = {"TopK": ("sorted", 0)}  # outputs in an order the spec leaves to the runtime: not comparable


def comparable(case) -> bool:
    """Whether a runtime's outputs can be held against the reference's (not a TopK with sorted=0)."""
    attr = _UNORDERED.get(case.op)
    return attr is None or case.attrs.get(attr[0], 1) != attr[1]


def case_subject(case) -> Subject:
    """A rule case (``testing.RuleCase``) as a subject."""
    from ..testing import rule_case_model, substitute

    model, feeds, wrt = rule_case_model(case)
    of = [model.graph.output[k].name for k in (case.check_outputs if case.check_outputs is not None
                                               else range(case.outputs))
          if model.graph.output[k].type.tensor_type.elem_type in FLOAT_TYPES]
    attrs = {k: attribute_text(v) for k, v in sorted(case.attrs.items())}
    return Subject(case.name, "case", [case.op], model, feeds, wrt, of, attrs=attrs,
                   domain=case.domain, expand=substitute(case.reference) if case.reference else None,
                   float64=case.float64, opset=case.opset,
                   forward_tolerance=(case.forward_rtol, case.forward_atol) if case.reference else (0.0, 0.0))


def case_subjects(ops=None) -> Iterator[Subject]:
    from .cases import all_cases

    for case in all_cases():
        if (ops is None or case.op in ops) and comparable(case):
            yield case_subject(case)


class _Chain:
    def __init__(self, rng: np.random.Generator):
        self.rng, self.nodes, self.inits, self.n = rng, [], [], 0

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        self.n += 1
        out = f"t{self.n}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=f"n{self.n}", **attrs))
        return out

    def weight(self, shape, low=-1.0, high=1.0) -> str:
        self.n += 1
        name = f"w{self.n}"
        self.inits.append(numpy_helper.from_array(self.rng.uniform(low, high, size=shape), name))
        return name

    def ints(self, values) -> str:
        self.n += 1
        name = f"c{self.n}"
        self.inits.append(numpy_helper.from_array(np.asarray(values, np.int64), name))
        return name


def chain_graph(index: int, seed: int = 0) -> Subject:
    """One random chain (module docstring): deterministic in (seed, index)."""
    rng = np.random.default_rng([seed, index])
    g = _Chain(rng)
    features = int(rng.integers(1, 5))
    pool = [("x", features)]  # (tensor, last dim); every tensor is [N, d]
    for _ in range(int(rng.integers(2, 8))):
        a, d = pool[int(rng.integers(len(pool)))]
        kind = rng.choice(["unary", "binary", "binary", "matmul", "attention", "reduce", "softmax"])
        if kind == "unary":
            op = str(rng.choice(["Tanh", "Sigmoid", "Neg", "Softplus", "Sin", "ExpTanh", "Square"]))
            out = (g.op("Exp", g.op("Tanh", a)) if op == "ExpTanh" else g.op("Mul", a, a) if op == "Square"
                   else g.op(op, a))
            pool.append((out, d))
        elif kind == "binary":
            op = str(rng.choice(["Add", "Sub", "Mul", "SafeDiv"]))
            partners = [(n, e) for n, e in pool if e in (d, 1) or d == 1]
            choice = rng.choice(["weight_d", "weight_1d", "scalar", "tensor"])
            if choice == "tensor":
                b, e = partners[int(rng.integers(len(partners)))]
            else:
                b, e = g.weight({"weight_d": (d,), "weight_1d": (1, d), "scalar": ()}[str(choice)]), d
            if rng.random() < 0.5:
                a, b = b, a
            if op == "SafeDiv":  # a / (1 + b*b)
                out = g.op("Div", a, g.op("Add", g.op("Mul", b, b), g.weight((), 1.0, 1.0)))
            else:
                out = g.op(op, a, b)
            pool.append((out, max(d, e)))
        elif kind == "matmul":
            e = int(rng.integers(1, 5))
            pool.append((g.op("MatMul", a, g.weight((d, e))), e))
        elif kind == "attention":  # softmax(Q K^T) V of computed Q, K, V: products of computed tensors
            k = int(rng.integers(1, 4))
            b, e = pool[int(rng.integers(len(pool)))]
            q, key = g.op("MatMul", a, g.weight((d, k))), g.op("MatMul", b, g.weight((e, k)))
            scores = g.op("Softmax", g.op("MatMul", q, g.op("Transpose", key, perm=[1, 0])), axis=-1)
            pool.append((g.op("MatMul", scores, b), e))
        elif kind == "reduce":
            if rng.random() < 0.5:
                pool.append((g.op("ReduceSum", a, g.ints([1]), keepdims=1), 1))
            else:
                pool.append((g.op("ReduceMean", a, axes=[1], keepdims=1), 1))
        else:
            pool.append((g.op("Softmax", a, axis=-1), d))
    y, d = pool[-1]
    graph = helper.make_graph(g.nodes, f"chain{index}", [helper.make_tensor_value_info("x", D, ["N", features])],
                              [helper.make_tensor_value_info(y, D, None)], g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    model = onnx.shape_inference.infer_shapes(model)
    weights = [t.name for t in g.inits if t.data_type == D]
    feeds = {"x": rng.uniform(-1, 1, size=(3, features))}
    ops = sorted({n.op_type for n in g.nodes})
    return Subject(f"graph-{seed}-{index}", "graph", ops, model, feeds, ["x", *weights], [y], opset=17)


def chain_graphs(count: int, seed: int = 0) -> Iterator[Subject]:
    for index in range(count):
        yield chain_graph(index, seed)


def registry_graphs(count: int, seed: int = 0) -> Iterator[Subject]:
    """``count`` graphs of ``testing.rule_graphs`` over every rule case (hypothesis, seeded; no shrinking)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seeded

    from ..testing import rule_graphs
    from .cases import all_cases

    found = []

    @seeded(seed)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(rule_graphs(all_cases()))
    def collect(graph):
        found.append(graph)

    collect()
    for k, g in enumerate(found[:count]):
        opset = next((o.version for o in g.model.opset_import if o.domain in ("", "ai.onnx")), 0)
        ops = sorted({n.op_type for n in g.model.graph.node})
        yield Subject(f"registry-{seed}-{k}", "graph", ops, g.model, g.feeds, list(g.wrt), list(g.of), opset=opset)


SOURCES: dict[str, Callable[[int, int], Iterator[Subject]]] = {"chain": chain_graphs, "registry": registry_graphs}
GRAPHS: Callable[[int, int], Iterator[Subject]] = chain_graphs


def _probe(token: str, nodes, inputs, feeds, inits=(), opset: int = 17) -> Subject:
    f = helper.make_tensor_value_info
    outputs = [o for n in nodes[-1:] for o in n.output]
    graph = helper.make_graph(nodes, token, [f(name, dt, dims) for name, dt, dims in inputs],
                              [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs],
                              list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    inferred = onnx.shape_inference.infer_shapes(model)
    del model.graph.output[:]
    model.graph.output.extend(inferred.graph.output)
    return Subject(token, "probe", sorted({n.op_type for n in nodes}), model, feeds, [], [], token=token, opset=opset)


def probes() -> Iterator[Subject]:
    """Forward-only models of what a runtime may refuse that no rule case covers: a feature of an op it has (axes
    of run-time length) and ops without a gradient rule that models or our standard forms hold (Det, Unique,
    Col2Im, NonZero, OneHot). Each names the entry of a target's ``lacks`` its failure stands for."""
    rng = np.random.default_rng(0)
    i64 = TensorProto.INT64
    node = helper.make_node
    yield _probe(f"ReduceSum[{RUN_TIME_AXES}]", [
        node("Shape", ["x"], ["s"]), node("Greater", ["s", "two"], ["big"]), node("NonZero", ["big"], ["nz"]),
        node("Reshape", ["nz", "flat"], ["axes"]), node("ReduceSum", ["x", "axes"], ["y"], keepdims=1)],
        [("x", D, ["N", "M"])], {"x": rng.uniform(-1, 1, (2, 3))},
        [numpy_helper.from_array(np.array(2, np.int64), "two"), numpy_helper.from_array(np.array([-1]), "flat")])
    yield _probe("Det", [node("Det", ["x"], ["y"])], [("x", D, [2, 3, 3])], {"x": rng.uniform(-1, 1, (2, 3, 3))})
    yield _probe("Unique", [node("Unique", ["x"], ["y", "indices", "inverse", "counts"])], [("x", D, [6])],
                 {"x": np.array([2.0, 1.0, 2.0, 3.0, 1.0, 0.5])})
    yield _probe("Col2Im", [node("Col2Im", ["x", "image", "block"], ["y"])], [("x", D, [1, 4, 9])],
                 {"x": rng.uniform(-1, 1, (1, 4, 9))}, [numpy_helper.from_array(np.array([4, 4]), "image"),
                                                        numpy_helper.from_array(np.array([2, 2]), "block")], 18)
    yield _probe("NonZero", [node("NonZero", ["x"], ["y"])], [("x", D, [2, 3])],
                 {"x": np.array([[0.0, 1.0, 2.0], [3.0, 0.0, 4.0]])})
    yield _probe("OneHot", [node("OneHot", ["x", "depth", "values"], ["y"], axis=-1)], [("x", i64, [3])],
                 {"x": np.array([0, 3, 1])}, [numpy_helper.from_array(np.array(4), "depth"),
                                              numpy_helper.from_array(np.array([0.0, 1.0]), "values")])


__all__ = ["GRAPHS", "SOURCES", "case_subject", "case_subjects", "chain_graph", "chain_graphs", "registry_graphs",
           "comparable", "probes"]
