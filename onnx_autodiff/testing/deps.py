"""hypothesis, the one test-only dependency of ``onnx_autodiff.testing``: imported when a strategy is made,
with our error naming the extra when it is missing (``import onnx_autodiff`` never imports it)."""
from __future__ import annotations

from ..errors import MissingExtraError


def strategies():
    """``hypothesis.strategies``, or MissingExtraError saying how to install it."""
    try:
        from hypothesis import strategies as st
    except ImportError as e:
        raise MissingExtraError(f"onnx_autodiff.testing's strategies need hypothesis, which is not installed ({e})",
                                hint="pip install 'onnx-autodiff[testing]'") from None
    return st
