import numpy as np

from onnx_autodiff.testing import In, RuleCase


def _unpool_indices(shape, size):
    """Flat indices into an output of spatial ``size``, one per 2x2 window at a random offset: what a
    disjoint MaxPool's Indices look like."""
    n, c, h, w = shape
    rng = np.random.default_rng(5)
    di, dj = rng.integers(0, 2, shape), rng.integers(0, 2, shape)
    rows = 2 * np.arange(h)[:, None] + di
    cols = 2 * np.arange(w)[None, :] + dj
    planes = (np.arange(n)[:, None] * c + np.arange(c)[None, :])[:, :, None, None]
    return In(value=(planes * size[0] + rows) * size[1] + cols, dtype="int64")


# values spread far enough apart that no window has a near-tie for its maximum
_X = In((2, 3, 7, 6), low=-4.0, high=4.0)

CASES = [
    RuleCase("MaxPool", [_X], attrs={"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
             id="overlap-pads"),
    RuleCase("MaxPool", [_X], attrs={"kernel_shape": [2, 2]}, outputs=2, check_outputs=[0], id="indices-output"),
    RuleCase("MaxPool", [_X], attrs={"kernel_shape": [2, 2], "strides": [2, 2], "storage_order": 1}, outputs=2,
             check_outputs=[0], opset=13, id="opset13-column-major"),
    RuleCase("MaxPool", [In((1, 2, 9))], attrs={"kernel_shape": [3], "strides": [2], "dilations": [2],
                                               "ceil_mode": 1}, id="1d-dilated-ceil"),
    RuleCase("MaxPool", [In((1, 2, 5, 4, 6))], attrs={"kernel_shape": [2, 2, 3], "auto_pad": "SAME_UPPER"},
             id="3d-same-upper"),
    RuleCase("MaxPool", [_X], attrs={"kernel_shape": [3, 2], "strides": [3, 2]}, opset=12, id="opset12-disjoint"),
    RuleCase("MaxPool", [In((2, 3, 6, 4), low=-4.0, high=4.0)], attrs={"kernel_shape": [2, 2], "strides": [2, 2]},
             id="tiles-unpool"),
    RuleCase("MaxUnpool", [In((2, 3, 2, 3)), _unpool_indices((2, 3, 2, 3), (4, 6))],
             attrs={"kernel_shape": [2, 2], "strides": [2, 2]}),
]

# onnxruntime 1.31 CPU has no float64 kernel for these: gradcheck's runtime="auto" runs them in float64 through
# onnx's reference evaluator (tests/rules/test_conv_torch.py and test_norm_pool_torch.py also hold them against torch
# autograd). Its GlobalMaxPool drops the channel axis of a rank-3 input ((N, C, L) -> (N, 1)), so no 1-D case here.
CASES += [
    RuleCase("AveragePool", [In((2, 3, 7, 6))], attrs={"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
             id="exclude-pad"),
    RuleCase("AveragePool", [In((2, 3, 7, 6))], attrs={"kernel_shape": [3, 2], "strides": [2, 1],
                                                     "pads": [1, 1, 1, 0], "count_include_pad": 1}, id="include-pad"),
    RuleCase("AveragePool", [In((1, 2, 8))], attrs={"kernel_shape": [3], "strides": [2], "ceil_mode": 1}, id="1d-ceil"),
    RuleCase("AveragePool", [In((1, 2, 5, 4, 4))], attrs={"kernel_shape": [2, 2, 2], "strides": [2, 2, 2]}, id="3d"),
    RuleCase("AveragePool", [In((1, 2, 6, 5))], attrs={"kernel_shape": [3, 2], "auto_pad": "SAME_UPPER"}, opset=11,
             id="same-upper-opset11"),
    RuleCase("GlobalAveragePool", [In((2, 3, 4, 5))]),
    RuleCase("GlobalAveragePool", [In((2, 3, 4, 5), dims=["N", "C", "H", "W"])], id="symbolic"),
    RuleCase("GlobalMaxPool", [In((2, 3, 4, 5))]),
    RuleCase("GlobalMaxPool", [In((2, 3, 4, 2), dims=["N", "C", 4, 2])], id="symbolic"),
]

# LpPool: values kept away from zero: |x|^(p-1) sign(x) has a kink there for p < 2
_LP = dict(low=-2.0, high=2.0, gap=0.2)

CASES += [
    RuleCase("LpPool", [In((2, 3, 5, 6), **_LP)], attrs={"p": 2, "kernel_shape": [2, 3]}, id="p2"),
    RuleCase("LpPool", [In((2, 3, 7), **_LP)], attrs={"p": 3, "kernel_shape": [3], "strides": [2]}, id="p3-1d-stride"),
    RuleCase("LpPool", [In((1, 2, 5, 5), **_LP)], attrs={"p": 1, "kernel_shape": [3, 3], "strides": [2, 2],
                                                      "pads": [1, 0, 1, 2]}, id="p1-pads"),
    # (no ceil_mode case: onnx.reference's LpPool with ceil_mode=1 differs from onnxruntime's forward by ~1.0)
]

NOT_CASED = {"GlobalLpPool": "onnx.reference has no GlobalLpPool kernel and onnxruntime 1.31 no float64 one; "
                             "checked against torch autograd in tests/rules/test_norm_pool_torch.py"}
