"""What the passes of one lowering share."""
from __future__ import annotations

import onnx

from ..graph import used_names


class LoweringContext:
    """``taken``: every name in use (new names are made fresh against it, and join it); ``added``: the
    names of the nodes the passes emitted (clean-up may remove those, never the user's own nodes);
    ``target``: the name of the runtime the result is for (``passes/targets.py``), which the rules read
    through their builder (``g.target``) to pick forms that runtime has."""

    def __init__(self, model: onnx.ModelProto | None = None, taken: set[str] | None = None,
                 target: str = "onnxruntime"):
        self.taken = taken if taken is not None else used_names(model) if model is not None else set()
        self.added: set[str] = set()
        self.target = target

    def fork(self) -> LoweringContext:
        """A context sharing the names in use and the target, with its own record of added nodes."""
        return LoweringContext(taken=self.taken, target=self.target)
