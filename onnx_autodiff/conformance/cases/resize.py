"""Resize and Upsample: onnxruntime 1.31's CPU provider runs them in float32 (and smaller) only; gradcheck's
runtime="auto" runs the float64 cases through onnx's reference evaluator. tests/rules/test_resize_torch.py also
checks them against torch autograd and the exact linear map of onnxruntime's own float32 forward."""
import numpy as np

from onnx_autodiff.testing import In, RuleCase


def scales(*v):
    return In(value=np.asarray(v, dtype=np.float32), dtype="float32")


def sizes(*v):
    return In(value=np.asarray(v, dtype=np.int64), dtype="int64")


EMPTY = scales()  # the required-but-unused roi / scales inputs of Resize-11


def resize(x_in, *rest, opset=13, id="", **attrs):
    return RuleCase("Resize", [x_in, *rest], attrs=attrs, opset=opset, id=id)


# Only ``sizes`` forms: gradcheck promotes float32 initializers to float64, which makes the float-only
# ``scales`` input (and Upsample's) fail shape inference.
X = In((1, 2, 3, 4))
CASES = [
    resize(X, None, None, sizes(1, 2, 5, 3), mode="nearest", coordinate_transformation_mode="half_pixel",
           nearest_mode="round_prefer_ceil", id="nearest-sizes-up-down"),
    resize(In((1, 2, 5, 6)), None, None, sizes(1, 2, 3, 4), mode="linear", id="bilinear-downsample-sizes"),
    resize(X, None, None, sizes(1, 2, 5, 3), mode="linear", coordinate_transformation_mode="align_corners",
           id="bilinear-align-corners"),
    resize(X, None, None, sizes(1, 2, 5, 6), mode="cubic", coordinate_transformation_mode="align_corners",
           id="bicubic-align-corners"),
    resize(In((1, 2, 7, 6)), None, None, sizes(1, 2, 4, 3), mode="linear", antialias=1, exclude_outside=1, opset=18,
           id="bilinear-antialias"),
]

NOT_CASED = {"Upsample": "its scales (input or attribute) are float32 only: gradcheck's float64 promotion of the "
                         "scales initializer fails shape inference, and onnx.reference rejects the opset-7 attribute "
                         "form and linear mode with non-integer scales; tests/rules/test_resize_torch.py checks it "
                         "against torch and onnxruntime's float32 forward"}
