from onnx_autodiff.testing import In, RuleCase

CASES = [
    RuleCase("LpNormalization", [In((3, 4))], attrs={"p": 2, "axis": 0}, id="p2-axis0"),
    RuleCase("LpNormalization", [In((2, 3, 4))], id="default"),
    RuleCase("LpNormalization", [In((3, 4), gap=0.1)], attrs={"p": 1}, id="p1"),
    RuleCase("LpNormalization", [In((2, 3), dims=["N", 3], gap=0.1)], attrs={"p": 1, "axis": 1}, opset=18,
             id="p1-symbolic-opset18"),
    RuleCase("LpNormalization", [In((2, 4))], attrs={"p": 2, "axis": -1}, opset=22, id="opset22"),
]

NOT_CASED = {"LRN": "onnxruntime 1.31 CPU has no float64 kernel and onnx.reference's LRN forward differs from "
                    "onnxruntime's (by 0.49 and 1.35 on the size-3 and size-1 cases of "
                    "tests/rules/test_norm_pool_torch.py, which holds it against torch autograd)"}
