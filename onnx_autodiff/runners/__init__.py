"""Python runners of a step bundle (``driver/bundle.py``) on runtimes other than onnxruntime's training
session: one small ``load(path) -> run(feeds) -> outputs`` per runtime, sharing the loop of ``loop.py``.
The runtimes are optional: ``pip install onnx-autodiff[openvino]`` / ``[tract]``."""
from .loop import BundleTrainer, load_runner

__all__ = ["BundleTrainer", "load_runner"]
