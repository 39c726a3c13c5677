"""``fit``: epochs over in-memory arrays, resumable from a checkpoint directory, on every runtime.

It drives a ``Trainer``: a ``TrainingSession`` (onnxruntime, on the CPU or a device) or a ``runtimes.loop.
BundleTrainer`` (a step bundle on onnx.reference, OpenVINO, tract, onnxruntime-node, ...). Both give what this
loop needs (the ``Trainer`` protocol below), so the batches, their order (epoch ``e`` is ``default_rng([seed,
e])``, so a resumed run sees the same batches), the learning rate (a number, or a schedule ``lr(step)``), the
data checks (``train_data.py``, before the first step), progress, the epoch line and the checkpoints are the
same code for every runtime. Given ``checkpoint=DIR`` it writes ``DIR/checkpoint.onnx`` after every epoch with the
training state in its metadata (``checkpoint.py``) and continues from it when it is there, whichever runtime
wrote it: the state is the same tensors under the same names. The ``train`` command is this plus argument
parsing and printing.

The epoch line is stable (scripts parse it)::

    epoch 3/10: loss 0.123456 (mean loss 0.123456 over 45 steps, 0.2 s)

``loss`` and ``mean loss`` are both the epoch's mean loss: ``epoch N/M: loss X`` is the form of 0.x releases
before the mean was named, ``mean loss X`` the form after; one line both read.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Protocol

import numpy as np
import onnx

from ..errors import DataError, TrainingSpecError
from ..model import metadata
from .accumulate import SplitStep
from .checkpoint import CheckpointDir, TrainState, check_resume
from .progress import Progress
from .text import TextData
from .train_data import map_data

_log = logging.getLogger("onnx_autodiff")

LearningRate = float | Callable[[int], float] | None


class Trainer(Protocol):
    """What ``fit`` drives: ``TrainingSession`` and ``runtimes.loop.BundleTrainer`` both are one.

    ``feed_names``: the data inputs of a step (no state; the learning rate only where it has no default);
    ``hyper``: inputs with a default (``{name: value}``; a session has none to name); ``model``: the training
    model (its builder record, inputs, labels and loss: the data checks read it) and ``index`` its
    ``training_info``; ``step_model``: the step as a runtime runs it (its input types); ``loss_name``;
    ``steps``: steps done; ``state``: every state tensor by name, as numpy arrays (the same names on every
    runtime). ``step(feeds)`` runs one step: its outputs by name, or the loss. ``save(path,
    metadata=)`` writes a checkpoint (the training model with the current state, ``metadata`` in its
    ``metadata_props``, atomically); ``load_checkpoint_state(model, weights)`` takes the state and the step
    count back from one; ``train_state``: the ``TrainState`` it was opened from or last saved (None if none);
    ``base_path``: the model file a checkpoint's referenced frozen weights are in (or None)."""

    feed_names: list[str]
    model: onnx.ModelProto
    index: int
    step_model: onnx.ModelProto
    loss_name: str | None
    steps: int
    state: Mapping[str, np.ndarray]
    train_state: TrainState | None
    base_path: str | None

    def step(self, feeds: dict) -> Mapping[str, np.ndarray] | float: ...

    def save(self, path, *, metadata: dict[str, str] | None = None) -> None: ...

    def load_checkpoint_state(self, model: onnx.ModelProto, weights: Mapping | None = None) -> None: ...


def learning_rate_input(trainer: Trainer) -> str | None:
    """The input the learning rate is fed through: the one ``make_training_model`` recorded, else an input
    called ``learning_rate``; None when the rate is fixed inside the model."""
    name = (metadata.read_json(trainer.model, metadata.BUILDER) or {}).get("learning_rate")
    if name is None and "learning_rate" in [*trainer.feed_names, *getattr(trainer, "hyper", ())]:
        name = "learning_rate"
    return name


def step_fingerprint(trainer: Trainer) -> str:
    """sha256 of the step's structure (nodes, inputs, outputs, initializer names, types and shapes; not the
    values): the same for a session of the training model and one of its checkpoints."""
    g = trainer.step_model.graph
    h = hashlib.sha256()
    for n in g.node:
        h.update(n.SerializeToString(deterministic=True))
    for v in list(g.input) + list(g.output):
        h.update(v.SerializeToString(deterministic=True))
    for t in sorted(g.initializer, key=lambda t: t.name):
        h.update(f"{t.name}:{t.data_type}:{list(t.dims)}".encode())
    return h.hexdigest()


