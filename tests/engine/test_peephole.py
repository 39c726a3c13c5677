"""The peephole's transpose folding on chains of products: every fold leaves a graph whose nodes read
only tensors made before them, and the gradient it gives matches finite differences."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnx_autodiff.check.gradcheck import gradcheck
from onnx_autodiff.engine.builder import emit_options
from onnx_autodiff.passes.pipeline import lower

D = TensorProto.DOUBLE


def _attention_scores(rank: int) -> onnx.ModelProto:
    """K = X Wk, Q = X Wq, S = Q K^T, loss = sum(S): the product of a transposed computed tensor."""
    x = [3, 4] if rank == 2 else [2, 3, 4]
    perm = [1, 0] if rank == 2 else [0, 2, 1]
    nodes = [helper.make_node("MatMul", ["X", "Wk"], ["K"]), helper.make_node("MatMul", ["X", "Wq"], ["Q"]),
             helper.make_node("Transpose", ["K"], ["Kt"], perm=perm), helper.make_node("MatMul", ["Q", "Kt"], ["S"]),
             helper.make_node("ReduceSum", ["S"], ["loss"], keepdims=0)]
    inputs = [helper.make_tensor_value_info(n, D, s) for n, s in (("X", x), ("Wk", [4, 5]), ("Wq", [4, 5]))]
    graph = helper.make_graph(nodes, "scores", inputs, [helper.make_tensor_value_info("loss", D, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def with_gradient(model: onnx.ModelProto, xs: list[str]) -> onnx.ModelProto:
    """The model plus one Gradient node of 'loss' w.r.t. ``xs`` (float64), its outputs ``d<x>`` graph outputs."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.node.append(helper.make_node("Gradient", xs, [f"d{x}" for x in xs], domain="ai.onnx.preview.training",
                                         xs=xs, y="loss"))
    m.graph.output.extend(helper.make_tensor_value_info(f"d{x}", D, None) for x in xs)
    m.opset_import.append(helper.make_opsetid("ai.onnx.preview.training", 1))
    return m


@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize("xs", [["Wk"], ["Wq"], ["Wk", "Wq"], ["X", "Wk"]])
def test_product_of_a_transposed_computed_tensor_lowers(rank, xs):
    """Transpose(Gemm) turned into a swapped Gemm, then read by the next product's Gemm: the second
    fold reads the swapped Gemm, not the name it had before (issue 29)."""
    lowered = lower(with_gradient(_attention_scores(rank), xs))
    onnx.checker.check_model(lowered, full_check=True)


@pytest.mark.parametrize("rank", [2, 3])
def test_product_of_a_transposed_computed_tensor_matches_finite_differences(rank):
    report = gradcheck(_attention_scores(rank), wrt=["X", "Wk", "Wq"])
    assert report.ok and len(report.checks) == 3


def test_folded_and_unfolded_backward_agree():
    import onnxruntime as ort

    model = with_gradient(_attention_scores(2), ["X", "Wk", "Wq"])
    rng = np.random.default_rng(3)
    feeds = {"X": rng.standard_normal((3, 4)), "Wk": rng.standard_normal((4, 5)), "Wq": rng.standard_normal((4, 5))}

    def run(m):
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(["dX", "dWk", "dWq"], feeds)

    folded = lower(model)
    with emit_options(fold_transposes=False):
        plain = lower(model)
    assert sum(n.op_type == "Transpose" for n in folded.graph.node) < sum(
        n.op_type == "Transpose" for n in plain.graph.node)
    for a, b in zip(run(folded), run(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
