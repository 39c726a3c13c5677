"""``python -m onnx_autodiff``: the ``onnx-autodiff`` command."""
from .cli import main

if __name__ == "__main__":  # not when a spawned worker process imports it (the conformance run's)
    raise SystemExit(main())
