"""Exceptions raised by onnx-autodiff. Each names what went wrong and what to do about it.

Every class carries a ``hint`` (what to do, one line; the command line prints it after the message) and an
``exit_code`` (2: the input or the request is at fault; 1: the work itself failed).
"""
from __future__ import annotations


class OnnxAutodiffError(Exception):
    """Base class of every error this library raises on purpose."""

    hint: str = "see docs/training.md for what the spec allows"
    exit_code: int = 2

    def __init__(self, *args, hint: str = ""):
        super().__init__(*args)
        if hint:
            self.hint = hint


class UnsupportedOperatorError(OnnxAutodiffError):
    """A node on the differentiated path has an op with no gradient rule.

    ``missing`` lists every (node name, op type, domain, opset) without a rule on that path.
    """

    hint = "freeze the parameters behind that op (--frozen PATTERN) or register a rule (docs/writing_rules.md)"

    def __init__(self, missing: list[tuple[str, str, str, int]], gradient_node: str = ""):
        self.missing = list(missing)
        name, op, domain, opset = self.missing[0]
        where = f" (while lowering Gradient node {gradient_node!r})" if gradient_node else ""
        lines = [
            f"no gradient rule for node {name!r}: op {op!r}, domain {domain or 'ai.onnx'!r}, "
            f"opset {opset}{where}."
        ]
        others = sorted({(o, d or "ai.onnx", v) for _, o, d, v in self.missing[1:]}
                        - {(op, domain or "ai.onnx", opset)})
        if others:
            lines.append(
                "Other ops without a rule on the same path: "
                + ", ".join(f"{o} ({d}, opset {v})" for o, d, v in others)
                + "."
            )
        lines.append(
            "Register one with @onnx_autodiff.gradient_rule (see docs/writing_rules.md), "
            "or exclude the tensors that need it from 'xs'."
        )
        super().__init__(" ".join(lines))


class GradientSpecError(OnnxAutodiffError):
    """A Gradient node is malformed (attributes, inputs or outputs do not fit the spec)."""


class ForwardSpecError(OnnxAutodiffError):
    """A ``jvp`` / ``hvp`` / ``jacobian`` request does not fit the model: a ``wrt`` that is not a float graph
    input or initializer, an ``of`` that is not a float graph output (or not a scalar for ``hvp``), a name
    the result would take that the model already uses."""

    hint = "see docs/forward_mode.md for what jvp, hvp and jacobian take and the names they give"


class GradientRuleError(OnnxAutodiffError, ValueError):
    """A rule cannot differentiate this node as it stands (an attribute value it does not support,
    a shape it needs but cannot see, ...). The message names the node, op and opset."""


class OpsetTooOldError(GradientRuleError):
    """A gradient needs an op or op form newer than the model's opset. ``needs`` is the lowest opset
    that has it: ``lower()`` converts the model there with onnx.version_converter (or re-export it at
    that opset)."""

    def __init__(self, message: str, needs: int):
        self.needs = needs
        super().__init__(message)


class GradientShapeError(OnnxAutodiffError):
    """A rule produced a gradient whose type or shape differs from its input's."""


class TrainingSpecError(OnnxAutodiffError):
    """A TrainingInfoProto (bindings, graphs) does not fit the spec."""


class TrainingDivergedError(OnnxAutodiffError):
    """A step produced NaN or Inf in an output or an updated tensor; the state is the last good one."""

    hint = "lower the learning rate, or check the inputs for NaN or Inf"
    exit_code = 1

    def __init__(self, tensor: str, step: int, bound_to: str | None = None, state_kept: bool = True):
        self.tensor = tensor
        self.step = step
        self.bound_to = bound_to
        self.state_kept = state_kept
        what = f"tensor {tensor!r}" + (f" (the new value of {bound_to!r})" if bound_to else "")
        kept = (f"The session keeps the state after step {step - 1}" if state_kept else
                "The update had already been applied in place: reload the last checkpoint")
        super().__init__(
            f"step {step}: {what} contains NaN or Inf; training stopped. {kept}: lower the learning rate, "
            "check the inputs, or save() and inspect it"
        )


class ForwardMismatchError(OnnxAutodiffError):
    """The first step's forward does not compute what the model computes (``driver/forward_check.py``): the
    step stopped before it changed anything, since it would train against a wrong base."""

    hint = ("this is onnx-autodiff's fault, not the model's: please report it with the model; "
            "TrainingSession(..., check_forward=False) trains anyway")
    exit_code = 1

    def __init__(self, output: str, step: int, detail: str):
        self.output, self.step = output, step
        super().__init__(f"step {step}: the training step's {output!r} differs from a plain onnxruntime run of the "
                         f"model's forward on the same batch {detail}. Training would start from a wrong base, "
                         "so it stopped before changing any weight")


