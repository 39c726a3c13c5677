"""Which initializers ``make_training_model`` trains by default, and ``trainable=`` / ``frozen=`` patterns."""
from __future__ import annotations

import fnmatch
import logging
import re

import onnx

from ..errors import TrainingBuilderError
from ..graph import FLOAT_TYPES, ancestors, node_inputs
from ..ort_options import constant_inputs
from .parameters import constant_initializers, describe


def _reached(graph: onnx.GraphProto, outputs: list[str]) -> set[str]:
    """The tensors ``outputs`` depend on (themselves included), through subgraph reads too."""
    return set(outputs) | {x for n in ancestors(graph.node, outputs) for x in node_inputs(n)}


def _running_stats(graph: onnx.GraphProto) -> set[str]:
    return {n.input[k] for n in graph.node if n.op_type == "BatchNormalization" for k in (3, 4) if len(n.input) > k}


_log = logging.getLogger("onnx_autodiff")


def default_frozen(model: onnx.ModelProto, arrays=None) -> dict[str, str]:
    """``{name: reason}``: float initializers the default trainable set leaves out, the running statistics
    of BatchNormalization, the quantization constants of a quantized kernel (``ort_options.CONSTANT_INPUTS``:
    MatMulNBits' scales) and the constants exporters store as initializers (see onnx_autodiff.training.parameters)."""
    out = {n: "batch-norm running statistic" for n in _running_stats(model.graph)}
    out.update({n: "quantization constant" for n in constant_inputs(model.graph)})
    out.update(constant_initializers(model, arrays))
    return out


_GLOB = re.compile(r"[*?\[]")  # fnmatch's special characters


def select_trainable(model: onnx.ModelProto, trainable=None, frozen=None, outputs=None, arrays=None) -> list[str]:
    """The initializers to train: float initializers the outputs depend on, except batch-norm running
    statistics and exporter constants (``default_frozen``), or those matching ``trainable`` (names or
    glob patterns), minus ``frozen``. What is trained and what was left out by default, and why, goes
    to the ``onnx_autodiff`` logger (INFO)."""
    g = model.graph
    floats = [t.name for t in g.initializer if t.data_type in FLOAT_TYPES]
    outs = list(outputs) if outputs else [o.name for o in g.output]
    reach = _reached(g, outs)
    float_set = set(floats)

    def match(patterns, field):
        if isinstance(patterns, str):
            patterns = [patterns]
        chosen, seen = [], set()
        for p in patterns:
            # a plain name (LoRA's adapters: hundreds of them) is looked up, not matched against every name
            hit = ([p] if p in float_set else []) if not _GLOB.search(p) else \
                [n for n in floats if fnmatch.fnmatchcase(n, p)]
            if not hit:
                shown = ", ".join(floats[:12]) + (", ..." if len(floats) > 12 else "")
                raise TrainingBuilderError(field, f"{p!r} matches no float initializer; "
                                                  f"the model has: {shown or 'none'}")
            chosen += [n for n in hit if n not in seen]
            seen.update(hit)
        return chosen

    left_out: dict[str, str] = {}
    if trainable is None:
        skip = default_frozen(model, arrays)
        left_out = {n: r for n, r in skip.items() if n in reach and n in set(floats)}
        chosen = [n for n in floats if n in reach and n not in skip]
    else:
        chosen = match(trainable, "trainable")
        idle = [n for n in chosen if n not in reach]
        if idle:
            raise TrainingBuilderError("trainable", f"{idle} do not affect the output(s) {outs} the loss reads; "
                                                    "their gradient would be zero")
    if frozen is not None:
        off = set(match(frozen, "frozen"))
        chosen = [n for n in chosen if n not in off]
    if not chosen:
        raise TrainingBuilderError("trainable", "no initializer is left to train (the model has no float "
                                                "initializer the loss depends on, or all are frozen)")
    order = {n: k for k, n in enumerate(floats)}
    chosen = sorted(chosen, key=order.__getitem__)
    _log.info("training %d initializers: %s", len(chosen), describe(model, chosen))
    for reason in sorted(set(left_out.values())):
        names = [n for n, r in left_out.items() if r == reason]
        _log.info("frozen by default (%s): %s; name them in trainable= to train them", reason, describe(model, names))
    return chosen

