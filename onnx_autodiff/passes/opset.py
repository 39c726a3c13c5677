"""Opset conversion for ``lower()``: to a ``target_opset`` the user picks, or up to the opset a
gradient needs when it cannot be written at the model's own (``OpsetTooOldError``)."""
from __future__ import annotations

import warnings

import onnx
from onnx import helper, version_converter

from ..errors import GradientRuleError


def default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def _converted_graph(graph: onnx.GraphProto, model: onnx.ModelProto, opset: int) -> onnx.GraphProto:
    """A TrainingInfoProto graph converted on its own: a model around it (the names it reads from the
    inference graph become typed inputs), converted, and the graph taken back out."""
    known = {vi.name: vi for vi in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output)}
    for t in model.graph.initializer:
        known.setdefault(t.name, helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    made = ({o for n in graph.node for o in n.output} | {i.name for i in graph.input}
            | {t.name for t in graph.initializer})
    reads = [i for n in graph.node for i in n.input if i and i not in made]
    g = onnx.GraphProto()
    g.CopyFrom(graph)
    seen = set()
    for name in reads:
        if name not in seen:
            seen.add(name)
            g.input.append(known.get(name) or helper.make_empty_tensor_value_info(name))
    wrapper = helper.make_model(g, opset_imports=list(model.opset_import))
    wrapper.ir_version = model.ir_version
    out = version_converter.convert_version(wrapper, opset).graph
    del out.input[len(graph.input):]
    return out


def convert_opset(model: onnx.ModelProto, opset: int, why: str = "") -> onnx.ModelProto:
    """``model`` with its default-domain opset converted to ``opset`` (training_info graphs too)."""
    have = default_opset(model)
    try:
        out = version_converter.convert_version(model, opset)
        del out.training_info[:]
        for info in model.training_info:
            new = out.training_info.add()
            new.CopyFrom(info)
            if info.HasField("algorithm"):
                new.algorithm.CopyFrom(_converted_graph(info.algorithm, model, opset))
            if info.HasField("initialization"):
                new.initialization.CopyFrom(_converted_graph(info.initialization, model, opset))
    except Exception as e:  # the converter raises plain RuntimeErrors/ConvertErrors with C++ text
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GradientRuleError(
            f"cannot convert the model from opset {have} to opset {opset}{' (' + why + ')' if why else ''}: "
            f"onnx.version_converter says: {first}. Re-export the model at opset {opset} or newer "
            f"(torch.onnx.export(..., opset_version={opset}))") from e
    return out


def warn_upgrade(have: int, opset: int, reason: str) -> None:
    warnings.warn(f"lower(): the model is opset {have}; {reason}. Converted it to opset {opset} with "
                  f"onnx.version_converter (pass target_opset= to choose the opset yourself, or re-export the "
                  f"model at opset {opset} or newer).", UserWarning, stacklevel=3)
