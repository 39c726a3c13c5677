"""Gradient rules, one module per op family. Importing this package fills the registry."""
from . import (  # noqa: F401
    binary,
    dropout,
    elementwise,
    linalg,
    losses,
    lppool,
    nn,
    no_grad,
    no_grad_extra,
    norm_misc,
    normalization,
    pool_conv,
    recurrent,
    reduce,
    shape,
    sort,
)
