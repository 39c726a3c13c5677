from onnx_autodiff.testing import In, RuleCase

# onnxruntime 1.31 CPU has no float64 kernel for these: gradcheck's runtime="auto" runs them through onnx's
# reference evaluator (tests/rules/test_norm_pool_torch.py also holds them against torch autograd).
# values kept away from zero: |x|^(p-1) sign(x) has a kink there for p < 2
_X = dict(low=-2.0, high=2.0, gap=0.2)

CASES = [
    RuleCase("LpPool", [In((2, 3, 5, 6), **_X)], attrs={"p": 2, "kernel_shape": [2, 3]}, id="p2"),
    RuleCase("LpPool", [In((2, 3, 7), **_X)], attrs={"p": 3, "kernel_shape": [3], "strides": [2]}, id="p3-1d-stride"),
    RuleCase("LpPool", [In((1, 2, 5, 5), **_X)], attrs={"p": 1, "kernel_shape": [3, 3], "strides": [2, 2],
                                                      "pads": [1, 0, 1, 2]}, id="p1-pads"),
    # (no ceil_mode case: onnx.reference's LpPool with ceil_mode=1 differs from onnxruntime's forward by ~1.0)
]

NOT_CASED = {"GlobalLpPool": "onnx.reference has no GlobalLpPool kernel and onnxruntime 1.31 no float64 one; "
                             "checked against torch autograd in tests/rules/test_norm_pool_torch.py"}
