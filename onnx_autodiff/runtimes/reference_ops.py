"""Ops onnx's reference evaluator computes below the precision of their element type, rewritten for the
float64 reference of ``gradcheck`` (``Float64Evaluator``: onnx's ``ReferenceEvaluator`` with ``new_ops=FLOAT64_OPS``).

onnx.reference computes ``Erf`` through ``np.vectorize(math.erf, otypes=["f"])``: in float32 whatever the input,
so a float64 check of a GELU model compares central differences of a float32-rounded function (relative error
1e-2 and worse) with an exact gradient. Here Erf keeps the input's type: ``math.erf`` of each element, in double.
GatherElements is here for another reason: onnx's runs ``np.choose``, which takes at most 64 choices.
"""
from __future__ import annotations

import math

import numpy as np
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

_ERF = np.frompyfunc(math.erf, 1, 1)


class Erf(OpRun):
    """Erf in the input's element type (float64 stays float64)."""

    op_domain = ""

    def _run(self, x):
        return (np.asarray(_ERF(x.astype(np.float64)), dtype=np.float64).astype(x.dtype, copy=False),)


class GatherElements(OpRun):
    """GatherElements by ``np.take_along_axis``: onnx's takes at most 64 (numpy 1: 32) positions along the axis
    (``np.choose``), and the forward mode gathers a MaxPool's tangent over the flattened tensor."""

    op_domain = ""

    def _run(self, data, indices, axis=None):
        axis = 0 if axis is None else int(axis)
        indices = np.where(indices < 0, indices + data.shape[axis], indices)
        return (np.take_along_axis(data, indices.astype(np.int64), axis=axis),)


FLOAT64_OPS = [Erf, GatherElements]


class Float64Evaluator(ReferenceEvaluator):
    """onnx's reference evaluator with ``FLOAT64_OPS`` in every graph it runs: the model's, its subgraphs' and
    the function bodies of ops it expands (Gelu's Erf), which onnx evaluates with an evaluator of this class."""

    def __init__(self, proto, *args, new_ops=None, **kwargs):
        super().__init__(proto, *args, new_ops=list(new_ops or []) + FLOAT64_OPS, **kwargs)


__all__ = ["Erf", "FLOAT64_OPS", "Float64Evaluator", "GatherElements"]
