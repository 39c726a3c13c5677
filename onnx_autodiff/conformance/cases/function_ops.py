"""Ops without a rule of their own, differentiated through their schema's function body (engine/function_ops.py):
in the sweep so that every opset they exist at, and the random graphs made from the cases, see them too.
tests/engine/test_function_ops.py checks that the lowered gradient has the op expanded, and holds
MeanVarianceNormalization and RotaryEmbedding (float32 only) against torch."""
import numpy as np

from onnx_autodiff.testing import In, RuleCase


def ints(v):
    return In(value=np.asarray(v, dtype=np.int64), dtype="int64")


def cache(*shape):
    """A cos / sin cache: a float32 constant of the model."""
    return In(shape, const=True, dtype="float32")


def x32(*shape):
    return In(shape, dtype="float32")


_F32 = {"float64": False, "eps": 1.0, "rtol": 1e-4, "atol": 1e-5}


CASES = [
    RuleCase("CenterCropPad", [In((5, 4)), ints([3, 6])], opset=18, id="crop-and-pad-cdf"),
    RuleCase("CenterCropPad", [In((2, 5, 4)), ints([2, 7])], attrs={"axes": [-1, 1]}, opset=21, id="axes-cdf"),
    RuleCase("RMSNormalization", [In((2, 3, 4)), In((4,))], opset=23, id="cdf"),
    RuleCase("RMSNormalization", [In((2, 3, 4)), In((3, 4))], attrs={"axis": -2, "epsilon": 0.1}, opset=23,
             id="axis-cdf"),
    RuleCase("Swish", [In((2, 3))], attrs={"alpha": 0.7}, opset=24),
    RuleCase("Attention", [In((1, 2, 3, 4)), In((1, 2, 3, 4)), In((1, 2, 3, 4))], opset=23, id="cdf"),
    RuleCase("Attention", [In((2, 3, 4)), In((2, 5, 4)), In((2, 5, 6))],
             attrs={"q_num_heads": 2, "kv_num_heads": 2, "is_causal": 1, "scale": 0.3}, opset=23, id="3d-causal-cdf"),
    RuleCase("Attention", [In((2, 3, 4)), In((2, 5, 4)), In((2, 5, 6)), In((3, 5))],
             attrs={"q_num_heads": 2, "kv_num_heads": 2}, opset=23, id="3d-float-mask-cdf"),
    # RotaryEmbedding admits no float64 (its schema), and is linear in X for constant caches: checked in float32
    # with eps = 1, where a central difference has no truncation error, only float32 rounding (~1e-6 relative)
    RuleCase("RotaryEmbedding", [x32(2, 2, 3, 4), cache(2, 3, 2), cache(2, 3, 2)], opset=23, id="f32", **_F32),
    RuleCase("RotaryEmbedding", [x32(2, 3, 8), cache(2, 3, 2), cache(2, 3, 2)], attrs={"num_heads": 2}, opset=23,
             id="3d-f32", **_F32),
    RuleCase("RotaryEmbedding", [x32(2, 2, 3, 8), cache(2, 3, 2), cache(2, 3, 2)],
             attrs={"rotary_embedding_dim": 4}, opset=23, id="partial-f32", **_F32),
    # position_ids: the body splits at a computed size (its types come from engine-side inference, graph.py)
    RuleCase("RotaryEmbedding", [x32(2, 2, 3, 4), cache(5, 2), cache(5, 2), ints([[0, 2, 4], [1, 1, 3]])],
             attrs={"interleaved": 1}, opset=23, id="positions-interleaved-f32", **_F32),
    RuleCase("RotaryEmbedding", [x32(2, 3, 8), cache(5, 2), cache(5, 2), ints([[0, 2, 4], [1, 1, 3]])],
             attrs={"num_heads": 2}, opset=23, id="3d-positions-f32", **_F32),
]
