"""The onnxruntime session settings every part of the library shares (the driver, gradcheck, the trainer,
the demo): warnings about the graph (unused initializers, ...) stay quiet, errors still show."""
from __future__ import annotations

from typing import Any


def session_options(**settings: Any):
    """``onnxruntime.SessionOptions`` at log level 3 (errors only), with ``settings`` set on it, such as
    ``graph_optimization_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL``."""
    import onnxruntime as ort  # here, not at module level: gradcheck and the trainer import this module

    options = ort.SessionOptions()
    options.log_severity_level = 3
    for name, value in settings.items():
        setattr(options, name, value)
    return options
