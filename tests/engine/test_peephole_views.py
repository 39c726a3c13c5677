"""The peephole's view rewrites (``engine/peephole_views.py``): an attention layer's head merge as one Concat
and one Transpose, chains of Transposes and Reshapes as one Transpose. Each form is compared with the
plain one (``compose_views=False``) and with finite differences, and never emits an identity Transpose."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.check.gradcheck import gradcheck
from onnx_autodiff.engine.builder import emit_options
from onnx_autodiff.engine.peephole_views import _composite, _Digits, compose_views
from onnx_autodiff.passes.pipeline import lower
from tests.engine.test_peephole import with_gradient

D = TensorProto.DOUBLE
B, S, H, HD = 2, 3, 2, 4
E = H * HD


def _const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, dtype=np.int64)))


def _attention(split: str) -> onnx.ModelProto:
    """x [B, S, E] @ W [E, 3E] split into q, k, v heads, softmax(q k^T) v merged back, loss = sum(out * c).
    ``split``: "gather" (as torch exports nn.MultiheadAttention: [S, B, 3, E] moved to [3, S, B, E], Gather 0 /
    1 / 2, each [S, B*H, HD] moved to [B*H, S, HD]) or "split" (GPT-2's Split of the last axis into three
    [B, S, E], each [B, S, H, HD] moved to [B, H, S, HD])."""
    n = [helper.make_node("MatMul", ["x", "W"], ["p"]), _const("merged", [B, S, E])]
    if split == "gather":
        n += [helper.make_node("Transpose", ["p"], ["ps"], perm=[1, 0, 2]), _const("stacked", [S, B, 3, E]),
              helper.make_node("Reshape", ["ps", "stacked"], ["p4"]), _const("heads", [S, B * H, HD]),
              helper.make_node("Transpose", ["p4"], ["qkv"], perm=[2, 0, 1, 3])]
        for k, t in enumerate("qkv"):
            n += [_const(f"i{t}", k), helper.make_node("Gather", ["qkv", f"i{t}"], [f"{t}3"], axis=0),
                  helper.make_node("Reshape", [f"{t}3", "heads"], [f"{t}4"]),
                  helper.make_node("Transpose", [f"{t}4"], [t], perm=[1, 0, 2])]
        back, merge = [1, 0, 2], [_const("sb", [S, B, E]), helper.make_node("Reshape", ["ot", "sb"], ["o3"]),
                                   helper.make_node("Transpose", ["o3"], ["out"], perm=[1, 0, 2])]
    else:
        n += [helper.make_node("Split", ["p"], ["q3", "k3", "v3"], axis=2, num_outputs=3),
              _const("heads", [B, S, H, HD])]
        for t in "qkv":
            n += [helper.make_node("Reshape", [f"{t}3", "heads"], [f"{t}4"]),
                  helper.make_node("Transpose", [f"{t}4"], [t], perm=[0, 2, 1, 3])]
        back, merge = [0, 2, 1, 3], [helper.make_node("Reshape", ["ot", "merged"], ["out"])]
    swap = list(range(len(back) - 2)) + [len(back) - 1, len(back) - 2]
    n += [helper.make_node("Transpose", ["k"], ["kt"], perm=swap),
          helper.make_node("MatMul", ["q", "kt"], ["scores"]), helper.make_node("Softmax", ["scores"], ["probs"]),
          helper.make_node("MatMul", ["probs", "v"], ["o"]), helper.make_node("Transpose", ["o"], ["ot"], perm=back),
          *merge, helper.make_node("Mul", ["out", "c"], ["oc"]),
          helper.make_node("ReduceSum", ["oc"], ["loss"], keepdims=0)]
    shapes = (("x", [B, S, E]), ("W", [E, 3 * E]), ("c", [B, S, E]))
    inputs = [helper.make_tensor_value_info(k, D, s) for k, s in shapes]
    graph = helper.make_graph(n, "attention", inputs, [helper.make_tensor_value_info("loss", D, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


def _identity_transposes(model: onnx.ModelProto) -> list[str]:
    return [n.name for n in model.graph.node if n.op_type == "Transpose"
            and list(helper.get_attribute_value(n.attribute[0])) == list(range(len(n.attribute[0].ints)))]


@pytest.mark.parametrize("split", ["gather", "split"])
def test_head_merge_matches_the_plain_form_with_fewer_transposes(split):
    model = with_gradient(_attention(split), ["x", "W"])
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((B, S, E)), "W": rng.standard_normal((E, 3 * E)) / 3,
             "c": rng.standard_normal((B, S, E))}

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(["dx", "dW"], feeds)

    composed = lower(model)
    with emit_options(compose_views=False):
        plain = lower(model)
    onnx.checker.check_model(composed, full_check=True)
    count = [sum(n.op_type == "Transpose" for n in m.graph.node) for m in (composed, plain)]
    assert count[0] < count[1], count
    assert not _identity_transposes(composed)
    for a, b in zip(run(composed), run(plain)):
        np.testing.assert_array_equal(a, b)  # the same products, only the data moved differently


@pytest.mark.parametrize("split", ["gather", "split"])
def test_head_merge_matches_finite_differences(split):
    report = gradcheck(_attention(split), wrt=["x", "W"])
    assert report.ok and len(report.checks) == 2


def _chain(perms_and_shapes, shape) -> tuple[list[onnx.NodeProto], np.ndarray]:
    """View nodes from "a" ([perm] for a Transpose, (shape,) for a Reshape), and numpy's result."""
    x = np.arange(int(np.prod(shape))).reshape(shape)
    nodes, name = [], "a"
    for k, step in enumerate(perms_and_shapes):
        out = f"t{k}"
        if isinstance(step, list):
            nodes.append(helper.make_node("Transpose", [name], [out], perm=step))
            x = x.transpose(step)
        else:
            nodes += [_const(f"s{k}", step[0]), helper.make_node("Reshape", [name, f"s{k}"], [out])]
            x = x.reshape(step[0])
        name = out
    return nodes, x


