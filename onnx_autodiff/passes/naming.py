"""Give every node a unique name (rules scope their new nodes under it) and list the names in use."""
from __future__ import annotations

import onnx


def _graphs(model: onnx.ModelProto):
    yield model.graph
    for ti in model.training_info:
        yield ti.initialization
        yield ti.algorithm


def _walk(graph: onnx.GraphProto):
    yield graph
    for n in graph.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _walk(a.g)
            for sg in a.graphs:
                yield from _walk(sg)


def used_names(model: onnx.ModelProto) -> set[str]:
    """Every tensor and node name in the model, its subgraphs and its training graphs."""
    names: set[str] = set()
    for top in _graphs(model):
        for g in _walk(top):
            names.update(i.name for i in g.input)
            names.update(o.name for o in g.output)
            names.update(t.name for t in g.initializer)
            for n in g.node:
                names.add(n.name)
                names.update(n.input)
                names.update(n.output)
    names.discard("")
    return names


def fresh_name(taken: set[str], base: str) -> str:
    """``base``, or ``base_<k>`` for the first k not in ``taken``; the name is added to ``taken``."""
    name, k = base, 0
    while name in taken:
        name = f"{base}_{k}"
        k += 1
    taken.add(name)
    return name


def name_nodes(model: onnx.ModelProto) -> bool:
    """Name each unnamed (or duplicate-named) node ``<op_type>_<k>``."""
    names = [n.name for top in _graphs(model) for g in _walk(top) for n in g.node]
    if all(names) and len(set(names)) == len(names):
        return False
    taken = used_names(model)
    seen: set[str] = set()
    changed = False
    counter = 0
    for top in _graphs(model):
        for g in _walk(top):
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
