"""Gradient rules, one module per op family. Importing this package fills the registry."""
from . import (  # noqa: F401
    binary,
    elementwise,
    linalg,
    losses,
    nn,
    no_grad,
    normalization,
    pool_conv,
    reduce,
    shape,
)
