"""What every command shares: the program name, CliError, loading a model a user names, writing an output."""
from __future__ import annotations

from ..model.io import check_output_path, load_checked

PROG = "onnx-autodiff"
CHECK_LIMIT = 1 << 29  # bytes of tensors check accepts: float64 doubles them, one model stops at 2 GiB
CHECKPOINT = "checkpoint.onnx"


class CliError(Exception):
    """An error the user can fix: printed as one line with a hint, exit code ``exit_code`` (as the library's
    errors, which carry ``hint`` and ``exit_code`` too)."""

    def __init__(self, message: str, hint: str = "", exit_code: int = 2):
        super().__init__(message)
        self.hint = hint
        self.exit_code = exit_code


# ---- helpers ------------------------------------------------------------------------------------

def load_onnx(path: str, what: str = "model"):
    """Load an ONNX file whole (every tensor inline), with io.load_checked's clear errors."""
    from ..model.weights import attach_weights

    model, weights = load_checked(path, what)
    attach_weights(model, weights)
    return model


def save_output(model, path: str, weights=None) -> None:
    from ..model.io import save_model_atomic

    check_output_path(path, "output")
    save_model_atomic(model, path, weights=weights)
