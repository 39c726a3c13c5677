_TORCH = ("onnxruntime 1.31 CPU has no float64 kernel; checked against torch autograd in "
          "tests/test_norm_pool_torch.py")
NOT_CASED = {"LpPool": _TORCH, "GlobalLpPool": _TORCH}
CASES = []
