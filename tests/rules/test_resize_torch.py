"""Resize and Upsample gradients against torch autograd and against onnxruntime's own forward.

onnxruntime 1.31's CPU provider has no float64 Resize or Upsample kernel, so the float64
finite-difference sweep cannot run them. Two checks stand in:

- where torch has the same interpolation (nearest, nearest-exact, bilinear, bicubic, trilinear,
  antialiased bilinear), the lowered gradient in float32 onnxruntime is held against torch autograd in
  float64 on the same inputs, as in tests/rules/test_conv_torch.py (torch's antialiasing drops the taps outside
  the input and renormalizes, which is ONNX's exclude_outside=1);
- every attribute combination onnxruntime runs is held against the exact linear map of onnxruntime's
  float32 forward: Resize is affine in X, so running the one-node model on each basis vector (minus its
  value at zero, which carries tf_crop_and_resize's extrapolation value) gives its Jacobian J, and the
  gradient for an output weighting v must be ``J^T v``. The weights come out of the forward exactly, so
  only float32 accumulation separates the two; 1e-4 of the gradient's scale is a real check.
"""
from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

import onnx_autodiff as oa
from onnx_autodiff.conformance.cases.resize import EMPTY, resize, scales, sizes
from onnx_autodiff.engine.registry import find_rule, is_non_differentiable
from onnx_autodiff.errors import GradientRuleError
from onnx_autodiff.testing import RuleCase, rule_case_model
from tests.rules.test_conv_torch import RTOL, _run, assert_matches_torch, emitted_op_types, f32, lowered_gradients
from tests.torch_export import assert_close, session, with_gradient
from tests.torch_export import lowered_gradients as lowered_model_gradients


# ---- against torch ---------------------------------------------------------------------------------
def interp(**kw):
    return lambda x0: F.interpolate(x0, **kw)


