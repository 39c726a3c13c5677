"""``hvp(model, wrt, of)``: the gradient of a scalar output and its Hessian-vector product, forward over
reverse: the gradient lowered to plain ONNX (``lower``), then pushed forward along v (``jvp``)."""
from __future__ import annotations

import os
from collections.abc import Sequence

import onnx
from onnx import helper

from ..engine.builder import emit_option, emit_options
from ..errors import ForwardSpecError
from ..graph import FLOAT_TYPES, TRAINING_DOMAINS
from ..passes.pipeline import lower
from .common import as_model, check_free, checked_wrt, tensor_info, value_info, with_tangents

_TRAINING = TRAINING_DOMAINS[0]


def scalar_output(model: onnx.ModelProto, of: str | None, where: str) -> str:
    """``of``, or the model's only output; ForwardSpecError unless it is a float graph output that can be a
    scalar (every declared dim 1)."""
    outputs = [o.name for o in model.graph.output]
    if of is None:
        if len(outputs) != 1:
            raise ForwardSpecError(f"{where}: the model has {len(outputs)} outputs {outputs}; name the scalar one "
                                   "with of=")
        of = outputs[0]
    if of not in outputs:
        raise ForwardSpecError(f"{where}: of names {of!r}, which is not a graph output; outputs: {outputs}")
    info = tensor_info(model)[of]
    if info.dtype not in FLOAT_TYPES:
        raise ForwardSpecError(f"{where}: of names {of!r}, which is not floating point")
    if info.shape is not None and any(isinstance(d, int) and d != 1 for d in info.shape):
        raise ForwardSpecError(f"{where}: of names {of!r} of shape {list(info.shape)}, not a scalar; reduce it to one "
                               "(a ReduceSum or ReduceMean) first")
    return of


def hvp(model: onnx.ModelProto | str | os.PathLike, wrt: str | Sequence[str], of: str | None = None
        ) -> onnx.ModelProto:
    """The model's scalar output ``of`` (default: its only output), its gradient and its Hessian-vector
    product with respect to ``wrt`` (float graph inputs or initializers), as one plain ONNX model.

    Inputs: the model's, plus ``<w>.tangent`` per w (v). Outputs: ``of``, ``<w>.grad`` (d of / d w) and
    ``<w>.hvp`` (H v, the block row of the Hessian over all of ``wrt`` applied to v: sum over u in wrt of
    d^2 of / dw du . v_u). Forward over reverse: the gradient as ``lower`` writes it, then its tangent; so
    every op on the path needs a JVP (direct or read off its gradient rule), including the ops of the
    gradient itself (ConvTranspose, ScatterElements, ...). A name the result would take that the model uses
    raises ForwardSpecError.
    """
    base = as_model(model)
    wrt = checked_wrt(base, wrt, "hvp")
    of = scalar_output(base, of, "hvp")
    names = {w: (f"{w}.tangent", f"{w}.grad", f"{w}.hvp") for w in wrt}
    check_free(base, [n for trio in names.values() for n in trio], "hvp",
               "rename those tensors in the model first")
    info = tensor_info(base)
    g = base.graph
    grads = [names[w][1] for w in wrt]
    g.node.append(helper.make_node("Gradient", list(wrt), grads, name="hvp/Gradient", domain=_TRAINING,
                                   xs=list(wrt), y=of))
    kept = [o for o in g.output if o.name == of]
    del g.output[:]
    g.output.extend(kept + [value_info(d, info[w]) for w, d in zip(wrt, grads)])
    base.opset_import.append(helper.make_opsetid(_TRAINING, 1))
    # the LSTM backward records the pre-activations it recomputes; the forward's closed-form tangent supplies them
    shared = {} if emit_option("lstm_hvp_share", True) else None
    with emit_options(lstm_preactivations=shared):
        gradient = lower(base)
        return with_tangents(gradient, wrt, {w: names[w][0] for w in wrt},
                             {names[w][1]: names[w][2] for w in wrt}, where="hvp")
