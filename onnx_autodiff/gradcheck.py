"""Deprecated: ``onnx_autodiff.gradcheck`` is now ``onnx_autodiff.check.gradcheck``
(the checking code in one folder; the function stays ``onnx_autodiff.gradcheck``). Each name read here still
works for one release, with a ``DeprecationWarning`` naming its new path. The package imports this module first,
so that the function keeps the name."""
from __future__ import annotations

import warnings
from importlib import import_module

_NEW = "onnx_autodiff.check.gradcheck"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    value = getattr(import_module(_NEW), name)
    warnings.warn(f"{__name__}.{name} moved: import it from {_NEW} ({__name__} goes in the next release)",
                  DeprecationWarning, stacklevel=2)
    return value
