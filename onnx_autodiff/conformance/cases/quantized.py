"""MatMulNBits (onnxruntime's 2/4/8-bit weight-only product), DynamicQuantizeMatMul (its int8 product with the
activation quantized at run time) and DequantizeLinear's scale.

onnxruntime runs both in float32 only (DequantizeLinear's scale is float/float16/bfloat16), so these
cases check in float32. The checked sum <Y, v> is linear in every differentiated input (A, bias, scale),
so a central difference with eps = 1 has no truncation error: what is left is float32 rounding of sums
of at most a few hundred terms (~1e-6 relative), hence rtol 1e-4. MatMulNBits at accuracy_level 4 rounds A
to int8 (a step function of A, so finite differences cannot check it): tests/rules/test_quantized.py holds
its forward to the float product within that rounding and its gradient to the one these cases check.
DynamicQuantizeMatMul always rounds A to uint8 over A's range: its cases check the float product
(check/contrib_forms.dynamic_quantize_matmul) against the kernel within that rounding (A in [-2, 2]: a step of 4/255,
at most half of it per element, summed over K = 16 products of codes below 127 times scales below 0.02;
measured: at most 0.07 on outputs up to 16: forward_atol 0.1), then gradcheck the rule (a straight-through
estimate, which is the float product's gradient) in float64 with the float product in the kernel's place.
"""
import numpy as np

from onnx_autodiff.testing import In, RuleCase

from .contrib_forms import dynamic_quantize_matmul

NOT_CASED = {
    "GatherBlockQuantized": "a quantized embedding: nothing of it is differentiable, and its rule only refuses "
                            "the scales (tests/rules/test_contrib.py); its type rule in tests/rules/test_type_rules.py",
}

_F32 = {"float64": False, "eps": 1.0, "rtol": 1e-4, "atol": 1e-5}
_rng = np.random.default_rng(22)


def _nbits(k, n, block, bits=4, zp=None, bias=False, id="", **attrs):
    """A [2, 3, K] @ dequant(B)^T with random packed codes, scales in [0.5, 1.5] and zero points
    (None: the default; "packed": uint8 packed like B; "float": unpacked, in A's type)."""
    blocks = -(-k // block)
    inputs = [In((2, 3, k), dtype="float32"),
              In(value=_rng.integers(0, 256, (n, blocks, block * bits // 8)), dtype="uint8"),
              In((n, blocks), low=0.5, high=1.5, dtype="float32", const=True)]
    if zp == "packed":
        inputs.append(In(value=_rng.integers(0, 256, (n, -(-blocks * bits // 8))), dtype="uint8"))
    elif zp == "float":
        inputs.append(In((n, blocks), low=0.0, high=2.0 ** bits - 1, dtype="float32", const=True))
    elif bias:
        inputs.append(None)
    if bias:
        inputs += [None, In((n,), dtype="float32")]
    return RuleCase("MatMulNBits", inputs, attrs={"K": k, "N": n, "bits": bits, "block_size": block, **attrs},
                    domain="com.microsoft", id=id, **_F32)


def _dq(x_shape, scale_shape, low, high, dtype, zp=True, id="", opset=21, **attrs):
    """DequantizeLinear of fixed integer codes, differentiated by its scale."""
    x = In(value=_rng.integers(low, high + 1, x_shape), dtype=dtype)
    z = In(value=_rng.integers(low, high + 1, scale_shape), dtype=dtype) if zp else None
    inputs = [x, In(scale_shape, low=0.5, high=1.5, dtype="float32")] + ([z] if zp else [])
    return RuleCase("DequantizeLinear", inputs, attrs=attrs, opset=opset, id=id, **_F32)


def _dynamic(k, n, per_column=False, zp=True, bias=False, signed=True, id=""):
    """A [2, 3, K] float32 @ int8 (or uint8) B [K, N] with scales in [0.005, 0.02]. A signed B stays in 7 bits: on a
    CPU without VNNI (AVX2) onnxruntime multiplies A's uint8 codes by B's int8 ones in pairs summed in int16
    (vpmaddubsw), which saturates once |B| passes 64 (255 * 127 * 2 > 32767) and is off by up to 6 on these
    outputs; with 7-bit weights every x86 kernel computes the product exactly (onnxruntime's own advice on AVX2)."""
    low, high, dtype = (-63, 63, "int8") if signed else (0, 255, "uint8")
    shape = (n,) if per_column else ()
    inputs = [In((2, 3, k), dtype="float32"), In(value=_rng.integers(low, high + 1, (k, n)), dtype=dtype),
              In(shape, low=0.005, high=0.02, dtype="float32", const=True)]
    inputs.append(In(value=_rng.integers(low // 8, high // 8 + 1, shape), dtype=dtype) if zp else None)
    if bias:
        inputs.append(In((n,), dtype="float32"))
    return RuleCase("DynamicQuantizeMatMul", inputs, domain="com.microsoft", opset=21, forward_rtol=0.0,
                    forward_atol=0.1, reference=dynamic_quantize_matmul, id=id)


CASES = [
    _dynamic(16, 8, id="int8-per-tensor"),
    _dynamic(16, 8, per_column=True, bias=True, id="int8-per-column-bias"),
    _dynamic(16, 5, zp=False, signed=False, id="uint8-no-zp"),
    _nbits(64, 8, 32, id="4bit"),
    _nbits(80, 6, 32, zp="packed", bias=True, id="4bit-packed-zp-bias-partial-block"),
    _nbits(40, 5, 16, zp="float", id="4bit-float-zp"),
    _nbits(48, 4, 16, bits=8, zp="packed", id="8bit"),
    _nbits(48, 4, 16, bits=2, zp="packed", id="2bit"),
    _nbits(48, 4, 16, bits=2, bias=True, id="2bit-bias"),
    # accuracy_level 1 (float32 compute, as 0); level 4, which rounds A to int8 in blocks, in test_quantized.py
    _nbits(64, 8, 32, id="4bit-level1", accuracy_level=1),
    _nbits(80, 6, 32, zp="packed", id="4bit-packed-zp-level1", accuracy_level=1),
    _dq((6, 5), (), 0, 255, "uint8", opset=13, id="per-tensor"),
    _dq((6, 5), (5,), -128, 127, "int8", axis=1, opset=13, id="per-axis"),
    _dq((10, 4), (3, 4), 0, 15, "uint4", axis=0, block_size=4, id="int4-blocked-partial"),
    _dq((3, 8), (3, 2), -8, 7, "int4", zp=False, axis=1, block_size=4, id="int4-blocked-no-zp"),
]
