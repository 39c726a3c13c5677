from onnx_autodiff.testing import In, RuleCase

_TORCH = "onnxruntime 1.31 CPU has no float64 kernel; checked against torch autograd in tests/test_conv_torch.py"
NOT_CASED = {op: _TORCH for op in ("Conv", "ConvTranspose", "AveragePool", "GlobalAveragePool", "GlobalMaxPool")}

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
]
