from onnx_autodiff.testing import In, RuleCase

CASES = [
    RuleCase("ReduceSum", [In((2, 3, 4)), In(value=[1])], attrs={"keepdims": 0}),
    RuleCase("ReduceSum", [In((2, 3, 4)), In(value=[-1, 0])], id="keepdims"),
    RuleCase("ReduceSum", [In((2, 3, 4))], attrs={"axes": [1], "keepdims": 0}, opset=12, id="opset12"),
    RuleCase("ReduceSum", [In((2, 3))], attrs={"keepdims": 0}, id="all"),
    RuleCase("ReduceSum", [In((2, 3)), In(value=[], dtype="int64")], attrs={"noop_with_empty_axes": 1}, id="noop"),
    RuleCase("ReduceMean", [In((2, 3, 4))], attrs={"axes": [1, 2], "keepdims": 0}),
    RuleCase("ReduceMean", [In((2, 3, 4)), In(value=[0])], opset=18, id="opset18"),
    RuleCase("ReduceMean", [In((2, 3), dims=["N", 3])], attrs={"axes": [-1]}, id="symbolic"),
    RuleCase("ReduceMean", [In((2, 3))], attrs={"noop_with_empty_axes": 1}, opset=18, id="noop-no-axes"),
    RuleCase("ReduceSum", [In((2, 3))], attrs={"noop_with_empty_axes": 1}, id="noop-no-axes"),
]

for op in ("ReduceMax", "ReduceMin"):
    CASES += [
        RuleCase(op, [In((2, 3, 4))], attrs={"axes": [1], "keepdims": 0}, opset=12, id="opset12"),
        RuleCase(op, [In((2, 3, 4))], attrs={"axes": [-1, 0]}, opset=13, id="neg-keepdims"),
        RuleCase(op, [In((2, 3, 4)), In(value=[-2])], attrs={"keepdims": 0}, opset=18, id="opset18"),
        RuleCase(op, [In((2, 3))], opset=18, id="all"),
        RuleCase(op, [In((2, 3)), In(value=[], dtype="int64")], attrs={"noop_with_empty_axes": 1}, opset=18,
                 id="noop"),
        # no axes input at all is empty axes too: the node is the identity (it was taken for "all axes")
        RuleCase(op, [In((2, 3))], attrs={"noop_with_empty_axes": 1}, opset=18, id="noop-no-axes"),
        RuleCase(op, [In((2, 3), dims=["N", 3])], attrs={"axes": [0], "keepdims": 0}, id="symbolic"),
        RuleCase(op, [In((2, 3, 4))], attrs={"axes": [1]}, opset=9, id="opset9"),
    ]

for op, spec in (("ReduceProd", In((2, 3, 4), low=0.5, high=1.5, gap=0.0)),
                 ("ReduceL1", In((2, 3, 4), gap=0.1)),
                 ("ReduceL2", In((2, 3, 4))),
                 ("ReduceLogSum", In((2, 3, 4), low=0.5, high=2.0)),
                 ("ReduceLogSumExp", In((2, 3, 4))),
                 ("ReduceSumSquare", In((2, 3, 4)))):
    CASES += [
        RuleCase(op, [spec], attrs={"axes": [1], "keepdims": 0}, opset=12, id="opset12"),
        RuleCase(op, [spec], attrs={"axes": [-1, 0]}, opset=13, id="neg-keepdims"),
        RuleCase(op, [spec, In(value=[-2])], attrs={"keepdims": 0}, opset=18, id="opset18"),
        RuleCase(op, [spec], opset=18, attrs={"keepdims": 0}, id="all"),
        RuleCase(op, [spec], opset=18, attrs={"noop_with_empty_axes": 1}, id="noop-no-axes"),
    ]
