import numpy as np

from onnx_autodiff.testing import In, RuleCase


def ints(v):
    return In(value=np.asarray(v, dtype=np.int64), dtype="int64")


CASES = [
    RuleCase("TopK", [In((3, 5)), ints([2])], outputs=2, check_outputs=[0]),
    RuleCase("TopK", [In((4, 3, 2)), ints([3])], attrs={"axis": 0, "largest": 0}, outputs=2, check_outputs=[0],
             id="smallest-axis0"),
    RuleCase("TopK", [In((2, 6)), ints([6])], attrs={"axis": -1, "sorted": 0}, outputs=2, check_outputs=[0],
             opset=11, id="all-unsorted-opset11"),
    RuleCase("TopK", [In((2, 5), dims=["N", 5]), ints([2])], outputs=2, check_outputs=[0], opset=24,
             id="symbolic-opset24"),
]
