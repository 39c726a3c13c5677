from onnx_autodiff.testing import In, RuleCase

POS = dict(low=0.5, high=2.0)

CASES = [
    RuleCase("Add", [In((2, 3)), In((3,))], id="broadcast"),
    RuleCase("Add", [In((2, 1, 3)), In((4, 1))], id="broadcast-both"),
    RuleCase("Add", [In((2, 1, 3)), In((4, 1))], opset=12, id="opset12"),
    RuleCase("Add", [In((2, 3), dims=["N", 3]), In((3,))], id="symbolic"),
    # N against M: the broadcast axes are known only at run time (dynamic unbroadcast)
    RuleCase("Add", [In((2, 3), dims=["N", 3]), In((1, 3), dims=["M", 3])], id="symbolic-dynamic"),
    RuleCase("Sub", [In((2, 1, 3)), In((4, 1))], id="broadcast-both"),
    RuleCase("Sub", [In(()), In((2, 3))], id="scalar"),
    RuleCase("Mul", [In((2, 3)), In((2, 3))]),
    RuleCase("Mul", [In((2, 3)), In(())], id="scalar"),
    RuleCase("Mul", [In((2, 1, 3)), In((4, 1))], id="broadcast-both"),
    RuleCase("Mul", [In((2, 3), dims=["N", 3]), In((1, 3))], id="symbolic"),
    RuleCase("Mul", [In((2, 1, 3), dims=["N", 1, 3]), In((4, 1), dims=["M", 1])], id="symbolic-dynamic"),
    RuleCase("Div", [In((2, 3)), In((2, 3), gap=0.5)]),
    RuleCase("Div", [In((2, 1, 3)), In((4, 1), gap=0.5)], id="broadcast-both"),
    RuleCase("Div", [In(()), In((2, 3), gap=0.5)], id="scalar"),
    RuleCase("Pow", [In((2, 3), **POS), In((2, 3))]),
    RuleCase("Pow", [In((2, 1, 3), **POS), In((4, 1))], id="broadcast-both"),
    RuleCase("Pow", [In((2, 3), **POS), In(())], id="scalar-exponent"),
    RuleCase("Pow", [In((2, 3)), In(value=3.0)], id="negative-base-const-exponent"),
    RuleCase("Pow", [In((2, 3), **POS), In((3,), dtype="float32", const=True)], opset=12,
             id="opset12-const-exponent"),
    RuleCase("Pow", [In((2, 3)), In(value=[2, 3, 1], dtype="int64")], opset=13, id="int-exponent"),
    RuleCase("Pow", [In((2, 3), **POS), In((2, 3))], opset=9, id="opset9"),
    RuleCase("Mod", [In((2, 3), low=-5.0, high=5.0), In((3,), gap=0.7)], attrs={"fmod": 1}, rtol=1e-4),
    RuleCase("Max", [In((2, 3)), In((2, 3))]),
    RuleCase("Max", [In((2, 1, 3)), In((4, 1)), In(())], id="variadic-broadcast"),
    RuleCase("Max", [In((2, 3))], id="single"),
    RuleCase("Max", [In((2, 3)), In((2, 3))], opset=9, id="opset9"),
    RuleCase("Min", [In((2, 3)), In((3,))], id="broadcast"),
    RuleCase("Min", [In((2, 3)), In((2, 3)), In((2, 1))], id="variadic"),
    RuleCase("Where", [In((2, 3), value=[[True, False, True], [False, False, True]], dtype="bool"),
                       In((2, 3)), In((2, 3))]),
    RuleCase("Where", [In((2, 1, 3), value=[[[True, False, True]], [[False, True, True]]], dtype="bool"),
                       In((4, 1)), In(())], id="broadcast"),
    RuleCase("Clip", [In((3, 4)), In(value=-0.5), In(value=0.7)], id="const-bounds"),
    RuleCase("Clip", [In((3, 4)), In(()), In(())], id="tensor-bounds"),
    RuleCase("Clip", [In((3, 4)), None, In(())], id="max-only"),
    RuleCase("Clip", [In((3, 4)), In((), low=0.5, high=0.9), In((), low=-0.9, high=-0.5)], id="min-above-max"),
    RuleCase("Clip", [In((3, 4)), In(())], opset=12, id="opset12-min-only"),
    RuleCase("Clip", [In((3, 4))], id="no-bounds"),
    RuleCase("Sum", [In((2, 3)), In((3,)), In((1, 3))], id="variadic"),
    RuleCase("PRelu", [In((2, 3, 4), gap=0.05), In((3, 1))], id="broadcast-slope"),
    RuleCase("PRelu", [In((2, 3), gap=0.05), In((2, 3))]),
]

# onnxruntime has only float32 kernels for these forms; gradcheck's runtime="auto" runs them in float64
# through onnx's reference evaluator (tests/rules/test_second_order_elementwise.py also checks them against torch)
CASES += [
    RuleCase("Mean", [In((2, 3)), In((3,)), In((1, 3))], id="variadic-broadcast"),
    RuleCase("Mean", [In((2, 3))], opset=9, id="single-opset9"),
    RuleCase("Mean", [In((2, 3)), In((2, 3))], opset=7, id="opset7"),
    RuleCase("Clip", [In((3, 4))], attrs={"min": -0.5, "max": 0.7}, opset=9, id="opset9-attrs"),
    RuleCase("Clip", [In((3, 4))], attrs={"max": 0.7}, opset=10, id="opset10-max-attr"),
    RuleCase("PRelu", [In((2, 3, 4), gap=0.05), In((3, 1))], opset=9, id="opset9-broadcast-slope"),
    RuleCase("PRelu", [In((2, 3, 4), gap=0.05), In((3, 1))], opset=7, id="opset7-broadcast-slope"),
]
