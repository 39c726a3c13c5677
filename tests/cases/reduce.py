from onnx_autodiff.testing import In, RuleCase

CASES = [
    RuleCase("ReduceSum", [In((2, 3, 4)), In(value=[1])], attrs={"keepdims": 0}),
    RuleCase("ReduceSum", [In((2, 3, 4)), In(value=[-1, 0])], id="keepdims"),
    RuleCase("ReduceSum", [In((2, 3, 4))], attrs={"axes": [1], "keepdims": 0}, opset=12, id="opset12"),
    RuleCase("ReduceSum", [In((2, 3))], attrs={"keepdims": 0}, id="all"),
    RuleCase("ReduceSum", [In((2, 3)), In(value=[], dtype="int64")], attrs={"noop_with_empty_axes": 1}, id="noop"),
    RuleCase("ReduceMean", [In((2, 3, 4))], attrs={"axes": [1, 2], "keepdims": 0}),
    RuleCase("ReduceMean", [In((2, 3, 4)), In(value=[0])], opset=18, id="opset18"),
]