TORCH = [
    (resize(f32(2, 3, 4, 5), None, scales(1, 1, 2, 3), mode="nearest", coordinate_transformation_mode="asymmetric",
            nearest_mode="floor", id="nearest-scales"),
     interp(scale_factor=(2, 3), mode="nearest")),
    (resize(f32(2, 3, 4, 9), None, None, sizes(2, 3, 5, 7), mode="nearest",
            coordinate_transformation_mode="asymmetric", nearest_mode="floor", id="nearest-sizes-up-down"),
     interp(size=(5, 7), mode="nearest")),
    (resize(f32(2, 3, 4, 5), None, scales(1, 1, 2.5, 0.6), mode="nearest", coordinate_transformation_mode="half_pixel",
            nearest_mode="round_prefer_ceil", id="nearest-exact"),
     interp(scale_factor=(2.5, 0.6), mode="nearest-exact")),
    (resize(f32(2, 3, 4, 5), None, scales(1, 1, 2, 1.5), mode="linear", id="bilinear-half-pixel"),
     interp(scale_factor=(2, 1.5), mode="bilinear", align_corners=False)),
    (resize(f32(1, 2, 7, 8), None, None, sizes(1, 2, 3, 5), mode="linear", id="bilinear-downsample-sizes"),
     interp(size=(3, 5), mode="bilinear", align_corners=False)),
    (resize(f32(2, 2, 4, 5), None, None, sizes(2, 2, 7, 3), mode="linear",
            coordinate_transformation_mode="align_corners", id="bilinear-align-corners"),
     interp(size=(7, 3), mode="bilinear", align_corners=True)),
    (resize(f32(2, 2, 4, 5), None, scales(1, 1, 2, 2), mode="linear",
            coordinate_transformation_mode="pytorch_half_pixel", id="bilinear-pytorch-half-pixel"),
     interp(scale_factor=2, mode="bilinear", align_corners=False)),
    (resize(f32(2, 3, 4, 5), EMPTY, scales(1, 1, 2, 1.5), mode="cubic", opset=11, id="bicubic-opset11"),
     interp(scale_factor=(2, 1.5), mode="bicubic", align_corners=False)),
    (resize(f32(1, 2, 5, 4), None, None, sizes(1, 2, 3, 9), mode="cubic",
            coordinate_transformation_mode="align_corners", id="bicubic-align-corners"),
     interp(size=(3, 9), mode="bicubic", align_corners=True)),
    (resize(f32(1, 2, 3, 4, 5), None, scales(1, 1, 2, 1.5, 0.6), mode="linear", id="trilinear"),
     interp(scale_factor=(2, 1.5, 0.6), mode="trilinear", align_corners=False)),
    (resize(f32(2, 3, 6), None, scales(1, 1, 1.5), mode="linear", id="linear-3d"),
     interp(scale_factor=1.5, mode="linear", align_corners=False)),
    (resize(f32(1, 2, 9, 8), None, None, sizes(1, 2, 4, 3), mode="linear", antialias=1, exclude_outside=1, opset=18,
            id="bilinear-antialias"),
     interp(size=(4, 3), mode="bilinear", align_corners=False, antialias=True)),
    (resize(f32(1, 2, 9, 8), None, None, sizes(4, 3), mode="cubic", antialias=1, cubic_coeff_a=-0.5,
            exclude_outside=1, axes=[2, 3], opset=18, id="bicubic-antialias-axes"),
     interp(size=(4, 3), mode="bicubic", align_corners=False, antialias=True)),
    (resize(f32(2, 3, 4, 5), None, scales(2, 3), mode="nearest", coordinate_transformation_mode="asymmetric",
            nearest_mode="floor", axes=[-2, -1], opset=18, id="nearest-axes"),
     interp(scale_factor=(2, 3), mode="nearest")),
    (resize(f32(2, 3, 4, 5, dims=["N", "C", 4, 5]), None, scales(1, 1, 2, 1.5), mode="linear", id="symbolic-batch"),
     interp(scale_factor=(2, 1.5), mode="bilinear", align_corners=False)),
    (RuleCase("Upsample", [f32(2, 3, 4, 5), scales(1, 1, 2, 3)], opset=9, id="opset9-nearest"),
     interp(scale_factor=(2, 3), mode="nearest")),
    (RuleCase("Upsample", [f32(2, 3, 4, 5)], attrs={"scales": [1.0, 1.0, 3.0, 2.0]}, opset=7, id="opset7-nearest"),
     interp(scale_factor=(3, 2), mode="nearest")),
    (RuleCase("Resize", [f32(2, 3, 4, 5), scales(1, 1, 2, 2)], opset=10, id="opset10-nearest"),
     interp(scale_factor=2, mode="nearest")),
]


@pytest.mark.parametrize("case,fn", TORCH, ids=[c.name for c, _ in TORCH])
def test_resize_matches_torch(case, fn):
    assert_matches_torch(case, fn)


# ---- against onnxruntime's own forward -------------------------------------------------------------
def forward_jacobian(case: RuleCase, seed: int = 0) -> np.ndarray:
    """J (outputs x inputs, float64) of the one-node model in x0, from onnxruntime's float32 forward on
    each basis vector minus its value at zero."""
    model, feeds, _ = rule_case_model(case, seed)
    y = model.graph.output[0].name
    x = feeds["x0"]
    at = lambda v: _run(model, {**feeds, "x0": v})[y].astype(np.float64).reshape(-1)  # noqa: E731
    base = at(np.zeros_like(x))
    cols = []
    for i in range(x.size):
        e = np.zeros(x.size, dtype=x.dtype)
        e[i] = 1
        cols.append(at(e.reshape(x.shape)) - base)
    return np.stack(cols, axis=1)


def assert_matches_forward(case: RuleCase, seed: int = 0, drawn: bool = False):
    """``drawn``: a case hypothesis made up, which may have an output that does not depend on x at all
    (every sample outside a roi, extrapolated): such a case tests nothing and is rejected, not failed."""
    feeds, (v,), ours = lowered_gradients(case, seed)
    want = (forward_jacobian(case, seed).T @ v.astype(np.float64).reshape(-1)).reshape(feeds["x0"].shape)
    got = ours["x0"]
    assert got.shape == want.shape
    scale = np.abs(want).max()
    if drawn and scale == 0:
        assert np.abs(got).max() == 0, f"{case.name}: the output does not depend on x, but the gradient is not 0"
        reject()
    assert scale > 0, f"{case.name}: the gradient is zero: the case tests nothing"
    err = np.abs(got.astype(np.float64) - want).max() / scale
    assert err <= RTOL, f"{case.name}: gradient off by {err:.2e} (relative to max |grad|)"


