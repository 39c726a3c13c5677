"""``python -m onnx_autodiff``: the ``onnx-autodiff`` command."""
from .cli import main

raise SystemExit(main())
