"""``onnx-autodiff train ... --runtime openvino|tract|reference``: the epochs of ``train`` over a step
bundle on another runtime. The bundle is exported into the checkpoint directory; after every epoch the
state goes to ``DIR/state.npz`` (the state file, ``state_file.py``), so ``import-state`` (or ``--export``)
turns it into an inference model. No resume: a new run starts from ``init.onnx``."""
from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from ..driver.bundle import export_step
from ..driver.progress import Progress
from ..errors import DataError
from .loop import BundleTrainer
from .state_file import save_state


def _arrays(trainer: BundleTrainer, data: dict) -> dict[str, np.ndarray]:
    feeds = {f["name"]: f for f in trainer.manifest["feeds"]}
    names = list(feeds)
    aliases = {"X": names[0], "y": names[-1]} if names else {}
    out = {}
    for key, arr in data.items():
        name = key if key in feeds else aliases.get(key)
        if name is None:
            raise DataError(f"the data has {key!r}, which is no feed of the step (feeds: {names})")
        out[name] = np.asarray(arr).astype(feeds[name]["dtype"], copy=False)
    missing = [n for n in names if n not in out]
    if missing:
        raise DataError(f"the data lacks the feeds {missing} of the step")
    return out


def train_bundle(model, data: dict, *, runtime: str, checkpoint: str, batch_size: int, epochs: int,
                 seed: int = 0, shuffle: bool = True, lr: float | None = None, progress: bool = True,
                 log: Callable[[str], None] = print) -> BundleTrainer:
    """Train ``model`` (a training model) on ``data`` through its bundle on ``runtime``."""
    os.makedirs(checkpoint, exist_ok=True)
    bundle = os.path.join(checkpoint, "bundle")
    export_step(model, bundle, target=runtime)  # the record of the runtime: the ops it lacks, its step fixes
    trainer = BundleTrainer(bundle, runtime)
    arrays = _arrays(trainer, data)
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
        save_state(os.path.join(checkpoint, "state.npz"), trainer.state)
        log(f"epoch {epoch + 1}/{epochs}: mean loss {np.mean(losses):.4g}")
    return trainer


__all__ = ["train_bundle"]
