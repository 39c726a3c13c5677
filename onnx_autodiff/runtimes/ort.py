"""onnxruntime (CPU) as a bundle runner."""
from __future__ import annotations

import onnxruntime as ort

from ..errors import GradcheckError
from ..ort_options import session_options
from .loop import check_feeds
from .refusal import refused


def version() -> str:
    return ort.__version__


def load(path: str):
    # onnxruntime's own log lines stay quiet (level 4: fatal only): every refusal is raised as ours, with
    # onnxruntime's message in it, so its "[E:onnxruntime:...]" line on stderr would only say it twice
    quiet = ort.RunOptions()
    quiet.log_severity_level = 4
    try:
        sess = ort.InferenceSession(path, session_options(log_severity_level=4), providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises several unrelated types here
        raise refused("onnxruntime", "convert", path, e) from None
    names = [o.name for o in sess.get_outputs()]
    takes = {i.name for i in sess.get_inputs()}

    def run(feeds):
        check_feeds(path, "onnxruntime", takes, feeds)
        try:
            return dict(zip(names, sess.run(None, dict(feeds), quiet)))
        except Exception as e:  # noqa: BLE001
            raise refused("onnxruntime", "run", path, e) from None
    return run


def load_float64(model, providers=None):
    """An in-memory session of ``model`` (an ``onnx.ModelProto``) with no graph optimization, for gradcheck's
    float64 check: ``.run(names, feeds)``."""
    so = session_options(graph_optimization_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    try:
        return ort.InferenceSession(model.SerializeToString(), so, providers=providers or ["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises several unrelated types here
        hint = ""
        if "NOT_IMPLEMENTED" in str(e):
            hint = (" onnxruntime lacks a kernel for one of its ops at this element type; use "
                    "runtime='reference' (onnx's reference evaluator runs float64) or float64=False.")
        raise GradcheckError(f"onnxruntime could not load the model {model.graph.name!r}: {e}.{hint}") from e
