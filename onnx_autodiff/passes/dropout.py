"""Give Dropout nodes on a differentiated path a mask output, so the backward reuses the forward mask.

Rules never touch protobufs: the Dropout rule needs the mask as a forward tensor, and a node that
does not ask for it has none. Adding the optional output changes nothing else about the forward.
"""
from __future__ import annotations

from typing import Iterable

import onnx

from ..registry import normalize_domain
from .naming import fresh_name


def add_dropout_masks(model: onnx.ModelProto, nodes: Iterable[onnx.NodeProto], taken: set[str]) -> bool:
    """Name a mask output for each default-domain Dropout among ``nodes`` (which must belong to
    ``model.graph``) that has none. Returns whether a node changed."""
    wanted = {n.name for n in nodes if n.op_type == "Dropout" and normalize_domain(n.domain) == ""
              and (len(n.output) < 2 or not n.output[1])}
    changed = False
    for n in model.graph.node:
        if n.name not in wanted:
            continue
        mask = fresh_name(taken, f"{n.name}/mask")
        if len(n.output) < 2:
            n.output.append(mask)
        else:
            n.output[1] = mask
        changed = True
    return changed


