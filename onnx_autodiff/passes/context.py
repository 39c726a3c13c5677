"""What the passes of one lowering share."""
from __future__ import annotations

import onnx

from ..graph import used_names


class LoweringContext:
    """``taken``: every name in use (new names are made fresh against it, and join it); ``added``: the
    names of the nodes the passes emitted (clean-up may remove those, never the user's own nodes)."""

    def __init__(self, model: onnx.ModelProto | None = None, taken: set[str] | None = None):
        self.taken = taken if taken is not None else used_names(model) if model is not None else set()
        self.added: set[str] = set()

    def fork(self) -> LoweringContext:
        """A context sharing the names in use, with its own record of added nodes."""
        return LoweringContext(taken=self.taken)
