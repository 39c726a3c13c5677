"""``onnx-autodiff train ... --runtime openvino|tract|reference|onnxruntime-node``: ``driver/fit.py`` over a step
bundle on another runtime. This module only builds the bundle for the runtime's target, writes it into
``DIR/bundle/`` and hands a ``BundleTrainer`` of it to ``fit``, which runs the epochs, the data checks, the
checkpoints (``DIR/checkpoint.onnx``, the same file as on onnxruntime) and the resume, as for a
``TrainingSession``. A checkpoint of another model is refused before the bundle is written. A run that fails
before its first checkpoint (a runtime that refuses the step, bad data, an interrupt) removes the folders it
made.

Deprecated: ``DIR/state.npz`` (the state file, ``state_file.py``) is still written after every epoch, for one
release; ``import-state`` reads ``DIR/checkpoint.onnx`` as well."""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace

from ..driver.bundle import build_bundle, write_bundle
from ..driver.checkpoint import CheckpointDir, TrainState, check_resume
from ..driver.fit import fit, step_fingerprint
from ..model.carrier import open_model
from .loop import BundleTrainer
from .state_file import save_state


def train_bundle(model, data: dict, *, runtime: str, checkpoint: str | CheckpointDir, batch_size: int,
                 epochs: int, seed: int = 0, shuffle: bool = True, lr: float | None = None, progress: bool = True,
                 log: Callable[[str], None] = print, identity: TrainState | None = None,
                 names: tuple[str, str] = ("this model", "this data")) -> BundleTrainer:
    """Train ``model`` (a training model) on ``data`` through its bundle on ``runtime``, resuming from
    ``checkpoint`` (a directory) when it holds a checkpoint of this model. ``identity`` and ``names``: as for
    ``fit`` (the ``train`` command gives the fingerprints of its files, so a checkpoint any runtime wrote
    resumes here)."""
    light = open_model(model, what="training model")
    ckdir = checkpoint if isinstance(checkpoint, CheckpointDir) else CheckpointDir(os.fspath(checkpoint))
    made = [p for p in (ckdir.path, os.path.join(ckdir.path, "bundle")) if not os.path.exists(p)]
    took_lock = not ckdir.locked
    try:
        if ckdir.exists() and took_lock:
            ckdir.lock()
        step, init, manifest = build_bundle(light, runtime)  # the record of the runtime: its lacks, its fixes
        if ckdir.has_checkpoint():  # refuse another model's checkpoint before writing anything
            _check_model(ckdir, light, step.proto, identity, names)
        bundle = os.path.dirname(write_bundle(step, init, manifest, os.path.join(ckdir.path, "bundle")))
        if took_lock and not ckdir.locked:
            ckdir.lock()
        trainer = BundleTrainer(bundle, runtime, model=light)
        state_path = os.path.join(ckdir.path, "state.npz")  # deprecated (module docstring)
        fit(trainer, data, batch_size, epochs, checkpoint=ckdir, seed=seed, shuffle=shuffle, lr=lr,
            progress=progress, log=log, identity=identity, names=names,
            on_epoch=lambda state: save_state(state_path, trainer.state))
    except BaseException:
        if not ckdir.has_checkpoint():  # no epoch finished: nothing of this run is worth keeping
            ckdir.release()
            for path in reversed(made):
                shutil.rmtree(path, ignore_errors=True)
        raise
    finally:
        if took_lock:
            ckdir.release()
    return trainer


def _check_model(ckdir: CheckpointDir, light, step, identity: TrainState | None, names: tuple[str, str]) -> None:
    """``check_resume`` of the checkpoint against ``identity``; without one (Python), against the step's
    structure, as ``fit`` compares it (the data is compared by ``fit``)."""
    saved = ckdir.load(base=light.source)[1]
    if identity is None:
        identity = replace(saved, model_sha256=step_fingerprint(SimpleNamespace(step_model=step)))
    check_resume(ckdir, saved, identity, *names)


__all__ = ["train_bundle"]