X4 = f32(1, 2, 4, 5)

FORWARD = [
    RuleCase("Upsample", [X4], attrs={"scales": [1.0, 1.0, 2.0, 1.5], "mode": "linear"}, opset=7, id="opset7-linear"),
    RuleCase("Upsample", [X4, scales(1, 1, 2.5, 3)], attrs={"mode": "linear"}, opset=9, id="opset9-linear"),
    RuleCase("Upsample", [X4, scales(1, 1, 1.5, 2.5)], opset=9, id="opset9-nearest-fractional"),
    RuleCase("Resize", [X4, scales(1, 1, 0.6, 0.5)], attrs={"mode": "linear"}, opset=10, id="opset10-linear-down"),
    RuleCase("Resize", [X4, scales(1, 1, 1.5, 0.7)], opset=10, id="opset10-nearest-fractional"),
    resize(X4, EMPTY, EMPTY, sizes(1, 2, 7, 3), mode="nearest", nearest_mode="round_prefer_floor", opset=11,
           id="opset11-sizes-round-prefer-floor"),
    resize(X4, None, scales(1, 1, 1.5, 0.6), mode="nearest", nearest_mode="ceil",
           coordinate_transformation_mode="align_corners", id="nearest-ceil-align-corners"),
    resize(X4, None, scales(1, 1, 2, 0.5), mode="linear", coordinate_transformation_mode="asymmetric",
           id="linear-asymmetric"),
    resize(f32(1, 2, 4, 5), None, None, sizes(1, 2, 1, 3), mode="linear",
           coordinate_transformation_mode="pytorch_half_pixel", id="pytorch-half-pixel-length-1"),
    resize(X4, scales(0, 0, -0.2, 0.1, 1, 1, 1.3, 0.9), scales(1, 1, 2, 1.5), mode="linear",
           coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=5.0, id="tf-crop-extrapolate"),
    resize(X4, scales(0, 0, 0.1, -0.3, 1, 1, 0.8, 1.2), EMPTY, sizes(1, 2, 3, 6), mode="nearest",
           coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=-1.0, opset=11,
           id="tf-crop-nearest-opset11"),
    resize(X4, scales(0.2, 1.1), None, sizes(6), mode="cubic", coordinate_transformation_mode="tf_crop_and_resize",
           axes=[2], opset=18, id="tf-crop-cubic-axes"),
    resize(X4, None, scales(1, 1, 1.5, 2.5), mode="cubic", exclude_outside=1, cubic_coeff_a=-0.5,
           id="cubic-exclude-outside"),
    resize(X4, None, scales(1, 1, 0.5, 0.7), mode="cubic", antialias=1, opset=18, id="cubic-antialias"),
    resize(X4, None, scales(1, 1, 1.4, 0.6), mode="linear", coordinate_transformation_mode="half_pixel_symmetric",
           opset=19, id="half-pixel-symmetric"),
    resize(X4, None, None, sizes(3, 9), mode="linear", keep_aspect_ratio_policy="stretch", axes=[3, 2], opset=18,
           id="sizes-axes-reversed"),
    resize(f32(4, 5), None, scales(2, 0.5), mode="linear", id="2d-both-axes"),
    resize(f32(7), None, scales(1.5), mode="nearest", id="1d"),
    resize(f32(3, 4, 5), None, scales(2, 1, 1.5), mode="nearest", coordinate_transformation_mode="half_pixel",
           id="3d-nearest-leading-axis"),
    resize(f32(1, 2, 3, 4, 5), None, scales(1, 1, 2, 1.5, 0.6), mode="linear", id="5d-trilinear"),
    resize(f32(2, 3, 2, 4, 5, dims=[2, 3, 2, "H", "W"]), None, scales(1, 1, 2, 1, 1), mode="nearest",
           id="leading-axis-symbolic-tail"),
    resize(f32(1, 3, 4, 2), None, scales(1, 2, 1.5, 1), mode="linear", id="nhwc"),
]


