"""onnxruntime (CPU) as a bundle runner."""
from __future__ import annotations

import onnxruntime as ort

from .loop import check_feeds
from .refusal import refused


def version() -> str:
    return ort.__version__


def load(path: str):
    try:
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises several unrelated types here
        raise refused("onnxruntime", "convert", path, e) from None
    names = [o.name for o in sess.get_outputs()]
    takes = {i.name for i in sess.get_inputs()}

    def run(feeds):
        check_feeds(path, "onnxruntime", takes, feeds)
        try:
            return dict(zip(names, sess.run(None, dict(feeds))))
        except Exception as e:  # noqa: BLE001
            raise refused("onnxruntime", "run", path, e) from None
    return run
