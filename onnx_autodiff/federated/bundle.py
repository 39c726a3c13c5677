"""A step bundle folder (``export-step``: step.onnx, init.onnx, bundle.json) as a federation's model.

The tensors shared are the state ``init.onnx`` copies from stored tensors (the trainable tensors and running
statistics); the state its initialization graph computes (optimizer moments and counters, as
``make_training_model`` makes them) stays on the client. Every client trains the bundle with ``BundleTrainer``
on its runtime, as ``train --runtime`` does, with the step's own record (learning rate, its input). A bundle has
no inference model: evaluation is the step's loss at learning rate 0 (in training mode: dropout and batch
statistics as in training), and the server's ``out/`` is itself a bundle whose ``init.onnx`` holds the global
tensors, replaced atomically after every round (``BundleTrainer(out)`` trains on from it).
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from ..driver.bundle import MANIFEST, read_manifest
from ..errors import FederatedError
from ..model import metadata
from ..model.io import save_model_atomic


def is_bundle(model) -> bool:
    return not isinstance(model, onnx.ModelProto) and os.path.isdir(os.fspath(model))


def stored_state(init: onnx.ModelProto, state: Mapping[str, str]) -> dict[str, str]:
    """``{state name: init.onnx initializer}`` for the state ``init.onnx`` copies from a stored tensor."""
    inits = {t.name for t in init.graph.initializer}
    made = {o: n for n in init.graph.node for o in n.output}
    out = {}
    for name in state:
        node = made.get(name)
        if node is not None and node.op_type == "Identity" and node.input[0] in inits:
            out[name] = node.input[0]
    return out


class BundleInfo:
    """What a federation reads from a bundle folder: its manifest, step record, shared and private state."""

    def __init__(self, folder: str):
        self.dir = folder
        self.manifest = read_manifest(folder)
        self.step_path = os.path.join(folder, self.manifest["step"])
        self.init_path = os.path.join(folder, self.manifest["init"])
        step = onnx.load(self.step_path, load_external_data=False)
        init = onnx.load(self.init_path, load_external_data=False)
        self.record = metadata.read_json(step, metadata.BUILDER) or {}
        self.lora = metadata.read_json(step, metadata.LORA)
        self.sources = stored_state(init, self.manifest["state"])
        self.names = list(self.sources)
        trainable = self.record.get("trainable")
        self.params = [n for n in trainable if n in self.sources] if trainable else list(self.names)
        self.private = [k for k in self.manifest["state"] if k not in self.sources]

    def initial_arrays(self, path: str | None = None) -> dict[str, np.ndarray]:
        """The shared tensors ``init.onnx`` (or ``path``, a global model's) gives, run in onnxruntime."""
        from ..runtimes.loop import load_runner
        out = load_runner("onnxruntime")(path or self.init_path)({})
        return {n: np.asarray(out[n]) for n in self.names}

    def trainer(self, runtime: str):
        from ..runtimes.loop import BundleTrainer
        return BundleTrainer(self.dir, runtime, model=self.step_path)  # the step's record: lr, its input


def bundle_loss(trainer, tensors: Mapping[str, np.ndarray], arrays: Mapping[str, np.ndarray]) -> dict[str, float]:
    """``loss``: the step's loss on all of ``arrays`` at learning rate 0, with ``tensors`` as the shared state
    (the trainer's state is put back after)."""
    kept, steps = dict(trainer.state), trainer.steps
    try:
        for name, value in tensors.items():
            trainer.state[name] = np.asarray(value).astype(trainer.state[name].dtype, copy=False).reshape(
                trainer.state[name].shape)
        hyper = {k: 0.0 for k in trainer.hyper if "learning_rate" in k}
        loss = trainer.step({k: arrays[k] for k in trainer.feed_names}, hyper)
    finally:
        trainer.state, trainer.steps = kept, steps
    return {"loss": loss}


class BundleGlobal:
    """The server's global tensors for a bundle: ``out/`` a copy of the bundle whose ``init.onnx`` gives them
    (its metadata: the rounds done and the shared names)."""

    def __init__(self, info: BundleInfo, out: str | None, log, round_key: str, shared_key: str):
        self.info, self.out, self.done, self.keys = info, out, 0, (round_key, shared_key)
        path = os.path.join(out, info.manifest["init"]) if out else None
        if path and os.path.exists(os.path.join(out, MANIFEST)):
            meta = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}
            if json.loads(meta.get(shared_key, "[]")) != info.names:
                raise FederatedError(f"{out} holds a bundle of another model (other shared tensors)",
                                     hint="give another out= folder")
            self.done = int(meta.get(round_key, 0))
            log(f"resuming from {path}: {self.done} round(s) done")
            self.tensors = info.initial_arrays(path)
        else:
            self.tensors = info.initial_arrays()
            if out:
                shutil.copytree(info.dir, out, dirs_exist_ok=True)

    def arrays(self) -> dict[str, np.ndarray]:
        return dict(self.tensors)

    def update(self, rnd: int, tensors: Mapping[str, np.ndarray]) -> None:
        self.tensors = {n: np.asarray(tensors[n]) for n in self.info.names}
        if self.out:
            init = onnx.load(self.info.init_path)
            for t in init.graph.initializer:
                for name, source in self.info.sources.items():
                    if t.name == source:
                        t.CopyFrom(numpy_helper.from_array(self.tensors[name].astype(
                            onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).reshape(tuple(t.dims)), source))
            metadata.write(init, {self.keys[0]: str(rnd), self.keys[1]: json.dumps(self.info.names)})
            save_model_atomic(init, os.path.join(self.out, self.info.manifest["init"]))
        self.done = rnd

    def finish(self) -> list[str]:
        return [os.path.join(self.out, MANIFEST)] if self.out else []


__all__ = ["BundleInfo", "BundleGlobal", "bundle_loss", "is_bundle", "stored_state"]
