"""onnx.reference.ReferenceEvaluator as a bundle runner (slow; exact)."""
from __future__ import annotations

import onnx
from onnx.reference import ReferenceEvaluator

from .loop import check_feeds
from .refusal import refused


def version() -> str:
    return onnx.__version__


def load(path: str):
    model = onnx.load(path)
    try:
        ev = ReferenceEvaluator(model)
    except Exception as e:  # noqa: BLE001 - the evaluator raises what its op implementations raise
        raise refused("reference", "convert", path, e) from None
    names = [o.name for o in model.graph.output]
    takes = {i.name for i in model.graph.input}

    def run(feeds):
        check_feeds(path, "onnx.reference", takes, feeds)
        try:
            return dict(zip(names, ev.run(None, dict(feeds))))
        except Exception as e:  # noqa: BLE001
            raise refused("reference", "run", path, e) from None
    return run


class Float64Run:
    """onnx's reference evaluator behind the InferenceSession.run interface, for gradcheck's float64 check: slow,
    but it runs every op in float64, where onnxruntime's CPU provider has no double kernel for some (Conv, LSTM,
    Erf, ...); the ops it computes in float32 whatever their input (Erf) replaced by float64 ones
    (``reference_ops.py``)."""

    def __init__(self, model: onnx.ModelProto):
        from .reference_ops import Float64Evaluator

        self._ev = Float64Evaluator(model)
        self._outputs = [o.name for o in model.graph.output]

    def run(self, names, feeds):
        return self._ev.run(list(names) if names else self._outputs, feeds)


def load_float64(model: onnx.ModelProto, providers=None) -> Float64Run:
    """``model`` on onnx's reference evaluator in float64, in memory (``providers`` is onnxruntime's: unused)."""
    return Float64Run(model)
