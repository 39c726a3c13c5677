"""Forward mode: Jacobian-vector products (``jvp``), Hessian-vector products (``hvp``, forward over
reverse) and dense Jacobians (``jacobian``), each as one plain ONNX model (docs/forward_mode.md)."""
from .jvp import jvp

__all__ = ["jvp"]
