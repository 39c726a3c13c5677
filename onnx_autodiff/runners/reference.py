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