class TrainingBuilderError(TrainingSpecError):
    """``make_training_model`` cannot build the training model; ``field`` names the argument at fault."""

    hint = "see onnx-autodiff make-training --help"

    def __init__(self, field: str, message: str):
        self.field = field
        group, _, attr = field.partition(".")  # LossSpec.label: a field of an option group
        where = f"{group}({attr}=...)" if attr else f"{field}=..."
        super().__init__(f"make_training_model({where}): {message}")


class AdapterError(OnnxAutodiffError, ValueError):
    """LoRA adapters cannot be exported as asked (``export_adapter`` / ``export-adapter``): no adapters, an unknown
    format, a ``prefix`` the module paths do not start with."""

    hint = "see onnx-autodiff export-adapter --help"


class MemoryBudgetError(OnnxAutodiffError, ValueError):
    """A memory budget cannot be read or applied: a size that is not a size, an input dim whose size the
    estimate needs, networkx missing."""

    hint = "see docs/training_builder.md, 'A memory budget'"


class GradcheckError(OnnxAutodiffError):
    """Analytic gradients disagree with finite differences. ``report`` holds the numbers."""

    hint = "try --float32 for ops without float64 kernels"
    exit_code = 1

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report


class ModelFileError(OnnxAutodiffError, OSError):
    """A model file or its external data cannot be read or written (missing, cut short, no room)."""


class OutsideFolderError(ModelFileError):
    """A file names another file outside its own folder (``..``, an absolute path, a symlink out): models come
    from strangers, so we read nothing there."""

    hint = ("keep a model's external data, a checkpoint's base model and a bundle's files in the folder of the file "
            "that names them (or pass the path yourself where the API takes one)")


class ModelTypeError(OnnxAutodiffError, TypeError):
    """What was passed as a model is none of the forms an entry takes (a path, an onnx.ModelProto, what
    onnx-autodiff returned)."""

    hint = "pass the path of an .onnx file or an onnx.ModelProto"


class CheckpointError(OnnxAutodiffError):
    """The train command's checkpoint directory cannot be used as asked (locked, another model's, unwritable).
    ``hint`` says what to do."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        if hint:
            self.hint = hint


class DataError(OnnxAutodiffError):
    """Training data that cannot feed the model (missing array, wrong dtype or shape, labels out of range,
    NaN or Inf). The message names the array; ``hint`` says what to do."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        if hint:
            self.hint = hint


class DistributedError(OnnxAutodiffError):
    """Data-parallel training cannot start or go on: another process stopped, timed out, or started from
    other files or options. ``hint`` says what to do; ``exit_code`` is the command's exit code."""

    exit_code = 1

    def __init__(self, message: str, hint: str = "", code: int = 1):
        super().__init__(message, hint=hint)
        self.exit_code = code


class MissingExtraError(OnnxAutodiffError, ImportError):
    """An optional dependency of ours is not installed (hypothesis for ``onnx_autodiff.testing``'s strategies);
    ``hint`` names the extra that installs it."""


class MissingRuntimeError(OnnxAutodiffError):
    """Something a command needs that pip does not install is missing (onnxruntime-web's files for the browser
    demo). ``hint`` says exactly what to run."""


class DeviceError(OnnxAutodiffError):
    """An execution provider that finds no device, refuses its library, or cannot make a session for a step
    (a GPU adapter missing, a node it will not run with the CPU fallback off)."""

    hint = "see docs/gpu.md"
    exit_code = 1


class TargetError(OnnxAutodiffError, ValueError):
    """An unknown target, or a node a target lacks that has no standard form we can emit for it."""

    hint = "see docs/runtimes.md for the targets and what each runtime lacks"


class BundleError(OnnxAutodiffError):
    """A step bundle that is malformed, or a driver that feeds it wrongly (a state name the step does not
    take, state that does not change after a step with a nonzero learning rate)."""

    hint = "see docs/runtimes.md for the bundle format and the driver loop"
    exit_code = 1


class RuntimeRefusedError(BundleError):
    """A runtime would not take a model we gave it (it could not convert or plan it) or failed running it: one
    line naming the op and node it refused, ``hint`` the target whose lowering avoids it. ``ops`` / ``nodes``:
    what the runtime named; ``stage``: "convert" or "run"; ``detail``: the runtime's own message."""

    def __init__(self, message: str, hint: str = "", *, runtime: str = "", stage: str = "", ops=(), nodes=(),
                 detail: str = ""):
        super().__init__(message, hint=hint)
        self.runtime, self.stage, self.ops, self.nodes, self.detail = runtime, stage, list(ops), list(nodes), detail


class FederatedError(OnnxAutodiffError):
    """A federated run that cannot start or go on: Flower missing, a partition that does not exist, too few
    clients left in a round after bad updates were dropped, an output folder of another model."""

    hint = "see docs/federated.md"
    exit_code = 1

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message, hint=hint)
