"""The Conv backward's forms for few output positions agree with the older forms: the input gradient's Col2Im
scatter (opset >= 18, ``col2im_input_grad``) with the per-offset Pads and a float64 reference, and the weight
gradient's im2col rows by one Gemm (``im2col_weight_grad_max_out``) with one Gemm per offset and the Conv form.
The emitted models pass the full checker at their own opset; Col2Im appears only at opset >= 18 and only for a
target that has it."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnx_autodiff import build_vjp, lower
from onnx_autodiff.engine.builder import emit_options

from .test_conv_input_grad_forms import CASES, _reference

F32 = TensorProto.FLOAT

# the 2-D input-gradient cases (strided, padded, dilated, x's end read by no window), and ResNet's last stage in
# small: 3x3 convs whose output is 2x2 (stride 1, and stride 2 from 4x4), a 4x4 output
INPUT_CASES = [c for c in CASES if len(c[0]) == 4] + [((2, 6, 4, 4), (5, 6, 3, 3), {"pads": [1, 1, 1, 1]})]
WEIGHT_CASES = [((3, 4, 2, 2), (5, 4, 3, 3), {"pads": [1, 1, 1, 1]}),
                ((3, 4, 4, 4), (5, 4, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
                ((2, 3, 4, 3), (4, 3, 3, 2), {"strides": [2, 2], "pads": [0, 1, 1, 0]}),
                ((2, 3, 5, 5), (4, 3, 2, 2), {"dilations": [2, 2], "strides": [2, 3]}),
                ((2, 3, 9), (4, 3, 3), {"strides": [3], "pads": [1, 0]})]


def _model(xs, ws, attrs, opset: int) -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], **attrs)], "conv",
                          [helper.make_tensor_value_info("x", F32, list(xs)),
                           helper.make_tensor_value_info("w", F32, list(ws))], [])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(m).graph.value_info}
    m.graph.output.append(inferred["y"])
    return m


def _backward(model, wrt, feeds, **options):
    """(gradients by name, the backward's op types), the backward checked in full at the model's opset."""
    with emit_options(**options):
        backward = build_vjp(model, wrt=wrt).backward
    onnx.checker.check_model(backward, full_check=True)
    sess = ort.InferenceSession(backward.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [f"{n}_grad" for n in wrt]
    got = sess.run(names, {i.name: feeds[i.name] for i in sess.get_inputs()})
    return dict(zip(wrt, got)), [n.op_type for n in backward.graph.node]


def _data(model, xs, ws, seed=0):
    rng = np.random.default_rng(seed)
    dy_shape = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    return {"x": rng.standard_normal(xs).astype(np.float32), "w": rng.standard_normal(ws).astype(np.float32),
            "y_grad": rng.standard_normal(dy_shape).astype(np.float32)}


@pytest.mark.parametrize("xs,ws,attrs", INPUT_CASES)
def test_col2im_input_gradient_matches_the_pads_form(xs, ws, attrs):
    model = _model(xs, ws, attrs, 18)
    feeds = _data(model, xs, ws)
    col2im, col2im_ops = _backward(model, ["x"], feeds)  # every case has at most 16 output positions
    pads, pads_ops = _backward(model, ["x"], feeds, col2im_input_grad=False)
    assert "Col2Im" in col2im_ops and "Sum" not in col2im_ops and "Pad" not in col2im_ops
    assert "Col2Im" not in pads_ops and "Gemm" in pads_ops
    ref = _reference(feeds["x"], feeds["w"], feeds["y_grad"], attrs)
    atol = 1e-5 * np.abs(ref).max()
    np.testing.assert_allclose(col2im["x"], ref, rtol=1e-5, atol=atol)
    np.testing.assert_allclose(col2im["x"], pads["x"], rtol=1e-5, atol=atol)


@pytest.mark.parametrize("xs,ws,attrs", INPUT_CASES[:2])
def test_col2im_only_from_opset_18(xs, ws, attrs):
    model = _model(xs, ws, attrs, 17)
    _, ops = _backward(model, ["x"], _data(model, xs, ws))
    assert "Col2Im" not in ops and "Gemm" in ops


def test_col2im_only_for_a_target_that_has_it():
    """tract lacks Col2Im: the lowering for it keeps the per-offset Pads, and both lowerings compute the same."""
    f = helper.make_tensor_value_info
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
             helper.make_node("Mul", ["loss", "loss"], ["sq"]),
             helper.make_node("Gradient", ["x", "w"], ["dx", "dw"], domain="ai.onnx.preview.training",
                              xs=["x", "w"], y="sq")]
    graph = helper.make_graph(nodes, "g", [f("x", F32, [2, 3, 2, 2]), f("w", F32, [4, 3, 3, 3])],
                              [f("dx", F32, [2, 3, 2, 2]), f("dw", F32, [4, 3, 3, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid("ai.onnx.preview.training", 1)], ir_version=9)
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((2, 3, 2, 2)).astype(np.float32),
             "w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32)}
    results = {}
    for target in ("onnxruntime", "tract"):
        lowered = lower(model, target=target)
        onnx.checker.check_model(lowered, full_check=True)
        results[target] = (ort.InferenceSession(lowered.SerializeToString()).run(None, feeds),
                           {n.op_type for n in lowered.graph.node})
    assert "Col2Im" in results["onnxruntime"][1] and "Col2Im" not in results["tract"][1]
    for a, b in zip(results["onnxruntime"][0], results["tract"][0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


@pytest.mark.parametrize("xs,ws,attrs", WEIGHT_CASES)
def test_few_output_positions_weight_gradient_matches_the_other_forms(xs, ws, attrs):
    """At most 4 output positions: the im2col rows [K*C, out*N] and one Gemm, against one Gemm per kernel offset
    and the Conv of x by dz."""
    model = _model(xs, ws, attrs, 17)
    feeds = _data(model, xs, ws, seed=3)
    # im2col_columns 0: these small convs would take the im2col rows by their few columns anyway
    one, one_ops = _backward(model, ["w"], feeds, im2col_columns=0)
    offsets, offsets_ops = _backward(model, ["w"], feeds, im2col_columns=0, im2col_weight_grad_max_out=0)
    conv, conv_ops = _backward(model, ["w"], feeds, gemm_weight_grad=False)
    kernel = int(np.prod(ws[2:]))
    assert one_ops.count("Gemm") == 1 and "MatMul" not in one_ops and offsets_ops.count("Gemm") == kernel
    assert "Gemm" not in conv_ops and "Conv" in conv_ops
    atol = 1e-5 * np.abs(conv["w"]).max()
    np.testing.assert_allclose(one["w"], conv["w"], rtol=1e-4, atol=atol)
    np.testing.assert_allclose(one["w"], offsets["w"], rtol=1e-4, atol=atol)


def test_grouped_conv_weight_gradient_keeps_the_conv_form():
    """group > 1 has no Gemm form: the few-output im2col choice does not apply."""
    model = _model((2, 4, 2, 2), (6, 2, 3, 3), {"pads": [1, 1, 1, 1], "group": 2}, 17)
    _, ops = _backward(model, ["w"], _data(model, (2, 4, 2, 2), (6, 2, 3, 3)))
    assert "Conv" in ops and "Gemm" not in ops


@pytest.mark.parametrize("xs,ws,attrs", [((2, 3, 7), (4, 3, 3), {"dilations": [2], "pads": [1, 0]}),
                                         ((2, 3, 9), (4, 3, 3), {"strides": [3], "pads": [1, 0]}),
                                         ((1, 2, 4, 3, 4), (3, 2, 2, 2, 2), {"dilations": [2, 1, 2]})])
def test_convs_outside_2d_keep_the_pads_form(xs, ws, attrs):
    """onnxruntime 1.32's Col2Im is wrong with dilations in 1-D and 3-D and OpenVINO converts only 2-D: 1-D and
    3-D convs keep the per-offset Pads."""
    model = _model(xs, ws, attrs, 18)
    feeds = _data(model, xs, ws, seed=4)
    got, ops = _backward(model, ["x"], feeds)
    assert "Col2Im" not in ops and "Gemm" in ops
    ref = _reference(feeds["x"], feeds["w"], feeds["y_grad"], attrs)
    np.testing.assert_allclose(got["x"], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_second_order_through_the_col2im_form():
    """The Hessian-vector product of sum(conv(x, w)^2) along v in x differentiates the backward's Col2Im (its
    gradient rule: im2col): the same at opset 18 as through the Pads form at opset 17."""
    f = helper.make_tensor_value_info
    train = "ai.onnx.preview.training"

    def model(opset):
        nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2]),
                 helper.make_node("Mul", ["y", "y"], ["y2"]),
                 helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0),
                 helper.make_node("Gradient", ["x", "w"], ["dx", "dw"], domain=train, xs=["x", "w"], y="loss",
                                  name="inner"),
                 helper.make_node("Mul", ["dx", "v"], ["p"]),
                 helper.make_node("ReduceSum", ["p"], ["s"], keepdims=0),
                 helper.make_node("Gradient", ["x", "w"], ["hx", "hw"], domain=train, xs=["x", "w"], y="s",
                                  name="outer")]
        graph = helper.make_graph(nodes, "g", [f("x", F32, [2, 3, 4, 4]), f("w", F32, [4, 3, 3, 3]),
                                               f("v", F32, [2, 3, 4, 4])],
                                  [f("hx", F32, [2, 3, 4, 4]), f("hw", F32, [4, 3, 3, 3])])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                       helper.make_opsetid(train, 1)], ir_version=9)

    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((2, 3, 4, 4)).astype(np.float32),
             "w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
             "v": rng.standard_normal((2, 3, 4, 4)).astype(np.float32)}
    results = {}
    for opset in (17, 18):
        lowered = lower(model(opset))
        onnx.checker.check_model(lowered, full_check=True)
        results[opset] = (ort.InferenceSession(lowered.SerializeToString()).run(None, feeds),
                          {n.op_type for n in lowered.graph.node})
    assert "Col2Im" in results[18][1] and "Col2Im" not in results[17][1]
    for a, b in zip(results[18][0], results[17][0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


@pytest.mark.parametrize("xs,ws,attrs", [((2, 6, 2, 2), (6, 3, 3, 3), {"strides": [2, 2], "pads": [1, 0, 0, 1]}),
                                         ((1, 4, 2, 2), (4, 2, 2, 2), {"dilations": [2, 1], "strides": [1, 2]})])
def test_conv_transpose_weight_gradient_at_few_positions(xs, ws, attrs):
    """ConvTranspose's weight gradient is the same correlation with x and dy traded: over x's 4 positions it takes
    the one-Gemm im2col form too."""
    f = helper.make_tensor_value_info
    g = helper.make_graph([helper.make_node("ConvTranspose", ["x", "w"], ["y"], **attrs)], "g",
                          [f("x", F32, list(xs)), f("w", F32, list(ws))], [])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    model.graph.output.append(inferred["y"])
    feeds = _data(model, xs, ws, seed=6)
    one, one_ops = _backward(model, ["w"], feeds, im2col_columns=0)
    offsets, offsets_ops = _backward(model, ["w"], feeds, im2col_columns=0, im2col_weight_grad_max_out=0)
    conv, _ = _backward(model, ["w"], feeds, gemm_weight_grad=False)
    assert one_ops.count("Gemm") == 1 and offsets_ops.count("Gemm") == int(np.prod(ws[2:]))
    atol = 1e-5 * np.abs(conv["w"]).max()
    np.testing.assert_allclose(one["w"], conv["w"], rtol=1e-4, atol=atol)
    np.testing.assert_allclose(offsets["w"], conv["w"], rtol=1e-4, atol=atol)
