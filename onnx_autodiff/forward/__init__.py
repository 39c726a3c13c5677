"""Forward mode: Jacobian-vector products (``jvp``), Hessian-vector products (``hvp``, forward over
reverse) and dense Jacobians (``jacobian``), each as one plain ONNX model (docs/forward_mode.md)."""
from .hvp import hvp
from .jacobian import jacobian
from .jvp import jvp

__all__ = ["jvp", "hvp", "jacobian"]
