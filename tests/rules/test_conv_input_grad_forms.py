"""The Conv input gradient's forms agree: one Gemm over the batch and a per-offset scatter (few output positions,
``batched_input_grad_max_out``) and the flipped-kernel Conv against the ConvTranspose form, and all against a
float64 reference of the adjoint."""
from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnx_autodiff import build_vjp
from onnx_autodiff.engine.builder import emit_options

F32 = TensorProto.FLOAT

# (x shape, weight shape, Conv attributes)
CASES = [((3, 4, 4, 4), (5, 4, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),  # 2x2 out, stride 2
         ((2, 3, 2, 2), (4, 3, 3, 3), {"pads": [1, 1, 1, 1]}),  # 2x2 out, stride 1
         ((2, 2, 6, 5), (3, 2, 3, 2), {"strides": [2, 2]}),  # x's last row and column read by no window
         ((2, 2, 7, 7), (3, 2, 3, 3), {"dilations": [2, 2], "pads": [0, 1, 1, 0], "strides": [1, 2]}),
         ((2, 3, 9), (4, 3, 3), {"strides": [3], "pads": [1, 0]}),  # 1-D
         ((1, 2, 2, 2), (3, 2, 1, 1), {})]


def _model(xs, ws, attrs) -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], **attrs)], "conv",
                          [helper.make_tensor_value_info("x", F32, list(xs)),
                           helper.make_tensor_value_info("w", F32, list(ws))], [])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(m).graph.value_info}
    m.graph.output.append(inferred["y"])
    return m


def _input_grad(model, x, w, dy, **options):
    """(dx, the backward's op types)."""
    with emit_options(**options):
        v = build_vjp(model, wrt=["x"])
    feeds = {"x": x, "w": w, "y_grad": dy}
    sess = ort.InferenceSession(v.backward.SerializeToString(), providers=["CPUExecutionProvider"])
    dx, = sess.run(["x_grad"], {i.name: feeds[i.name] for i in sess.get_inputs()})
    return dx, [n.op_type for n in v.backward.graph.node]


def _reference(x, w, dy, attrs) -> np.ndarray:
    """sum_o dy[n, m, o] w[m, c, k] at x position o*s + k*d - b, in float64."""
    r = x.ndim - 2
    s, d = attrs.get("strides", [1] * r), attrs.get("dilations", [1] * r)
    b = attrs.get("pads", [0] * 2 * r)[:r]
    dx = np.zeros(x.shape, np.float64)
    for o in itertools.product(*[range(n) for n in dy.shape[2:]]):
        for k in itertools.product(*[range(n) for n in w.shape[2:]]):
            at = [oi * si + ki * di - bi for oi, si, ki, di, bi in zip(o, s, k, d, b)]
            if all(0 <= a < n for a, n in zip(at, x.shape[2:])):
                dx[(slice(None), slice(None), *at)] += dy[(slice(None), slice(None), *o)].astype(np.float64) @ \
                    w[(slice(None), slice(None), *k)].astype(np.float64)
    return dx


@pytest.mark.parametrize("xs,ws,attrs", CASES)
def test_the_input_gradient_forms_agree(xs, ws, attrs):
    model = _model(xs, ws, attrs)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(xs).astype(np.float32)
    w = rng.standard_normal(ws).astype(np.float32)
    dy_shape = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    dy = rng.standard_normal(dy_shape).astype(np.float32)
    batched, batched_ops = _input_grad(model, x, w, dy)  # every case has at most 16 output positions
    transposed, transposed_ops = _input_grad(model, x, w, dy, batched_input_grad_max_out=0,
                                             flipped_conv_input_grad=False)
    flipped, _ = _input_grad(model, x, w, dy, batched_input_grad_max_out=0)
    assert "Gemm" in batched_ops and "ConvTranspose" not in batched_ops and "Conv" not in batched_ops
    assert "ConvTranspose" in transposed_ops
    ref = _reference(x, w, dy, attrs)
    for dx in (batched, transposed, flipped):
        np.testing.assert_allclose(dx, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    np.testing.assert_allclose(batched, transposed, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("c,m,form", [(4, 3, "Conv"), (4, 4, "Conv"), (3, 4, "ConvTranspose")])
def test_many_output_positions_keep_the_per_sample_forms(c, m, form):
    """36 output positions: the flipped-kernel Conv, or a ConvTranspose where the conv widens the channels."""
    model = _model((2, c, 6, 6), (m, c, 3, 3), {"pads": [1, 1, 1, 1]})
    rng = np.random.default_rng(1)
    _, ops = _input_grad(model, rng.standard_normal((2, c, 6, 6)).astype(np.float32),
                         rng.standard_normal((m, c, 3, 3)).astype(np.float32),
                         rng.standard_normal((2, m, 6, 6)).astype(np.float32))
    assert form in ops and {"Conv", "ConvTranspose"} - {form} - set(ops) and "Gemm" not in ops
