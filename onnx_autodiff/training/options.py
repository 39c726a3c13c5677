"""The option groups of ``make_training_model``: what the loss reads (``LossSpec``), the optimizer and its
options (``OptimizerSpec``), a memory budget (``MemoryBudget``) and mixed precision (``Precision``). A plain name or
size stands for the group with its defaults (``loss="mse"`` is ``LossSpec("mse")``)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace

import onnx

from ..errors import TrainingBuilderError


@dataclass(frozen=True)
class LossSpec:
    """``loss``: a name (``cross_entropy``, ``causal_lm``, ``nll``, ``mse``, ``l1``, ``bce``, ``bce_with_logits``),
    a GraphProto (inputs: model output, label; output: a scalar) or a dict ``{output: loss}`` for a weighted
    sum over several outputs. ``outputs``: the output(s) the loss reads when ``loss`` is not a dict (default:
    the first graph output). ``label``: the label input's name (default ``labels``; ``<output>_labels`` for
    several outputs; ``causal_lm`` reads the token-id input), or a dict per output. ``label_shape``: the
    shape the data's labels will have, checked against the loss. ``weights``: ``{output: weight}`` of the
    terms (default 1). ``options``: options of a built-in loss (``cross_entropy``: ``axis``, 1 or -1;
    ``causal_lm``: ``mask``, an input whose 0s mark tokens that do not count), or a dict per output."""

    loss: str | onnx.GraphProto | dict = "cross_entropy"
    outputs: str | list | None = None
    label: str | dict | None = None
    label_shape: list | dict | None = None
    weights: dict | None = None
    options: dict | None = None


@dataclass(frozen=True)
class OptimizerSpec:
    """``name``: ``sgd``, ``momentum``, ``nesterov``, ``adagrad``, ``adam`` or ``adamw``; ``options`` override
    torch's defaults (``betas``, ``eps``, ``weight_decay``, ``momentum``, ``dampening``, ``lr_decay``)."""

    name: str = "adam"
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class MemoryBudget:
    """``size``: bytes, a size text (``"2GiB"``, ``"500MB"``) or ``"auto"`` (the memory available now);
    ``dims``: the sizes of the inputs' symbolic dims for the estimate (``{"batch": 32}``)."""

    size: int | str
    dims: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Precision:
    """Mixed precision (``training/precision.py``): the forward and backward in ``dtype`` (``"fp16"`` or
    ``"bf16"``), float32 master copies of the trained tensors and float32 optimizer state. ``loss_scale``:
    ``"dynamic"`` (float16's default), a fixed scale, None (bfloat16's default: its range is float32's), or
    ``"auto"`` for those defaults. Dynamic scaling starts at ``init_scale``, multiplies by ``backoff_factor`` and
    skips the step when a gradient is Inf/NaN, and by ``growth_factor`` after ``growth_interval`` clean steps
    (``torch.amp.GradScaler``'s defaults)."""

    dtype: str = "fp16"
    loss_scale: str | float | None = "auto"
    init_scale: float = 2.0 ** 16
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5


def as_loss(loss) -> LossSpec:
    return loss if isinstance(loss, LossSpec) else LossSpec(loss)


def as_optimizer(optimizer) -> OptimizerSpec:
    return optimizer if isinstance(optimizer, OptimizerSpec) else OptimizerSpec(optimizer)


def as_budget(budget) -> MemoryBudget | None:
    return budget if budget is None or isinstance(budget, MemoryBudget) else MemoryBudget(budget)


# make_training_model's keywords before the option groups (removed in e0f1553), kept one more release with a
# DeprecationWarning: keyword -> (group field, the new form the warning names)
_LOSS_KEYWORDS = {
    "outputs": ("outputs", "loss=LossSpec(loss, outputs=...)"),
    "label": ("label", "loss=LossSpec(loss, label=...)"),
    "label_shape": ("label_shape", "loss=LossSpec(loss, label_shape=...)"),
    "loss_weights": ("weights", "loss=LossSpec(loss, weights=...)"),
    "loss_options": ("options", "loss=LossSpec(loss, options=...)"),
}
_OTHER_KEYWORDS = {
    "optimizer_options": "optimizer=OptimizerSpec(name, options)",
    "memory_budget_dims": "memory_budget=MemoryBudget(size, dims)",
    "weights": "the model's path (its weights are memory-mapped, not copied) in place of io.load_split's pair",
}


def deprecated_keywords(loss, optimizer, memory_budget, old: dict, *, stacklevel: int = 3):
    """``(loss, optimizer, memory_budget, weights)`` with ``make_training_model``'s removed keywords in ``old``
    folded into the option groups, each with a ``DeprecationWarning`` naming its new form (``stacklevel``: the
    caller of ``make_training_model``). A keyword that never existed is the ``TypeError`` Python gives; one
    that says something its group already says differently is our error."""
    unknown = [k for k in old if k not in _LOSS_KEYWORDS and k not in _OTHER_KEYWORDS]
    if unknown:
        raise TypeError(f"make_training_model() got an unexpected keyword argument {unknown[0]!r}")
    for key in old:
        new = _LOSS_KEYWORDS[key][1] if key in _LOSS_KEYWORDS else _OTHER_KEYWORDS[key]
        warnings.warn(f"make_training_model({key}=...) is deprecated and goes in the release after next; "
                      f"use {new}", DeprecationWarning, stacklevel=stacklevel)
    loss_fields = {_LOSS_KEYWORDS[k][0]: (k, v) for k, v in old.items() if k in _LOSS_KEYWORDS}
    if loss_fields:
        spec = as_loss(loss)
        loss = replace(spec, **{f: _merged(getattr(spec, f), v, k, f"LossSpec.{f}")
                                for f, (k, v) in loss_fields.items()})
    if old.get("optimizer_options") is not None:
        spec = as_optimizer(optimizer)
        options = _merged(spec.options or None, dict(old["optimizer_options"]), "optimizer_options",
                          "OptimizerSpec.options")
        optimizer = replace(spec, options=options)
    if old.get("memory_budget_dims") is not None and memory_budget is not None:
        spec = as_budget(memory_budget)
        dims = _merged(spec.dims or None, dict(old["memory_budget_dims"]), "memory_budget_dims", "MemoryBudget.dims")
        memory_budget = replace(spec, dims=dims)
    return loss, optimizer, memory_budget, old.get("weights")


def _merged(current, value, keyword: str, field_name: str):
    if current is not None and current != value:
        raise TrainingBuilderError(keyword, f"{keyword}= and {field_name} both given and they differ "
                                            f"({value!r} vs {current!r}); give {field_name} only")
    return value


__all__ = ["LossSpec", "OptimizerSpec", "MemoryBudget", "Precision", "as_loss", "as_optimizer", "as_budget",
           "deprecated_keywords"]
