"""``TrainingSession.fit``: epochs over in-memory arrays, resumable from a checkpoint directory.

It batches and shuffles the arrays (the order of epoch ``e`` is ``default_rng([seed, e])``, so a resumed run
sees the same batches), feeds the learning rate (a number, or a schedule ``lr(step)``), shows progress,
and, given ``checkpoint=DIR``, writes ``DIR/checkpoint.onnx`` after every epoch with the training state in
its metadata (``checkpoint.py``) and continues from it when it is there. The data is checked before the
first step (``train_data.py``). The ``train`` command is this plus argument parsing and printing.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace

import numpy as np

from ..errors import DataError, TrainingSpecError
from ..model import metadata
from .accumulate import SplitStep
from .checkpoint import CheckpointDir, TrainState, check_resume
from .text import TextData
from .train_data import map_data

_log = logging.getLogger("onnx_autodiff")

LearningRate = float | Callable[[int], float] | None


def learning_rate_input(sess) -> str | None:
    """The input the learning rate is fed through: the one ``make_training_model`` recorded, else an input
    called ``learning_rate``; None when the rate is fixed inside the model."""
    name = (metadata.read_json(sess.model, metadata.BUILDER) or {}).get("learning_rate")
    if name is None and "learning_rate" in sess.feed_names:
        name = "learning_rate"
    return name


def step_fingerprint(sess) -> str:
    """sha256 of the step's structure (nodes, inputs, outputs, initializer names, types and shapes; not the
    values): the same for a session of the training model and one of its checkpoints."""
    g = sess.step_model.graph
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


def _batches(sess, arrays, order, batch_size: int, lr_input: str | None, lr: LearningRate) -> Iterator[dict]:
    for k in range(0, len(order), batch_size):
        idx = order[k:k + batch_size]
        feeds = {name: arr[idx] for name, arr in arrays.items()}
        if lr_input and lr is not None:
            feeds[lr_input] = np.float32(lr(sess.steps) if callable(lr) else lr)  # a schedule sees the steps done
        yield feeds


def fit(sess, data: Mapping[str, np.ndarray], batch_size: int = 32, epochs: int = 1, *,
        checkpoint: str | os.PathLike | CheckpointDir | None = None, seed: int = 0, shuffle: bool = True,
        lr: LearningRate = None, progress: bool = True, log: Callable[[str], None] | None = None,
        on_epoch: Callable[[TrainState], bool | None] | None = None, callback: Callable | None = None,
        identity: TrainState | None = None,
        names: tuple[str, str] = ("this session's model", "this data"),
        accumulate: int = 1, group=None) -> TrainState:
    """See ``TrainingSession.fit``. ``identity``: the fingerprints (and file names) of the model and the data
    to store and compare on resume (the ``train`` command gives those of its files); ``names``: how messages
    call the model and the data. ``accumulate``: run each batch as that many micro-batches and update once;
    ``group``: a ``distributed.DataParallel`` whose processes each run their slice of every batch
    (``accumulate.py`` says how a batch is cut)."""
    say = log or _log.info
    if batch_size < 1 or epochs < 1:
        raise ValueError(f"batch_size and epochs must be at least 1, got {batch_size} and {epochs}")
    record = metadata.read_json(sess.model, metadata.BUILDER)
    lr_input = learning_rate_input(sess)
    if lr is not None and lr_input is None:
        raise TrainingSpecError("this model has no learning-rate input: its learning rate is fixed inside the model",
                                hint="drop --lr, or rebuild it with make-training")
    tokens = None
    if isinstance(data, TextData):
        data, tokens = data.for_session(sess, say), TextData.count_tokens
    arrays = map_data(sess, data, lr_input, record)
    step = _split_step(sess, arrays, batch_size, accumulate, group)
    fresh = replace(identity) if identity is not None else TrainState(
        model_sha256=step_fingerprint(sess), data_sha256=data_fingerprint(arrays), batch_size=batch_size,
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
                state, resumed = _resume(sess, ckdir, fresh, names), True
        if lr is None:
            lr = state.lr if state.lr is not None else (record or {}).get("lr", 1e-3)
        fixed_lr = None if callable(lr) else float(lr)
        if resumed:
            say(f"resuming from {ckdir.model_path}: {state.epochs_done} epoch(s), {state.steps} steps done")
            if state.lr is not None and fixed_lr is not None and fixed_lr != state.lr:
                say(f"note: training on with lr {fixed_lr:g}; the checkpoint's epochs used lr {state.lr:g}")
            if state.epochs_done >= epochs:
                say(f"already trained {state.epochs_done} epoch(s); nothing to do (raise --epochs to train more)")
                return state
        if group is not None:  # every process starts from the same files, checkpoint and options, or none does
            group.check_same({"model": state.model_sha256, "data": state.data_sha256, "steps": sess.steps,
                              "epochs done": state.epochs_done, "batch size": batch_size, "seed": seed,
                              "shuffle": shuffle, "accumulate": accumulate, "epochs": epochs,
                              "lr": None if callable(lr) else float(lr)})
        _epochs(sess, arrays, state, lr_input, lr, epochs, progress, ckdir, say, on_epoch, callback, step, tokens)
        return state
    finally:
        if took_lock:
            ckdir.release()


def _split_step(sess, arrays, batch_size: int, accumulate: int, group):
    """The step function: ``sess.step``, or a ``SplitStep`` over this process's micro-batches of each batch."""
    if accumulate == 1 and group is None:
        return None
    world = group.world if group is not None else 1
    n = len(next(iter(arrays.values())))
    last = n % batch_size
    if last and last < world * accumulate:
        raise DataError(f"the last batch of each epoch has {last} sample(s) ({n} samples, batch size {batch_size}), "
                        f"fewer than the {world * accumulate} parts it must be cut into",
                        "drop or add a few samples, or change the batch size")
    return SplitStep(sess, list(arrays), accumulate, group.rank if group is not None else 0, world,
                     group.reduce if group is not None else None).step


