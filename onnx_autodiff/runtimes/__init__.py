"""Each runtime's record beside its runner: ``targets.py`` holds one ``Target`` per runtime (what it lacks, read
from its conformance table; the fixes its bundle step needs; its runner module; the extra that installs it; its
execution provider), and one small ``load(path) -> run(feeds) -> outputs`` per runtime (``ort.py``,
``reference.py``, ``openvino.py``, ``tract.py``, ``node.py``, ``webgpu.py``) shares the bundle loop of ``loop.py``.
``gradcheck(runtime=...)``, ``check --target``, ``train --runtime`` and ``conformance`` read them. The runtimes
are optional: ``pip install onnx-autodiff[openvino]`` / ``[tract]``.

``BundleTrainer`` and ``load_runner`` are loaded on first use: the lowering reads ``targets.py``, and the loop
reads the driver, so this package's face imports nothing until asked."""
from __future__ import annotations

_LAZY = {"BundleTrainer": "loop", "load_runner": "loop"}


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BundleTrainer", "load_runner"]
