"""``onnx-autodiff train ... --runtime openvino|tract|reference|onnxruntime-node``: the epochs of ``train`` over a
step bundle on another runtime. The bundle is built for the runtime's target and the data checked against its
feeds before anything is written; then it goes into ``DIR/bundle/``, and after every epoch the state goes to
``DIR/state.npz`` (the state file, ``state_file.py``), so ``import-state`` (or ``--export``) turns it into an
inference model. No resume: a new run starts from ``init.onnx``. A run that fails before its first epoch ends (a
runtime that refuses the step, an interrupt) removes the folders it made."""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import numpy as np

from ..driver.bundle import build_bundle, write_bundle
from ..driver.progress import Progress
from ..errors import DataError
from .loop import BundleTrainer
from .state_file import save_state


def bundle_arrays(manifest: dict, data: dict) -> dict[str, np.ndarray]:
    """The data mapped onto the step's feeds (by name, or X / y for the first and last feed), checked: every feed
    has an array, every array is a feed, the sample counts agree, the dims the step fixes match, the dtype converts
    without loss, float arrays are finite."""
    feeds = {f["name"]: f for f in manifest["feeds"]}
    names = list(feeds)
    aliases = {"X": names[0], "y": names[-1]} if names else {}
    out = {}
    for key, arr in data.items():
        name = key if key in feeds else aliases.get(key)
        if name is None:
            raise DataError(f"the data has {key!r}, which is no feed of the step (feeds: {names})")
        arr = np.asarray(arr)
        want = np.dtype(feeds[name]["dtype"])
        if want.kind in "iu" and arr.dtype.kind == "f" and not np.array_equal(arr, np.round(arr)):
            raise DataError(f"{key!r} holds fractions, but the feed {name!r} is {want.name}",
                            "pass integer class labels or token ids")
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
            raise DataError(f"{key!r} holds NaN or Inf", "clean the data first")
        shape = feeds[name]["shape"]
        if shape is not None and (len(shape) != arr.ndim or any(isinstance(d, int) and d != n
                                                                for d, n in zip(shape[1:], arr.shape[1:]))):
            raise DataError(f"{key!r} has shape {list(arr.shape)}; the feed {name!r} takes {shape}")
        out[name] = arr.astype(want, copy=False)
    missing = [n for n in names if n not in out]
    if missing:
        raise DataError(f"the data lacks the feeds {missing} of the step")
    counts = {k: len(v) for k, v in out.items()}
    if len(set(counts.values())) > 1:
        raise DataError(f"the arrays hold different numbers of samples: {counts}")
    return out


def train_bundle(model, data: dict, *, runtime: str, checkpoint: str, batch_size: int, epochs: int,
                 seed: int = 0, shuffle: bool = True, lr: float | None = None, progress: bool = True,
                 log: Callable[[str], None] = print) -> BundleTrainer:
    """Train ``model`` (a training model) on ``data`` through its bundle on ``runtime``."""
    step, init, manifest = build_bundle(model, runtime)  # the record of the runtime: the ops it lacks, its fixes
    arrays = bundle_arrays(manifest, data)
    made = [p for p in (checkpoint, os.path.join(checkpoint, "bundle")) if not os.path.exists(p)]
    state_path = os.path.join(checkpoint, "state.npz")
    try:
        bundle = os.path.dirname(write_bundle(step, init, manifest, os.path.join(checkpoint, "bundle")))
        trainer = BundleTrainer(bundle, runtime)
        _epochs(trainer, arrays, runtime, state_path, batch_size, epochs, seed, shuffle, lr, progress, log)
    except BaseException:
        if not os.path.exists(state_path):  # no epoch finished: nothing of this run is worth keeping
            for path in reversed(made):
                shutil.rmtree(path, ignore_errors=True)
        raise
    return trainer


def _epochs(trainer: BundleTrainer, arrays: dict, runtime: str, state_path: str, batch_size: int, epochs: int,
            seed: int, shuffle: bool, lr: float | None, progress: bool, log) -> None:
    n = len(next(iter(arrays.values())))
    hyper = {"learning_rate": lr} if lr is not None and "learning_rate" in trainer.hyper else None
    log(f"training on {runtime}: {n} samples, {epochs} epoch(s) of {-(-n // batch_size)} steps")
    for epoch in range(epochs):
        order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
        losses = []
        with Progress(-(-n // batch_size), f"epoch {epoch + 1}/{epochs}", enabled=progress) as bar:
            for start in range(0, n, batch_size):
                idx = order[start:start + batch_size]
                losses.append(trainer.step({k: v[idx] for k, v in arrays.items()}, hyper))
                bar.update(loss=losses[-1])
        save_state(state_path, trainer.state)
        log(f"epoch {epoch + 1}/{epochs}: mean loss {np.mean(losses):.4g}")


__all__ = ["train_bundle", "bundle_arrays"]
