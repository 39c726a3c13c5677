"""onnxruntime's RMS and skip normalizations (gradient_rules/contrib_norm.py).

onnxruntime has float32 kernels only: each case checks the standard-ONNX form of contrib_forms.py against the
kernel (forward_rtol 1e-5: float32 rounding of sums of a few dozen terms), then gradchecks the rule in float64
with the form in the kernel's place, at the sweep's usual tolerances."""
from onnx_autodiff.testing import In, RuleCase
from tests.rules.cases.contrib_forms import simplified_layer_norm, skip_norm

_MS = "com.microsoft"


def _f(shape, **kw):
    return In(shape, dtype="float32", **kw)


def _sln(x_shape, scale_shape, id, **attrs):
    return RuleCase("SimplifiedLayerNormalization", [_f(x_shape), _f(scale_shape)], attrs=attrs, outputs=2,
                    opset=21, reference=simplified_layer_norm(len(x_shape)), id=id)


def _skip(op, shapes, id, **attrs):
    """``shapes``: input, skip, gamma, then beta and bias (None: absent) as the op takes them."""
    ins = [_f(s) if s is not None else None for s in shapes]
    return RuleCase(op, ins, attrs=attrs, outputs=4, opset=21, domain=_MS, reference=skip_norm, id=id)


CASES = [
    _sln((2, 3, 8), (8,), "last-axis", epsilon=1e-6),
    _sln((2, 3, 8), (3, 8), "axis1", axis=1),
    _sln((5, 8), (8,), "2d"),
    _skip("SkipSimplifiedLayerNormalization", [(2, 3, 8), (2, 3, 8), (8,), (8,)], "bias", epsilon=1e-6),
    _skip("SkipSimplifiedLayerNormalization", [(2, 3, 8), (1, 3, 8), (8,)], "skip-1SH"),
    _skip("SkipSimplifiedLayerNormalization", [(2, 3, 8), (3, 8), (8,)], "skip-SH"),
    _skip("SkipSimplifiedLayerNormalization", [(6, 8), (6, 8), (8,)], "2d"),
    _skip("SkipLayerNormalization", [(2, 3, 8), (2, 3, 8), (8,), (8,), (8,)], "beta-bias"),
    _skip("SkipLayerNormalization", [(2, 3, 8), (3, 8), (8,)], "skip-SH-no-beta"),
]