def data_fingerprint(arrays: Mapping[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        arr = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{arr.dtype.str}:{arr.shape}".encode())
        if arr.size:  # a cast of an empty view (an empty KV cache) is an error
            h.update(memoryview(arr).cast("B"))
    return h.hexdigest()


def epoch_line(epoch: int, epochs: int, mean: float, steps: int, seconds: float) -> str:
    """The stable epoch line (module docstring): the old ``epoch N/M: loss X`` and the newer ``mean loss X``
    parsers both read it."""
    return f"epoch {epoch}/{epochs}: loss {mean:.6f} (mean loss {mean:.6f} over {steps} steps, {seconds:.1f} s)"


def run_epoch(trainer: Trainer, batches, desc: str = "epoch", *, callback: Callable | None = None,
              progress: bool = True, total: int | None = None, step: Callable | None = None,
              tokens: Callable[[dict], int] | None = None) -> list:
    """``step`` over every feed dict of ``batches`` with one progress line ``desc``; the loss of every step
    (None without a loss output). ``callback(step, outputs)`` returning False stops early. The one loop over
    steps: ``fit``, ``TrainingSession.run_epoch`` / ``train`` and the demo run it. ``step``: what runs one batch
    instead of ``trainer.step`` (``accumulate.SplitStep.step``: micro-batches, several processes).
    ``tokens(feeds)``: the tokens of a batch, for a tokens/s rate in the progress line."""
    if total is None and hasattr(batches, "__len__"):
        total = len(batches)
    losses: list = []
    loss_name = trainer.loss_name
    with Progress(total, desc, enabled=progress) as bar:
        for feeds in batches:
            out = (step or trainer.step)(feeds)
            if not isinstance(out, Mapping):  # a bundle's step returns its loss
                out = {loss_name: out}
            loss = float(np.asarray(out[loss_name]).reshape(-1)[0]) if loss_name else None
            losses.append(loss)
            bar.update(loss=loss, tokens=tokens(feeds) if tokens is not None else None)
            if callback is not None and callback(trainer.steps, out) is False:
                break
    return losses


def _batches(trainer: Trainer, arrays, order, batch_size: int, lr_input: str | None,
             lr: LearningRate) -> Iterator[dict]:
    for k in range(0, len(order), batch_size):
        idx = order[k:k + batch_size]
        feeds = {name: arr[idx] for name, arr in arrays.items()}
        if lr_input and lr is not None:  # a schedule sees the steps done
            feeds[lr_input] = np.float32(lr(trainer.steps) if callable(lr) else lr)
        yield feeds


def fit(trainer: Trainer, data: Mapping[str, np.ndarray], batch_size: int = 32, epochs: int = 1, *,
        checkpoint: str | os.PathLike | CheckpointDir | None = None, seed: int = 0, shuffle: bool = True,
        lr: LearningRate = None, progress: bool = True, log: Callable[[str], None] | None = None,
        on_epoch: Callable[[TrainState], bool | None] | None = None, callback: Callable | None = None,
        identity: TrainState | None = None,
        names: tuple[str, str] = ("this trainer's model", "this data"),
        accumulate: int = 1, group=None) -> TrainState:
    """See ``TrainingSession.fit``; ``trainer``: a ``Trainer`` (a session or a ``BundleTrainer``).
    ``identity``: the fingerprints (and file names) of the model and the data to store and compare on resume
    (the ``train`` command gives those of its files; default: the step's structure and the arrays);
    ``names``: how messages call the model and the data. ``accumulate``: run each batch as that many
    micro-batches and update once; ``group``: a ``distributed.DataParallel`` whose processes each run their
    slice of every batch (``accumulate.py`` says how a batch is cut); both need a ``TrainingSession``."""
    say = log or _log.info
    if batch_size < 1 or epochs < 1:
        raise ValueError(f"batch_size and epochs must be at least 1, got {batch_size} and {epochs}")
    record = metadata.read_json(trainer.model, metadata.BUILDER)
    lr_input = learning_rate_input(trainer)
    if lr is not None and lr_input is None:
        raise TrainingSpecError("this model has no learning-rate input: its learning rate is fixed inside the model",
                                hint="drop --lr, or rebuild it with make-training")
    tokens = None
    if isinstance(data, TextData):
        data, tokens = data.for_session(trainer, say), TextData.count_tokens
    arrays = map_data(trainer, data, lr_input, record)
    step = _split_step(trainer, arrays, batch_size, accumulate, group)
    fresh = replace(identity) if identity is not None else TrainState(
        model_sha256=step_fingerprint(trainer), data_sha256=data_fingerprint(arrays), batch_size=batch_size,
        seed=seed, shuffle=shuffle, lr=None)
    fresh.batch_size, fresh.seed, fresh.shuffle = batch_size, seed, shuffle
    ckdir = checkpoint if checkpoint is None or isinstance(checkpoint, CheckpointDir) else CheckpointDir(
        os.fspath(checkpoint))
    took_lock = ckdir is not None and not ckdir.locked
    try:
        state, resumed = fresh, False
        if ckdir is not None:
            if took_lock:  # only now, with valid inputs, does the directory appear
                ckdir.lock(create=True)
            if ckdir.removed:
                say(f"removed {len(ckdir.removed)} temporary file(s) a killed save left in {ckdir.path}")
            if ckdir.has_checkpoint():
                state, resumed = _resume(trainer, ckdir, fresh, names), True
        if lr is None:
            lr = state.lr if state.lr is not None else (record or {}).get("lr", 1e-3)
        if resumed and _resumed_done(state, lr, epochs, ckdir, say):
            return state
        if group is not None:  # every process starts from the same files, checkpoint and options, or none does
            group.check_same({"model": state.model_sha256, "data": state.data_sha256, "steps": trainer.steps,
                              "epochs done": state.epochs_done, "batch size": batch_size, "seed": seed,
                              "shuffle": shuffle, "accumulate": accumulate, "epochs": epochs,
                              "lr": None if callable(lr) else float(lr)})
        _epochs(trainer, arrays, state, lr_input, lr, epochs, progress, ckdir, say, on_epoch, callback, step, tokens)
        return state
    finally:
        if took_lock:
            ckdir.release()


def _resumed_done(state: TrainState, lr: LearningRate, epochs: int, ckdir: CheckpointDir, say) -> bool:
    """Say where a resumed run continues; True when its epochs are all done already."""
    say(f"resuming from {ckdir.model_path}: {state.epochs_done} epoch(s), {state.steps} steps done")
    fixed_lr = None if callable(lr) else float(lr)
    if state.lr is not None and fixed_lr is not None and fixed_lr != state.lr:
        say(f"note: training on with lr {fixed_lr:g}; the checkpoint's epochs used lr {state.lr:g}")
    if state.epochs_done >= epochs:
        say(f"already trained {state.epochs_done} epoch(s); nothing to do (raise --epochs to train more)")
        return True
    return False


def _split_step(trainer: Trainer, arrays, batch_size: int, accumulate: int, group):
    """The step function: ``trainer.step``, or a ``SplitStep`` over this process's micro-batches of each batch."""
    if accumulate == 1 and group is None:
        return None
    if not hasattr(trainer, "gradients"):
        raise TrainingSpecError(f"accumulate={accumulate} and data-parallel groups need a TrainingSession (a step in "
                                "two halves); a step bundle runs one step per batch", hint="pass accumulate=1")
    world = group.world if group is not None else 1
    n = len(next(iter(arrays.values())))
    last = n % batch_size
    if last and last < world * accumulate:
        raise DataError(f"the last batch of each epoch has {last} sample(s) ({n} samples, batch size {batch_size}), "
                        f"fewer than the {world * accumulate} parts it must be cut into",
                        "drop or add a few samples, or change the batch size")
    return SplitStep(trainer, list(arrays), accumulate, group.rank if group is not None else 0, world,
                     group.reduce if group is not None else None).step


def _resume(trainer: Trainer, ckdir: CheckpointDir, fresh: TrainState, names: tuple[str, str]) -> TrainState:
    """The checkpoint's training state, checked against this run; its tensors go into the trainer unless
    it already holds them (it was opened from this checkpoint). Any runtime may have written it."""
    saved = ckdir.saved_state()
    check_resume(ckdir, saved, fresh, *names)
    if trainer.train_state != saved or trainer.steps != saved.steps:
        light, _ = ckdir.load(base=trainer.base_path)
        trainer.load_checkpoint_state(light.proto, light.arrays)
    return saved


def _epochs(trainer: Trainer, arrays, state: TrainState, lr_input, lr: LearningRate, epochs: int, progress: bool,
            ckdir: CheckpointDir | None, say, on_epoch, callback, step=None, tokens=None) -> None:
    n = len(next(iter(arrays.values())))
    steps_per_epoch = math.ceil(n / state.batch_size)
    shown_lr = f", lr {lr:g}" if lr_input and not callable(lr) else (", lr scheduled" if lr_input else "")
    say(f"training on {n} samples ({', '.join(f'{k} {list(v.shape)}' for k, v in arrays.items())}), "
        f"{steps_per_epoch} steps per epoch{shown_lr}")
    for epoch in range(state.epochs_done, epochs):
        start = time.perf_counter()
        order = np.random.default_rng([state.seed, epoch]).permutation(n) if state.shuffle else np.arange(n)
        feeds = _batches(trainer, arrays, order, state.batch_size, lr_input, lr)
        losses = run_epoch(trainer, feeds, f"epoch {epoch + 1}/{epochs}", progress=progress, total=steps_per_epoch,
                           callback=callback, step=step, tokens=tokens)
        known = [x for x in losses if x is not None]
        mean = float(np.mean(known)) if known else float("nan")
        state.epochs_done, state.steps = epoch + 1, trainer.steps
        state.lr = None if callable(lr) else float(lr)
        state.losses = state.losses + [mean]
        if ckdir is not None:
            ckdir.save(trainer, state)
        trainer.train_state = replace(state, losses=list(state.losses))
        say(epoch_line(epoch + 1, epochs, mean, len(losses), time.perf_counter() - start))
        if on_epoch is not None and on_epoch(state) is False:
            break


__all__ = ["fit", "run_epoch", "epoch_line", "Trainer", "learning_rate_input", "step_fingerprint",
           "data_fingerprint"]
