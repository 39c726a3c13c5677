"""Chains of matrix products for hypothesis, apart from the rule cases: MatMul, Gemm, Transpose and Einsum on
2-D and batched tensors, where an operand is often a tensor the chain computed, transposed or used twice
(``S = Q @ K^T`` with ``Q = X Wq`` and ``K = X Wk``), which is where the backward's transpose folding works.

``linalg_graphs`` draws one graph (a ``FuzzGraph``, checked by ``check_graph``); the values of every tensor
are computed as the chain grows (numpy), and a tensor past 4 in magnitude goes through Tanh before it is used
again, so products of products stay tame.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .check import FuzzGraph
from .deps import strategies

D = TensorProto.DOUBLE
LETTERS = "abcdefgh"


class _Chain:
    def __init__(self, draw, rng, symbolic: bool):
        self.draw, self.rng, self.symbolic = draw, rng, symbolic
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.feeds: dict[str, np.ndarray] = {}
        self.values: dict[str, np.ndarray] = {}
        self.pool: list[str] = []
        self.made: list[str] = []
        self.n = 0

    @property
    def st(self):
        return strategies()

    def fresh(self, base: str) -> str:
        self.n += 1
        return f"{base}{self.n}"

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(np.shape(self.values[name]))

    def leaf(self, shape) -> str:
        """A fresh graph input (some dims symbolic) or weight of ``shape``."""
        value = self.rng.uniform(-1.5, 1.5, size=tuple(shape))
        if self.draw(self.st.booleans()):
            name = self.fresh("w")
            self.inits.append(numpy_helper.from_array(value, name))
        else:
            name = self.fresh("x")
            dims = [f"{name}_{k}" if self.symbolic and self.draw(self.st.integers(0, 2)) == 0 else d
                    for k, d in enumerate(shape)]
            self.inputs.append(helper.make_tensor_value_info(name, D, dims))
            self.feeds[name] = value
        self.values[name] = value
        self.pool.append(name)
        return name

    def node(self, op: str, inputs: list[str], value: np.ndarray, **attrs) -> str:
        out = self.fresh("t")
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        self.values[out] = np.asarray(value)
        return out

    def result(self, op: str, inputs: list[str], value: np.ndarray, **attrs) -> str:
        """A product joins the pool (through Tanh when its values are large)."""
        out = self.node(op, inputs, value, **attrs)
        if np.max(np.abs(value), initial=0) > 4:
            out = self.node("Tanh", [out], np.tanh(value))
        self.pool.append(out)
        self.made.append(out)
        return out

    def pick(self, rank: int | None = None) -> str:
        found = [p for p in self.pool if rank is None or len(self.shape(p)) == rank]
        return self.draw(self.st.sampled_from(found)) if found else self.leaf(self.matrix_shape(rank or 2))

    def matrix_shape(self, rank: int) -> tuple[int, ...]:
        st = self.st
        return tuple(self.draw(st.integers(1, 4)) for _ in range(rank))

    def operand(self, shape: tuple[int, ...]) -> str:
        """A tensor of ``shape``: one of the chain's (as it is, or transposed), else a fresh one."""
        st = self.st
        exact = [p for p in self.pool if self.shape(p) == shape]
        turned = [p for p in self.pool if len(shape) >= 2 and self.shape(p) == shape[:-2] + (shape[-1], shape[-2])
                  and shape[-1] != shape[-2]]
        kinds = ["fresh"] + ["same"] * 2 * bool(exact) + ["turned"] * 2 * bool(turned)
        kind = self.draw(st.sampled_from(kinds))
        if kind == "fresh":
            return self.leaf(shape)
        if kind == "same":
            return self.draw(st.sampled_from(exact))
        t = self.draw(st.sampled_from(turned))
        return self.transpose(t, list(range(len(shape) - 2)) + [len(shape) - 1, len(shape) - 2])

    def transpose(self, t: str, perm: list[int]) -> str:
        return self.node("Transpose", [t], np.transpose(self.values[t], perm), perm=perm)

    # ---- the ops -----------------------------------------------------------------------------------
    def matmul(self) -> None:
        """a @ b or b @ a for one of the chain's tensors a, the other operand's batch dims a's, some of them
        1 or left out (broadcasting)."""
        st = self.st
        a = self.pick()
        sa = self.shape(a)
        if len(sa) < 2:
            return
        n = self.draw(st.integers(1, 4))
        batch = sa[:-2]
        if batch and self.draw(st.booleans()):
            batch = tuple(1 if self.draw(st.booleans()) else d for d in batch)[self.draw(st.integers(0, len(batch))):]
        if self.draw(st.booleans()):
            b = self.operand(batch + (sa[-1], n))
        else:
            a, b = self.operand(batch + (n, sa[-2])), a
        self.result("MatMul", [a, b], np.matmul(self.values[a], self.values[b]))

    def gemm(self) -> None:
        st = self.st
        a = self.pick(2)
        m, k = self.shape(a)
        trans_a = self.draw(st.booleans())
        if trans_a:
            m, k = k, m
        n = self.draw(st.integers(1, 4))
        trans_b = self.draw(st.booleans())
        b = self.operand((n, k) if trans_b else (k, n))
        alpha = self.draw(st.sampled_from([1.0, 0.5, -1.5]))
        va, vb = self.values[a], self.values[b]
        value = alpha * (va.T if trans_a else va) @ (vb.T if trans_b else vb)
        inputs = [a, b]
        attrs = {"alpha": alpha if alpha != 1.0 else None, "transA": 1 if trans_a else None,
                 "transB": 1 if trans_b else None}
        c_shape = self.draw(st.sampled_from([None, (), (n,), (1, n), (m, 1), (m, n)]))
        if c_shape is not None:
            beta = self.draw(st.sampled_from([1.0, 2.0, -0.5]))
            c = self.operand(c_shape) if len(c_shape) == 2 else self.leaf(c_shape)
            inputs.append(c)
            value = value + beta * self.values[c]
            attrs["beta"] = beta if beta != 1.0 else None
        self.result("Gemm", inputs, value, **{k: v for k, v in attrs.items() if v is not None})

    def turn(self) -> None:
        st = self.st
        a = self.pick()
        r = len(self.shape(a))
        if r < 2:
            return
        if self.draw(st.booleans()):
            perm = list(range(r - 2)) + [r - 1, r - 2]
        else:
            perm = self.draw(st.permutations(list(range(r))))
        t = self.transpose(a, list(perm))
        self.pool.append(t)
        self.made.append(t)

    def einsum(self) -> None:
        """A contraction of one or two of the chain's tensors over a shared axis, batch axes kept, the
        result's axes in a drawn order (the transposes are the equation's)."""
        st = self.st
        a = self.pick()
        sa = self.shape(a)
        la = LETTERS[:len(sa)]
        k = self.draw(st.integers(0, len(sa) - 1)) if sa else None
        if k is None:
            return
        if self.draw(st.integers(0, 3)) == 0:  # one operand: a transpose and a sum
            keep = [c for j, c in enumerate(la) if j != k]
            out = "".join(self.draw(st.permutations(keep)))
            eq = f"{la}->{out}"
            self.result("Einsum", [a], np.einsum(eq, self.values[a]), equation=eq)
            return
        n = self.draw(st.integers(1, 4))
        batch = self.draw(st.integers(0, len(sa) - 1)) if len(sa) > 1 else 0
        shared = [j for j in range(batch) if j != k]  # leading axes of a both operands keep
        lb_axes = [la[j] for j in shared] + [la[k], "z"]
        shape_b = tuple(sa[j] for j in shared) + (sa[k], n)
        order = self.draw(st.permutations(list(range(len(lb_axes)))))
        lb = "".join(lb_axes[j] for j in order)
        b = self.operand(tuple(shape_b[j] for j in order))
        keep = [c for j, c in enumerate(la) if j != k] + ["z"]
        out = "".join(self.draw(st.permutations(keep)))
        eq = f"{la},{lb}->{out}"
        self.result("Einsum", [a, b], np.einsum(eq, self.values[a], self.values[b]), equation=eq)

    def finish(self, opset: int) -> FuzzGraph | None:
        read = {i for n in self.nodes for i in n.input}
        leaves = [t for t in self.made if t not in read]
        if not leaves:
            return None
        of = leaves[-3:]
        want, nodes = set(of), []
        for node in reversed(self.nodes):
            if any(o in want for o in node.output):
                nodes.append(node)
                want.update(node.input)
        nodes.reverse()
        inputs = [vi for vi in self.inputs if vi.name in want]
        inits = [t for t in self.inits if t.name in want]
        graph = helper.make_graph(nodes, "linalg", inputs, [helper.make_tensor_value_info(o, D, None) for o in of],
                                  inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8
        inferred = onnx.shape_inference.infer_shapes(model)
        del model.graph.output[:]
        model.graph.output.extend(
            o if o.type.tensor_type.HasField("shape") else
            helper.make_tensor_value_info(o.name, D, [None] * np.ndim(self.values[o.name]))
            for o in inferred.graph.output)
        onnx.checker.check_model(model, full_check=True)
        wrt = [vi.name for vi in inputs] + [t.name for t in inits]
        return FuzzGraph(model, {vi.name: self.feeds[vi.name] for vi in inputs}, wrt, of,
                         placed=[n.op_type for n in nodes])


def linalg_graphs(max_nodes: int = 6, batched: bool = True, symbolic: bool = True, opsets=(13, 17)):
    """Strategy: a ``FuzzGraph`` of 1 to ``max_nodes`` MatMul / Gemm / Transpose / Einsum nodes on tensors of
    rank 2 (and 3-4 with ``batched``), some of whose graph input dims are symbolic (``symbolic``)."""
    st = strategies()
    from hypothesis import assume

    @st.composite
    def graph(draw):
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        chain = _Chain(draw, rng, symbolic)
        for _ in range(draw(st.integers(1, 2))):
            rank = draw(st.integers(2, 4)) if batched else 2
            chain.leaf(chain.matrix_shape(rank))
        for _ in range(draw(st.integers(1, max_nodes))):
            op = draw(st.sampled_from(["matmul", "matmul", "gemm", "turn", "einsum", "einsum"]))
            getattr(chain, op)()
        found = chain.finish(draw(st.sampled_from(list(opsets))))
        assume(found is not None)
        return found

    return graph()


__all__ = ["linalg_graphs"]