def _resume(sess, ckdir: CheckpointDir, fresh: TrainState, names: tuple[str, str]) -> TrainState:
    """The checkpoint's training state, checked against this run; its tensors go into the session unless
    the session already holds them (it was built from this checkpoint)."""
    saved = ckdir.saved_state()
    check_resume(ckdir, saved, fresh, *names)
    if sess.train_state != saved or sess.steps != saved.steps:
        light, _ = ckdir.load(base=sess.base_path)
        sess.load_checkpoint_state(light.proto, light.arrays)
    return saved


def _epochs(sess, arrays, state: TrainState, lr_input, lr: LearningRate, epochs: int, progress: bool,
            ckdir: CheckpointDir | None, say, on_epoch, callback, step=None, tokens=None) -> None:
    n = len(next(iter(arrays.values())))
    steps_per_epoch = math.ceil(n / state.batch_size)
    shown_lr = f", lr {lr:g}" if lr_input and not callable(lr) else (", lr scheduled" if lr_input else "")
    say(f"training on {n} samples ({', '.join(f'{k} {list(v.shape)}' for k, v in arrays.items())}), "
        f"{steps_per_epoch} steps per epoch{shown_lr}")
    for epoch in range(state.epochs_done, epochs):
        start = time.perf_counter()
        order = np.random.default_rng([state.seed, epoch]).permutation(n) if state.shuffle else np.arange(n)
        feeds = _batches(sess, arrays, order, state.batch_size, lr_input, lr)
        losses = sess.run_epoch(feeds, f"epoch {epoch + 1}/{epochs}", progress=progress, total=steps_per_epoch,
                                callback=callback, step=step, tokens=tokens)
        known = [x for x in losses if x is not None]
        mean = float(np.mean(known)) if known else float("nan")
        state.epochs_done, state.steps = epoch + 1, sess.steps
        state.lr = None if callable(lr) else float(lr)
        state.losses = state.losses + [mean]
        if ckdir is not None:
            ckdir.save(sess, state)
        sess.train_state = replace(state, losses=list(state.losses))
        say(f"epoch {epoch + 1}/{epochs}: loss {mean:.6f} ({len(losses)} steps, {time.perf_counter() - start:.1f} s)")
        if on_epoch is not None and on_epoch(state) is False:
            break


__all__ = ["fit", "learning_rate_input", "step_fingerprint", "data_fingerprint"]