@pytest.mark.parametrize("case", FORWARD, ids=[c.name for c in FORWARD])
def test_resize_matches_onnxruntime_forward(case):
    assert_matches_forward(case)


@st.composite
def resize_cases(draw):
    """A 4-D Resize over its two spatial axes with any mode, coordinate transform and rounding."""
    opset = draw(st.sampled_from([11, 13, 18, 19]))
    mode = draw(st.sampled_from(["nearest", "linear", "cubic"]))
    coords = ["half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel", "tf_crop_and_resize"]
    if opset >= 19:
        coords.append("half_pixel_symmetric")
    attrs = {"mode": mode, "coordinate_transformation_mode": draw(st.sampled_from(coords))}
    if mode == "nearest":
        attrs["nearest_mode"] = draw(st.sampled_from(["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]))
    if mode == "cubic":
        attrs["exclude_outside"] = draw(st.integers(0, 1))
        attrs["cubic_coeff_a"] = draw(st.sampled_from([-0.75, -0.5]))
    if mode != "nearest" and opset >= 18:
        attrs["antialias"] = draw(st.integers(0, 1))
    hw = [draw(st.integers(1, 5)) for _ in range(2)]
    factors = [draw(st.sampled_from([0.5, 0.6, 1.0, 1.5, 2.0, 2.5])) for _ in range(2)]
    out = [int(np.floor(np.float32(f) * np.float32(n))) for f, n in zip(factors, hw)]
    if min(out) < 1:
        factors = [max(f, 1.0) for f in factors]
    roi = scales()
    if attrs["coordinate_transformation_mode"] == "tf_crop_and_resize":
        lo = [draw(st.sampled_from([-0.2, 0.0, 0.3])) for _ in range(2)]
        hi = [draw(st.sampled_from([0.7, 1.0, 1.4])) for _ in range(2)]
        roi = scales(0, 0, *lo, 1, 1, *hi)
        attrs["extrapolation_value"] = draw(st.sampled_from([0.0, 2.0]))
    if draw(st.booleans()):
        rest = [roi, EMPTY, sizes(1, 2, *[draw(st.integers(1, 6)) for _ in range(2)])]
    else:
        rest = [roi, scales(1, 1, *factors)]
    if opset >= 13 and not roi.value.size:
        rest[0] = None
    return RuleCase("Resize", [f32(1, 2, *hw), *rest], attrs=attrs, opset=opset, id="hypothesis")


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(resize_cases())
def test_resize_matches_onnxruntime_forward_for_any_attributes(case):
    assert_matches_forward(case, drawn=True)


def with_runtime_inputs(case: RuleCase, names: list[str]):
    """The case's model with the initializers ``names`` turned into graph inputs fed at run time."""
    model, feeds, wrt = rule_case_model(case)
    g = model.graph
    for init in [t for t in g.initializer if t.name in names]:
        value = onnx.numpy_helper.to_array(init)
        g.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(value.shape)))
        feeds[init.name] = value
        g.initializer.remove(init)
    return model, feeds, wrt


def test_run_time_scales_and_roi():
    """Scales and roi fed at run time: every axis gets its matrix from them (identity where the scale is 1)."""
    case = resize(X4, scales(0, 0, -0.2, 0.1, 1, 1, 1.3, 0.9), scales(1, 1, 2, 1.5), mode="linear",
                  coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=3.0)
    model, feeds, _ = with_runtime_inputs(case, ["x1", "x2"])
    v = np.random.default_rng(1).standard_normal([1, 2, 8, 7]).astype(np.float32)
    g = model.graph
    g.initializer.append(onnx.numpy_helper.from_array(v, "v"))
    g.node.extend([onnx.helper.make_node("Mul", ["y0", "v"], ["p"]),
                   onnx.helper.make_node("ReduceSum", ["p"], ["s"], keepdims=0)])
    grad_model, (name,) = with_gradient(model, "s", ["x0"])
    lowered = oa.lower(grad_model)
    got = session(lowered).run([name], feeds)[0]
    want = (forward_jacobian(case).T @ v.astype(np.float64).reshape(-1)).reshape(got.shape)
    assert np.abs(got - want).max() <= RTOL * np.abs(want).max()
    assert {"Gather", "Resize"} <= {n.op_type for n in lowered.graph.node if "/grad/" in n.name}


# ---- exported torch models --------------------------------------------------------------------------
class Interpolate(torch.nn.Module):
    """F.interpolate, then the sum of squares, so the gradient reaching the resize is not uniform."""

    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, x):
        y = F.interpolate(x, **self.kw)
        return (y * y).sum()


