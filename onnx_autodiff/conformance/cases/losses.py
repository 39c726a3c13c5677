import numpy as np

from onnx_autodiff.testing import In, RuleCase


def _labels(*values):
    return In(value=np.array(values, dtype=np.int64), dtype="int64")


def _weights(c, grad=False):
    """Class weights: fixed, or a graph input differentiated too (``grad``)."""
    return In((c,), low=0.5, high=2.0, const=not grad)


T2 = _labels(0, 3, 1)                          # N=3, C=4
T2_IGNORED = _labels(0, -100, 2)               # ignore_index outside [0, C)
T2_IGNORED_CLASS = _labels(1, 3, 1)            # ignore_index=1, a real class
T3 = _labels([0, 3, 1], [2, 2, 0])             # (N, D) = (2, 3), C=4
T3_IGNORED = _labels([0, -1, 1], [-1, 2, 3])   # ignore_index=-1: would pick class 3 if not masked


def _loss_cases(op, opset, outputs=1):
    check = list(range(outputs))
    suffix = "-log-prob" if outputs > 1 else ""
    cases = []
    for red in ("none", "sum", "mean"):
        attrs = {"reduction": red}
        cases += [
            RuleCase(op, [In((3, 4)), T2], attrs=attrs, opset=opset, outputs=outputs, check_outputs=check,
                     id=f"opset{opset}{suffix}-{red}"),
            RuleCase(op, [In((3, 4)), T2, _weights(4)], attrs=attrs, opset=opset, outputs=outputs,
                     check_outputs=check, id=f"opset{opset}{suffix}-{red}-weights"),
            RuleCase(op, [In((3, 4)), T2_IGNORED, _weights(4)], attrs={**attrs, "ignore_index": -100},
                     opset=opset, outputs=outputs, check_outputs=check,
                     id=f"opset{opset}{suffix}-{red}-weights-ignore"),
            RuleCase(op, [In((3, 4)), T2_IGNORED_CLASS], attrs={**attrs, "ignore_index": 1},
                     opset=opset, outputs=outputs, check_outputs=check, id=f"opset{opset}{suffix}-{red}-ignore-class"),
            RuleCase(op, [In((2, 4, 3)), T3], attrs=attrs, opset=opset, outputs=outputs, check_outputs=check,
                     id=f"opset{opset}{suffix}-{red}-rank3"),
            RuleCase(op, [In((2, 4, 3)), T3_IGNORED, _weights(4)], attrs={**attrs, "ignore_index": -1},
                     opset=opset, outputs=outputs, check_outputs=check,
                     id=f"opset{opset}{suffix}-{red}-rank3-weights-ignore"),
            RuleCase(op, [In((3, 4)), T2_IGNORED_CLASS, _weights(4, grad=True)], attrs={**attrs, "ignore_index": 1},
                     opset=opset, outputs=outputs, check_outputs=check, id=f"opset{opset}{suffix}-{red}-weights-grad"),
            RuleCase(op, [In((2, 4, 3)), T3_IGNORED, _weights(4, grad=True)], attrs={**attrs, "ignore_index": -1},
                     opset=opset, outputs=outputs, check_outputs=check,
                     id=f"opset{opset}{suffix}-{red}-rank3-weights-grad"),
        ]
    return cases


CASES = (
    _loss_cases("NegativeLogLikelihoodLoss", 12)
    + _loss_cases("NegativeLogLikelihoodLoss", 17)
    + _loss_cases("SoftmaxCrossEntropyLoss", 12)
    + _loss_cases("SoftmaxCrossEntropyLoss", 17)
    # the optional log_prob output: its gradient flows into the scores too
    + _loss_cases("SoftmaxCrossEntropyLoss", 12, outputs=2)
    + _loss_cases("SoftmaxCrossEntropyLoss", 17, outputs=2)
    + [
        # only log_prob is differentiated: no gradient reaches the loss output
        RuleCase("SoftmaxCrossEntropyLoss", [In((2, 4, 3)), T3], attrs={"reduction": "mean"}, outputs=2,
                 check_outputs=[1], id="log-prob-only"),
        # default reduction (mean), rank 4
        RuleCase("SoftmaxCrossEntropyLoss", [In((2, 3, 2, 2)), _labels([[0, 2], [1, 1]], [[2, 0], [0, 1]])],
                 id="rank4-default"),
        RuleCase("NegativeLogLikelihoodLoss", [In((2, 3, 2, 2)), _labels([[0, 2], [1, 1]], [[2, 0], [0, 1]]),
                                               _weights(3)], id="rank4-default-weights"),
        # only the weights are differentiated (opset 12, rank 3: log_prob is recomputed by Transpose)
        RuleCase("SoftmaxCrossEntropyLoss", [In((2, 4, 3), grad=False), T3, _weights(4, grad=True)], opset=12,
                 id="weights-only"),
        RuleCase("NegativeLogLikelihoodLoss", [In((2, 4, 3), grad=False), T3, _weights(4, grad=True)],
                 attrs={"reduction": "sum"}, id="weights-only"),
    ]
)
