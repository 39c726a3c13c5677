"""Ops onnx's reference evaluator computes below the precision of their element type, rewritten for the
float64 reference of ``gradcheck`` (``Float64Evaluator``: onnx's ``ReferenceEvaluator`` with ``new_ops=FLOAT64_OPS``).

onnx.reference computes ``Erf`` through ``np.vectorize(math.erf, otypes=["f"])``: in float32 whatever the input,
so a float64 check of a GELU model compares central differences of a float32-rounded function (relative error
1e-2 and worse) with an exact gradient. Here Erf keeps the input's type: ``math.erf`` of each element, in double.
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


FLOAT64_OPS = [Erf]


class Float64Evaluator(ReferenceEvaluator):
    """onnx's reference evaluator with ``FLOAT64_OPS`` in every graph it runs: the model's, its subgraphs' and
    the function bodies of ops it expands (Gelu's Erf), which onnx evaluates with an evaluator of this class."""

    def __init__(self, proto, *args, new_ops=None, **kwargs):
        super().__init__(proto, *args, new_ops=list(new_ops or []) + FLOAT64_OPS, **kwargs)


__all__ = ["Erf", "FLOAT64_OPS", "Float64Evaluator"]
