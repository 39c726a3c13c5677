"""onnx.reference.ReferenceEvaluator as a bundle runner (slow; exact)."""
from __future__ import annotations

import onnx
from onnx.reference import ReferenceEvaluator

from ..errors import BundleError


def load(path: str):
    model = onnx.load(path)
    ev = ReferenceEvaluator(model)
    names = [o.name for o in model.graph.output]
    takes = {i.name for i in model.graph.input}

    def run(feeds):
        unknown = sorted(set(feeds) - takes)
        if unknown:
            raise BundleError(f"{path!r} takes no inputs {unknown[:5]} (onnx.reference)")
        return dict(zip(names, ev.run(None, dict(feeds))))
    return run
