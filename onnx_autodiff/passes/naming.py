"""Give every node a unique name (rules scope their new nodes under it)."""
from __future__ import annotations

import onnx

from ..graph import used_names, walk_graphs
from .context import LoweringContext


def name_nodes(model: onnx.ModelProto, ctx: LoweringContext | None = None) -> bool:
    """Name each unnamed (or duplicate-named) node ``<op_type>_<k>``."""
    names = [n.name for g in walk_graphs(model) for n in g.node]
    if all(names) and len(set(names)) == len(names):
        return False
    taken = used_names(model) if ctx is None else ctx.taken
    seen: set[str] = set()
    changed = False
    counter = 0
    for g in walk_graphs(model):
        for n in g.node:
            if n.name and n.name not in seen:
                seen.add(n.name)
                continue
            while f"{n.op_type}_{counter}" in taken:
                counter += 1
            n.name = f"{n.op_type}_{counter}"
            taken.add(n.name)
            seen.add(n.name)
            changed = True
    return changed
