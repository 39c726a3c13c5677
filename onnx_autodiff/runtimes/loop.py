"""The bundle loop every driver follows (docs/runtimes.md)::

    state = run(init)
    for batch in batches:
        out = run(step, batch | state | hyper)
        state = {i: out[o] for i, o in manifest["state"].items()}

``BundleTrainer`` is that loop with the checks that keep a runtime from being silently wrong: a feed the
step does not take, a state tensor missing from init's outputs, and a step with a nonzero learning rate
that hands back exactly the state it was fed (a runtime that folded the state inputs into constants, or
ignores what it is fed) each raise ``BundleError``. Given the training model the bundle was made from
(``model=``), it is a ``driver.fit.Trainer``: ``fit`` runs its epochs, data checks, checkpoints and resume as it
does a ``TrainingSession``'s, and its checkpoints are the same ``checkpoint.onnx`` (the training model with the
state as initializers), so either resumes the other's; and, as ``TrainingSession`` does, it makes what a decoder's
driver makes (``driver/kv_cache.py``: the KV cache empty, ``position_ids`` from the mask, a merged decoder's
``use_cache_branch`` False) unless the batch gives it. ``check_feeds`` is the check every runner makes of the feeds
it is handed.
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sized
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..driver.bundle import read_manifest
from ..driver.checkpoint import TrainState
from ..driver.kv_cache import MadeInputs, made_inputs
from ..driver.step_model import host_scalar_value
from ..errors import BundleError, CheckpointError, GradcheckError, TrainingDivergedError
from ..model import metadata as md
from ..model.carrier import open_model
from ..model.io import reference_base, save_model_atomic
from ..model.weights import detach_tensor, is_detached, top_graphs
from .targets import FLOAT64_RUNTIMES, RUNNERS, RUNTIMES, Target

Run = Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]


def load_runner(runtime: str | Target) -> Callable[[str], Run]:
    """``load(path) -> run`` of one runtime (its record in ``runtimes/targets.py`` names the runner module and
    the extra that installs it); a clear error when the runtime is not installed."""
    target = runtime if isinstance(runtime, Target) else RUNTIMES.get(runtime)
    if target is None or target.runner is None:
        raise BundleError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNNERS)}", hint="")
    try:
        module = importlib.import_module(f".{target.runner}", __package__)
        return module.load
    except ImportError as e:
        raise BundleError(f"the {target.name} runtime is not installed ({e})",
                          hint=f"pip install 'onnx-autodiff[{target.extra}]'" if target.extra else "") from None


def load_float64(runtime: str) -> Callable:
    """``load_float64(model, providers) -> .run(names, feeds)`` of a runtime whose record has ``float64`` (gradcheck
    runs its whole check there, in float64 and in memory)."""
    target = RUNTIMES.get(runtime)
    if target is None or not target.float64:
        raise GradcheckError(f"runtime must be one of {', '.join(FLOAT64_RUNTIMES)} for a float64 check, "
                             f"not {runtime!r}")
    return importlib.import_module(f".{target.runner}", __package__).load_float64


def runtime_version(runtime: str | Target) -> str:
    """The version of the installed runtime (its runner module's ``version()``)."""
    load = load_runner(runtime)
    version = getattr(importlib.import_module(load.__module__), "version", None)
    return version() if version is not None else "(version unknown)"


def check_feeds(path: str, runtime: str, takes: Sized, feeds: Mapping) -> None:
    """``BundleError`` for feeds the model at ``path`` has no input for: a runtime may drop them without a word
    (onnxruntime-node does), and a misspelt name would leave an input at its default."""
    unknown = sorted(set(feeds) - set(takes))
    if unknown:
        raise BundleError(f"{path!r} takes no inputs {unknown[:5]} ({runtime}; its inputs: {sorted(takes)[:5]})")


class BundleTrainer:
    """Trains a bundle directory on ``runtime`` (or with a ``load(path) -> run`` of your own). ``model``: the
    training model the bundle was made from (a path, ``ModelProto`` or ``LightModel``), for ``fit`` and
    checkpoints (``save``, ``load_checkpoint_state``); ``index``: its ``training_info`` the bundle steps."""

    def __init__(self, bundle_dir, runtime: str | Callable[[str], Run] = "onnxruntime", *, model=None,
                 index: int = 0):
        self.dir = Path(bundle_dir)
        self.manifest = read_manifest(self.dir)
        load = load_runner(runtime) if isinstance(runtime, str) else runtime
        self.runtime = runtime if isinstance(runtime, str) else getattr(runtime, "__name__", "custom")
        self._step = load(str(self.dir / self.manifest["step"]))
        self._init = load(str(self.dir / self.manifest["init"]))
        self.state_map: dict[str, str] = dict(self.manifest["state"])
        self.hyper: dict = dict(self.manifest["hyper"])
        self.host_scalars: dict = dict(self.manifest.get("host_scalars", {}))
        self.feeds = [f["name"] for f in self.manifest["feeds"]]
        self.loss_name: str = self.manifest["loss"]
        self.steps = 0
        self.step_model = onnx.load(str(self.dir / self.manifest["step"]), load_external_data=False)
        self._input_dtypes = {i.name: helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
                              for i in self.step_model.graph.input}
        self._static = {i.name: tuple(d.dim_value for d in i.type.tensor_type.shape.dim)
                        for i in self.step_model.graph.input if i.type.tensor_type.HasField("shape")
                        and all(d.HasField("dim_value") for d in i.type.tensor_type.shape.dim)}
        self._light = open_model(model, what="training model") if model is not None else None
        self.model = self._light.proto if self._light is not None else None
        self.index = index
        self.base_path = self._light.source if self._light is not None else None
        # the KV cache, positions and cache switches the loop makes unless the batch gives them: from the training
        # model, else from bundle.json's "made" (a bundle written before it had one makes nothing)
        self._made = (made_inputs(self.model, self.feeds) if self.model is not None
                      else MadeInputs.from_spec(self.manifest.get("made", {})))
        self.train_state = None  # fit's TrainState of the checkpoint last loaded or saved
        self.reset()

    def _declared(self, name: str, value) -> np.ndarray:
        """A state value in the shape the step declares for it: a runtime may hand a rank-0 output back as [1]
        (onnxruntime-node does), which a checkpoint of the model could not hold."""
        arr = np.asarray(value)
        shape = self._static.get(name)
        return arr.reshape(shape) if shape is not None and arr.shape != shape and arr.size == int(
            np.prod(shape)) else arr

    @property
    def feed_names(self) -> list[str]:
        """The batch inputs of the step (``fit.Trainer``), less the KV cache and positions the loop makes."""
        return [f for f in self.feeds if f not in self._made.names]

    def reset(self) -> None:
        """The state as ``init.onnx`` gives it."""
        out = self._init({})
        missing = [k for k in self.state_map if k not in out]
        if missing:
            raise BundleError(f"init.onnx gave no value for the state inputs {missing[:5]} ({self.runtime})")
        self.state = {k: self._declared(k, out[k]) for k in self.state_map}

    def _feeds(self, batch: Mapping, hyper: Mapping | None) -> dict:
        unknown = [k for k in list(batch) + list(hyper or {}) if k not in self.feeds and k not in self.hyper]
        if unknown:
            raise BundleError(f"{unknown} are not inputs of {self.manifest['step']}: its feeds are {self.feeds}, its "
                              f"hyper-parameters {list(self.hyper)}; the state is carried by the loop")
        batch = self._made.fill(dict(batch))
        missing = [k for k in self.feeds if k not in batch]
        if missing:
            raise BundleError(f"the batch lacks the feeds {missing} of {self.manifest['step']}")
        feeds = {**self.hyper, **(hyper or {})}
        feeds = {k: np.asarray(v, dtype=self._input_dtypes.get(k, np.float32)) for k, v in feeds.items()}
        feeds.update({k: np.asarray(v) for k, v in batch.items()})
        feeds.update(self.state)
        feeds.update({k: host_scalar_value(spec, int(np.asarray(self.state[spec["counter"]]).reshape(-1)[0]))
                      for k, spec in self.host_scalars.items()})
        return feeds

    def step(self, batch: Mapping, hyper: Mapping | None = None) -> float:
        """One step on ``batch`` (the feeds by name); ``hyper`` overrides hyper-parameters (a learning
        rate from a schedule). Returns the loss. Raises ``TrainingDivergedError`` on a NaN or Inf loss (the
        state stays the last good one, as a ``TrainingSession``'s does), and ``BundleError`` when the runtime
        handed back the state it was fed although the learning rate is not zero."""
        feeds = self._feeds(batch, hyper)
        out = self._run_step(feeds)
        loss = float(np.asarray(out[self.loss_name]).reshape(-1)[0])
        if not np.isfinite(loss):
            raise TrainingDivergedError(self.loss_name, self.steps + 1)
        new = {i: self._declared(i, out[o]) for i, o in self.state_map.items()}
        if self._changes_expected(feeds) and all(np.array_equal(new[k], self.state[k]) for k in new):
            raise BundleError(f"step {self.steps + 1} on {self.runtime}: every state tensor came back equal to what "
                              "was fed, with a nonzero learning rate: the runtime ignores the fed state (folded "
                              "the state inputs into constants?)", hint="see docs/runtimes.md, 'quirks'")
        self.state = new
        self.steps += 1
        return loss

    # ---- checkpoints: the same file as TrainingSession's (fit.Trainer) ------------------------------------
    def save(self, path, *, metadata: dict[str, str] | None = None) -> None:
        """Write the training model with the current state as its initializers (and the step count and
        ``metadata`` in its ``metadata_props``) to ``path`` atomically: a checkpoint ``TrainingSession`` and
        ``export`` read as they read their own."""
        if self._light is None:
            raise BundleError("save needs the training model the bundle was made from: BundleTrainer(..., model=)")
        m = onnx.ModelProto()
        m.CopyFrom(self._light.proto)  # light: graphs and small tensors
        mapped = {t.name for t in m.graph.initializer if t.name not in self.state and is_detached(t)
                  and isinstance(self._light.arrays.get(t.name), np.memmap)}  # the file's own bytes, as a session's
        for g in top_graphs(m):
            for t in g.initializer:
                if t.name in self.state:
                    detach_tensor(t)
        md.write(m, {md.STEPS: str(self.steps), **(metadata or {})})
        base = self.base_path
        if md.read(m).get(md.FROZEN) == "reference" and base is not None and os.path.abspath(
                path) != os.path.abspath(base):  # LoRA: the adapters, the frozen base referenced in its file
            reference_base(m, base, mapped, os.fspath(path))
        save_model_atomic(m, os.fspath(path), weights={**self._light.arrays, **self.state})

    def load_checkpoint_state(self, model: onnx.ModelProto, weights: Mapping | None = None) -> None:
        """Take every state tensor and the step count from a checkpoint of this model, whichever runtime wrote
        it (``save``, or ``TrainingSession.save``: the same state names)."""
        stored = {t.name: t for g in top_graphs(model) for t in g.initializer if t.name in self.state}
        missing = [n for n in self.state if n not in stored]
        if missing:
            raise CheckpointError(f"the checkpoint has no value for the state tensor(s) {missing[:5]} of "
                                  f"{self.manifest['step']}: it is not a checkpoint of this model",
                                  "resume with the training model the checkpoint was started from")
        new = {}
        for name, have in self.state.items():
            t = stored[name]
            value = np.asarray(weights[name] if is_detached(t) or (weights and name in weights)
                               else numpy_helper.to_array(t))
            if value.shape != have.shape or value.dtype != have.dtype:
                raise CheckpointError(f"the checkpoint holds {name!r} as {value.dtype}{list(value.shape)}, the "
                                      f"step takes {have.dtype}{list(have.shape)}: not a checkpoint of this model",
                                      "resume with the training model the checkpoint was started from")
            new[name] = np.array(value)  # our own copy, not a view of a mapped file
        meta = {p.key: p.value for p in model.metadata_props}
        self.state, self.steps = new, int(meta.get(md.STEPS, 0))
        self.train_state = TrainState.from_metadata(meta)

    def _run_step(self, feeds: dict) -> dict:
        out = self._step(feeds)
        missing = [o for o in list(self.state_map.values()) + [self.loss_name] if o not in out]
        if missing:
            raise BundleError(f"{self.runtime} returned no {missing[:5]} from {self.manifest['step']}")
        return out

    def _changes_expected(self, feeds: dict) -> bool:
        lrs = [v for k, v in feeds.items() if k in self.hyper and "learning_rate" in k]
        return not lrs or any(np.any(np.asarray(v) != 0) for v in lrs)


__all__ = ["BundleTrainer", "check_feeds", "load_float64", "load_runner", "runtime_version", "Run"]
