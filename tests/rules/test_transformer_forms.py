"""The transformer step's backward forms (issue 38): each new form against the old one an emitter option restores.

Each test lowers the same model twice, checks which ops each form emitted (so it fails if the new form is
not taken) and compares the gradients in onnxruntime.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import build_vjp
from onnx_autodiff.engine.builder import emit_options
from tests.models import run_ort


def _model(nodes, x_shape, y_shape, inits=(), dtype=TensorProto.FLOAT, opset=17):
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", dtype, list(x_shape))],
                              [helper.make_tensor_value_info("y", dtype, list(y_shape))], list(inits))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _grads(model, wrt, x, **options):
    """(gradients of sum(y * dy) w.r.t. ``wrt``, the op type of each backward node) with ``options`` set."""
    with emit_options(**options):
        v = build_vjp(model, wrt=wrt)
    fwd = run_ort(v.forward, {"x": x})
    rng = np.random.default_rng(7)
    dy = {f"{o}_grad": rng.standard_normal(fwd[o].shape).astype(fwd[o].dtype) for o in v.outputs}
    back = run_ort(v.backward, {"x": x, **fwd, **dy})
    return {k: back[f"{k}_grad"] for k in wrt}, [n.op_type for n in v.backward.graph.node]


def _layer_norm(shape, axis, dtype=np.float32):
    rng = np.random.default_rng(3)
    norm = shape[axis:]
    inits = [numpy_helper.from_array((1 + rng.standard_normal(norm)).astype(dtype), "s"),
             numpy_helper.from_array(rng.standard_normal(norm).astype(dtype), "b")]
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=axis, epsilon=1e-5)
    onnx_type = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
    return _model([node], shape, shape, inits, dtype=onnx_type), (2 + 3 * rng.standard_normal(shape)).astype(dtype)


@pytest.mark.parametrize("shape,axis", [((4, 6, 32), -1), ((3, 5, 4, 6), 2), ((8, 16), 1)])
def test_layer_norm_backward_by_kernel_moments_matches_recomputed_moments(shape, axis):
    """xhat and invstd from one LayerNormalization kernel of x: the same gradients as the op-by-op moments."""
    model, x = _layer_norm(shape, axis)
    fast, fast_ops = _grads(model, ["x", "s", "b"], x)
    plain, plain_ops = _grads(model, ["x", "s", "b"], x, layer_norm_kernel_moments=False)
    assert "LayerNormalization" in fast_ops and "LayerNormalization" not in plain_ops
    assert "Sqrt" not in fast_ops and fast_ops.count("ReduceSum") < plain_ops.count("ReduceSum")
    for k in ("x", "s", "b"):
        np.testing.assert_allclose(fast[k], plain[k], rtol=2e-4, atol=2e-5)


def test_layer_norm_backward_of_double_keeps_recomputed_moments():
    """The kernel stashes its statistics in float32: a float64 x keeps the op-by-op moments (its precision)."""
    model, x = _layer_norm((4, 6, 8), -1, np.float64)
    _, ops = _grads(model, ["x", "s", "b"], x)
    assert "LayerNormalization" not in ops and "Sqrt" in ops


@pytest.mark.parametrize("opset", [12, 13])
def test_dropout_of_ratio_zero_backward_is_dy_itself(opset):
    """A constant ratio 0 in training mode drops nothing: the gradient is dy, no Where over it."""
    inits = [numpy_helper.from_array(np.asarray(0.0, np.float32), "r"), numpy_helper.from_array(np.asarray(True), "t")]
    model = _model([helper.make_node("Dropout", ["x", "r", "t"], ["y", "mask"], seed=1)], (4, 5), (4, 5), inits,
                   opset=opset)
    x = np.random.default_rng(2).standard_normal((4, 5)).astype(np.float32)
    fast, fast_ops = _grads(model, ["x"], x)
    plain, plain_ops = _grads(model, ["x"], x, dropout_ratio_zero_identity=False)
    assert "Where" not in fast_ops and "Where" in plain_ops
    np.testing.assert_array_equal(fast["x"], plain["x"])


def test_transformer_forms_benchmark_runs_at_its_tiny_size(capsys):
    from benchmarks.transformer_forms import main

    main(["layernorm", "1", "--tiny"])
    out = capsys.readouterr().out
    assert "old form (layer_norm_kernel_moments=False)" in out and "new form" in out
