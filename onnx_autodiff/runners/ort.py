"""onnxruntime (CPU) as a bundle runner."""
from __future__ import annotations

import onnxruntime as ort


def load(path: str):
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    takes = {i.name for i in sess.get_inputs()}

    def run(feeds):
        unknown = sorted(set(feeds) - takes)
        if unknown:
            from ..errors import BundleError
            raise BundleError(f"{path!r} takes no inputs {unknown[:5]} (onnxruntime)")
        return dict(zip(names, sess.run(None, dict(feeds))))
    return run
