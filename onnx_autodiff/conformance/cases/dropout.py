"""Dropout at ratio 0 or in inference mode (deterministic); the random case is in tests/rules/test_dropout.py."""
import numpy as np

from onnx_autodiff.testing import In, RuleCase


def const(v, dtype):
    return In(value=np.asarray(v, dtype=dtype), dtype=dtype)


CASES = [
    RuleCase("Dropout", [In((3, 4)), const(0.0, "float64"), const(True, "bool")], opset=13, id="training-ratio0"),
    RuleCase("Dropout", [In((3, 4)), const(0.0, "float64"), const(True, "bool")], outputs=2, check_outputs=[0],
             opset=12, id="training-ratio0-mask"),
    RuleCase("Dropout", [In((3, 4)), const(0.7, "float64"), const(False, "bool")], opset=13, id="inference-input"),
    RuleCase("Dropout", [In((2, 5))], opset=13, id="inference-default"),
    RuleCase("Dropout", [In((2, 5)), const(0.3, "float64")], opset=22, id="inference-ratio-only"),
    RuleCase("Dropout", [In((2, 5))], attrs={"ratio": 0.4}, opset=10, id="opset10"),
    RuleCase("Dropout", [In((2, 5))], attrs={"ratio": 0.4}, opset=7, id="opset7"),
]