def _run_nodes(nodes: list[onnx.NodeProto], shape, out: str) -> np.ndarray:
    graph = helper.make_graph(nodes, "views", [helper.make_tensor_value_info("a", TensorProto.INT64, shape)],
                              [helper.make_tensor_value_info(out, TensorProto.INT64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    a = np.arange(int(np.prod(shape))).reshape(shape)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": a})[0]


@pytest.mark.parametrize("steps,shape", [
    ([[1, 0, 2], ([6, 4, 5],), [2, 1, 0]], (4, 6, 5)),                 # split an axis between two moves
    ([[0, 2, 1, 3], ([2, 12, 5],), ([2, 3, 4, 5],), [0, 2, 1, 3]], (2, 4, 3, 5)),  # undone: a Reshape alone
    ([([3, 2, 4, 5],), [1, 0, 2, 3], ([2, 3, 20],), [2, 0, 1]], (6, 4, 5)),
    ([[1, 0], ([8, 3],), [1, 0]], (6, 4)),                                # the 6 split in two
])
def test_composed_chain_equals_the_chain(steps, shape):
    nodes, expected = _chain(steps, shape)
    out = nodes[-1].output[0]
    composed = compose_views(list(nodes), {out}, lambda name: shape if name == "a" else None)
    assert sum(n.op_type == "Transpose" for n in composed) <= 1
    assert not any(n.op_type == "Transpose" and list(n.attribute[0].ints) == sorted(n.attribute[0].ints)
                   for n in composed)
    np.testing.assert_array_equal(_run_nodes(composed, shape, out), expected)


def test_digits_refuse_a_reshape_that_is_not_a_view():
    d = _Digits((6, 4))
    assert d.apply("Transpose", (1, 0))
    assert not d.apply("Reshape", (3, 8))  # 4 x 6 read as 3 x 8: the 4 does not split into 3s
    d = _Digits((2, 3, 4))
    assert d.apply("Transpose", (2, 0, 1)) and d.apply("Reshape", (4, 6))
    assert _composite(d) == ([6, 4], [1, 0])
