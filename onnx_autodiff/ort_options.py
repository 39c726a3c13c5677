"""The onnxruntime session settings every part of the library shares (the driver, gradcheck, the trainer,
the demo): warnings about the graph (unused initializers, ...) stay quiet, errors still show; and the inputs
of onnxruntime's kernels that must reach a session as constants."""
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


# Inputs (by position) of onnxruntime kernels that must be initializers of the session, not run-time inputs:
# the kernel prepacks them when the session is made and computes differently without. MatMulNBits at
# accuracy_level 4 with its packed B an initializer and its scales fed returns zeros (onnxruntime 1.32); with
# both fed it multiplies in float where the model, as built, rounds A to int8. GatherBlockQuantized
# (a quantized embedding) documents its data, scales and zero points as constants.
CONSTANT_INPUTS = {("com.microsoft", "MatMulNBits"): (1, 2, 3, 4),
                   ("com.microsoft", "GatherBlockQuantized"): (0, 2, 3)}


def constant_inputs(graph) -> set[str]:
    """The tensors ``graph``'s nodes read where onnxruntime needs a constant (``CONSTANT_INPUTS``)."""
    names = set()
    for node in graph.node:
        positions = CONSTANT_INPUTS.get((node.domain, node.op_type), ())
        names.update(node.input[i] for i in positions if i < len(node.input) and node.input[i])
    return names
