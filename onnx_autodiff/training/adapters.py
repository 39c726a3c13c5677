"""Deprecated: ``onnx_autodiff.training.adapters`` is now ``onnx_autodiff.training.lora.adapters``
(LoRA's modules in one package). Each name read here still works for one release, with a
``DeprecationWarning`` naming its new path."""
from __future__ import annotations

import warnings
from importlib import import_module

_NEW = "onnx_autodiff.training.lora.adapters"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    value = getattr(import_module(_NEW), name)
    warnings.warn(f"{__name__}.{name} moved: import it from {_NEW} ({__name__} goes in the next release)",
                  DeprecationWarning, stacklevel=2)
    return value
