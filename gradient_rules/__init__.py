"""Gradient rules, one module per op family. Importing this package fills the registry."""
from . import binary, elementwise, linalg, losses, nn, no_grad, reduce, shape  # noqa: F401
