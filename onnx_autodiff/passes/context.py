"""What the passes of one lowering share."""
from __future__ import annotations

import onnx

from ..graph import used_names


class LoweringContext:
    """What the passes of one pipeline share. ``taken``: every name in use (new names are made fresh against
    it, and join it); ``added``: the names of the nodes the passes emitted (clean-up may remove those, never
    the user's own nodes); ``target``: the record of the runtime the result is for (``runtimes/targets.py``;
    None: every op), which the rules read through their builder (``g.has_op``) to pick forms that runtime
    has; ``arrays``: the values of the model's detached tensors, for passes that read or change weights
    (a bundle's step fixes, the LoRA merge of the inference pipeline); ``cleaned``: the node names, in order, of
    each Gradient node's replacement as ``differentiate`` returned it, a clean-up fixed point (``lower_algorithm``
    skips the algorithm's second clean-up when those nodes are all it added and they stand unchanged)."""

    def __init__(self, model: onnx.ModelProto | None = None, taken: set[str] | None = None, target=None,
                 arrays=None):
        self.taken = taken if taken is not None else used_names(model) if model is not None else set()
        self.added: set[str] = set()
        self.target = target
        self.arrays = arrays
        self.cleaned: list[list[str]] = []

    def fork(self) -> LoweringContext:
        """A context sharing the names in use, the target and the arrays, with its own record of added nodes."""
        return LoweringContext(taken=self.taken, target=self.target, arrays=self.arrays)
