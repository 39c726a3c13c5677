"""Hypothesis fuzz: random graphs of common ops, lowered and held against float64 central differences.

A graph starts from x [N, F] (N symbolic in the model, drawn per example) and grows by 2-7 ops drawn from
unary elementwise ops, binary ops that broadcast (against weights of shape [d], [1, d], [] or another tensor
with a 1 axis), MatMul with a weight, reductions with keepdims and Softmax. y is the last tensor, non-scalar
unless a final reduction is drawn. The gradients of y with respect to x and every weight must agree with
finite differences (gradcheck's dot-product test). A fixed budget of derandomized examples keeps CI stable
(about 15 s).
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.check.gradcheck import gradcheck

D = TensorProto.DOUBLE
UNARY = ["Tanh", "Sigmoid", "Neg", "Softplus", "Sin", "Square", "ExpTanh", "LogCosh"]
BINARY = ["Add", "Sub", "Mul", "SafeDiv"]


class _Graph:
    def __init__(self, features: int):
        self.nodes, self.inits, self.n = [], [], 0
        self.pool = [("x", features)]  # (name, last dim); every tensor is [N, d]
        self.rng = np.random.default_rng(features)

    def fresh(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        out = self.fresh("t")
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def weight(self, shape) -> str:
        name = self.fresh("w")
        self.inits.append(numpy_helper.from_array(self.rng.uniform(-1, 1, size=shape).astype(np.float64), name))
        return name


@st.composite
def graphs(draw):
    features = draw(st.integers(1, 4))
    g = _Graph(features)
    for _ in range(draw(st.integers(2, 7))):
        a, d = draw(st.sampled_from(g.pool))
        kind = draw(st.sampled_from(["unary", "binary", "binary", "matmul", "reduce", "softmax"]))
        if kind == "unary":
            op = draw(st.sampled_from(UNARY))
            if op == "Square":
                out = g.op("Mul", [a, a])
            elif op == "ExpTanh":  # exp of a bounded value: no overflow
                out = g.op("Exp", [g.op("Tanh", [a])])
            elif op == "LogCosh":  # log of a value >= 1
                out = g.op("Log", [g.op("Cosh", [g.op("Tanh", [a])])])
            else:
                out = g.op(op, [a])
            g.pool.append((out, d))
        elif kind == "binary":
            op = draw(st.sampled_from(BINARY))
            partners = [(n, e) for n, e in g.pool if e in (d, 1) or d == 1]
            choice = draw(st.sampled_from(["weight_d", "weight_1d", "scalar", "tensor"]))
            if choice == "tensor":
                b, e = draw(st.sampled_from(partners))
            else:
                shape = {"weight_d": (d,), "weight_1d": (1, d), "scalar": ()}[choice]
                b, e = g.weight(shape), d
            if draw(st.booleans()):
                a, b = b, a  # the broadcast side on the left too
            if op == "SafeDiv":  # a / (1 + b*b): the denominator stays >= 1
                den = g.op("Add", [g.op("Mul", [b, b]), g.weight(())])
                g.inits[-1].CopyFrom(numpy_helper.from_array(np.array(1.0), g.inits[-1].name))
                out = g.op("Div", [a, den])
            else:
                out = g.op(op, [a, b])
            g.pool.append((out, max(d, e)))
        elif kind == "matmul":
            k = draw(st.integers(1, 4))
            out = g.op("MatMul", [a, g.weight((d, k))])
            g.pool.append((out, k))
        elif kind == "reduce":
            op = draw(st.sampled_from(["ReduceSum", "ReduceMean"]))
            axes = g.weight(())
            g.inits[-1].CopyFrom(numpy_helper.from_array(np.array([1], np.int64), axes))
            g.pool.append((g.op(op, [a, axes], keepdims=1), 1))
        else:
            g.pool.append((g.op("Softmax", [a], axis=-1), d))
    y, d = g.pool[-1]
    if draw(st.booleans()):
        y = g.op("ReduceMean", [y], keepdims=0)  # a scalar y sometimes
        shape = []
    else:
        shape = ["N", d]
    model = helper.make_model(
        helper.make_graph(g.nodes, "fuzz", [helper.make_tensor_value_info("x", D, ["N", features])],
                          [helper.make_tensor_value_info(y, D, shape)], g.inits),
        opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    batch = draw(st.integers(1, 3))
    x = np.random.default_rng(batch).uniform(-1.5, 1.5, size=(batch, features))
    return model, x


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(graphs())
def test_random_graphs_match_finite_differences(case):
    model, x = case
    wrt = ["x"] + [t.name for t in model.graph.initializer if t.data_type == D]
    report = gradcheck(model, {"x": x}, wrt=wrt, raise_on_failure=False)
    assert report.ok, f"{report}\n{[ (n.op_type, list(n.input)) for n in model.graph.node]}"
