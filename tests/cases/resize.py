"""Resize and Upsample: onnxruntime 1.31's CPU provider runs them in float32 (and smaller) only, so
the float64 finite-difference sweep cannot run them."""

_REASON = ("onnxruntime 1.31 CPU has no float64 kernel; checked against torch autograd and against the "
           "exact linear map of onnxruntime's own float32 forward in tests/test_resize_torch.py")
NOT_CASED = {"Resize": _REASON, "Upsample": _REASON}

CASES = []
