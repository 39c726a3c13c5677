"""Switch a graph's training-mode nodes to inference: BatchNormalization uses its running statistics,
Dropout passes its input through. Used when a trained model is exported for inference."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..graph import node_inputs, normalize_domain, set_nodes


def _attr(node, name):
    return next((a for a in node.attribute if a.name == name), None)


def to_eval_mode(model: onnx.ModelProto) -> bool:
    """In place on ``model.graph``; returns whether anything changed.

    BatchNormalization: training_mode=1 (opset 14+) or the training outputs of opsets 9-13 are
    dropped; outputs that stand for the running statistics become Identity of the statistics inputs.
    Dropout: becomes Identity; a mask output that something reads becomes all-true.
    """
    g = model.graph
    opset = next((o.version for o in model.opset_import if normalize_domain(o.domain) == ""), 0)
    read = {i for n in g.node for i in node_inputs(n)} | {o.name for o in g.output}
    out, changed = [], False
    for n in g.node:
        if normalize_domain(n.domain) != "":
            out.append(n)
            continue
        if n.op_type == "BatchNormalization" and (len(n.output) > 1
                                                  or (_attr(n, "training_mode") and _attr(n, "training_mode").i)):
            extra = list(n.output[1:])
            if opset < 14 and any(o and o in read for o in extra[2:]):
                out.append(n)  # saved mean/var of opsets 9-13 have no inference counterpart
                continue
            tm = _attr(n, "training_mode")
            if tm is not None:
                tm.i = 0
            del n.output[1:]
            out.append(n)
            for stat_out, stat_in in zip(extra[:2], n.input[3:5]):
                if stat_out and stat_out in read:
                    out.append(helper.make_node("Identity", [stat_in], [stat_out], name=f"{n.name}/eval/{stat_out}"))
            changed = True
        elif n.op_type == "Dropout":
            out.append(helper.make_node("Identity", [n.input[0]], [n.output[0]], name=n.name))
            if len(n.output) > 1 and n.output[1] and n.output[1] in read:
                mask = helper.make_node("ConstantOfShape", [f"{n.name}/eval/shape"], [n.output[1]],
                                        name=f"{n.name}/eval/mask", value=numpy_helper.from_array(np.array([True])))
                out.append(helper.make_node("Shape", [n.input[0]], [f"{n.name}/eval/shape"],
                                            name=f"{n.name}/eval/shape"))
                out.append(mask)
            changed = True
        else:
            out.append(n)
    if changed:
        set_nodes(g, out)
    return changed