EXPORTED = [
    ((2, 3, 4, 5), dict(scale_factor=2, mode="nearest")),
    ((2, 3, 4, 9), dict(size=(5, 7), mode="nearest")),
    ((2, 3, 4, 5), dict(scale_factor=(2, 1.5), mode="bilinear", align_corners=False)),
    ((2, 3, 4, 5), dict(scale_factor=1.5, mode="bilinear", align_corners=True)),
    ((1, 2, 7, 8), dict(size=(3, 5), mode="bilinear", align_corners=False)),
    ((2, 2, 5, 4), dict(size=(7, 3), mode="bilinear", align_corners=True)),
    ((2, 3, 4, 5), dict(scale_factor=2, mode="bicubic", align_corners=False)),
    ((1, 2, 3, 4, 5), dict(scale_factor=(2, 1.5, 1), mode="trilinear", align_corners=False)),
    ((2, 3, 7), dict(size=4, mode="linear", align_corners=False)),
]


def export(module, x, opset):
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), buf, dynamo=False, opset_version=opset, input_names=["x"],
                          output_names=["loss"], dynamic_axes={"x": {0: "N"}})
    return onnx.load_from_string(buf.getvalue())


@pytest.mark.parametrize("opset", [11, 17])
@pytest.mark.parametrize("shape,kw", EXPORTED, ids=[f"{kw['mode']}-{'-'.join(map(str, s))}" for s, kw in EXPORTED])
def test_exported_interpolate_matches_torch(shape, kw, opset):
    """torch.onnx.export (TorchScript) at opsets 11 and 17 with a symbolic batch: scales come from
    Constants, sizes from Shape/Slice/Concat (their batch and channel entries are Shape(x)'s, so those
    axes keep their length though shape inference gives the output fresh symbolic dims)."""
    module = Interpolate(**kw)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    model = export(module, torch.tensor(x), opset)
    assert "Resize" in {n.op_type for n in model.graph.node}
    ours = lowered_model_gradients(model, "loss", ["x"], {"x": x})
    xt = torch.tensor(x.astype(np.float64), requires_grad=True)
    module(xt).backward()
    assert_close(ours, {"x": xt.grad.numpy()}, RTOL)


# ---- what the rule refuses, and second order ------------------------------------------------------------
def test_keep_aspect_ratio_with_sizes_says_why():
    case = resize(X4, None, None, sizes(8, 8), mode="linear", keep_aspect_ratio_policy="not_larger", axes=[2, 3],
                  opset=18)
    with pytest.raises(GradientRuleError, match="keep_aspect_ratio_policy"):
        lowered_gradients(case)


def test_symbolic_resized_axis_says_why():
    case = resize(f32(1, 2, 4, 5, dims=[1, 2, "H", 5]), None, scales(1, 1, 2, 1), mode="nearest")
    with pytest.raises(GradientRuleError, match="static input and output sizes along resized axis 2"):
        lowered_gradients(case)


SECOND_ORDER = ["Resize-bilinear-half-pixel", "Upsample-opset7-linear", "Resize-tf-crop-extrapolate",
                "Resize-3d-nearest-leading-axis", "Resize-leading-axis-symbolic-tail"]


@pytest.mark.parametrize("case", [c for c in [c for c, _ in TORCH] + FORWARD if c.name in SECOND_ORDER],
                         ids=lambda c: c.name)
def test_emitted_ops_are_differentiable_again(case):
    ops = emitted_op_types(case)
    assert {"MatMul", case.op} <= ops
    missing = sorted(op for op in ops if find_rule("", op, case.opset) is None and not is_non_differentiable("", op))
    assert not missing, f"{case.name} emits ops without a gradient rule: {missing}"
