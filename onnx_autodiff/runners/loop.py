"""The bundle loop every driver follows (docs/runtimes.md)::

    state = run(init)
    for batch in batches:
        out = run(step, batch | state | hyper)
        state = {i: out[o] for i, o in manifest["state"].items()}

``BundleTrainer`` is that loop with the checks that keep a runtime from being silently wrong: a feed the
step does not take, a state tensor missing from init's outputs, and a step with a nonzero learning rate
that hands back exactly the state it was fed (a runtime that folded the state inputs into constants, or
ignores what it is fed) each raise ``BundleError``.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from ..driver.bundle import read_manifest
from ..driver.step_model import host_scalar_value
from ..errors import BundleError
from ..passes.targets import RUNNERS, RUNTIMES, Target

Run = Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]


def load_runner(runtime: str | Target) -> Callable[[str], Run]:
    """``load(path) -> run`` of one runtime (its record in ``passes/targets.py`` names the runner module and
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


def runtime_version(runtime: str | Target) -> str:
    """The version of the installed runtime (its runner module's ``version()``)."""
    load = load_runner(runtime)
    version = getattr(importlib.import_module(load.__module__), "version", None)
    return version() if version is not None else "(version unknown)"


class BundleTrainer:
    """Trains a bundle directory on ``runtime`` (or with a ``load(path) -> run`` of your own)."""

    def __init__(self, bundle_dir, runtime: str | Callable[[str], Run] = "onnxruntime"):
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
        step_graph = onnx.load(str(self.dir / self.manifest["step"]), load_external_data=False).graph
        self._input_dtypes = {i.name: helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
                              for i in step_graph.input}
        self.reset()

    def reset(self) -> None:
        """The state as ``init.onnx`` gives it."""
        out = self._init({})
        missing = [k for k in self.state_map if k not in out]
        if missing:
            raise BundleError(f"init.onnx gave no value for the state inputs {missing[:5]} ({self.runtime})")
        self.state = {k: np.asarray(out[k]) for k in self.state_map}

    def _feeds(self, batch: Mapping, hyper: Mapping | None) -> dict:
        unknown = [k for k in list(batch) + list(hyper or {}) if k not in self.feeds and k not in self.hyper]
        if unknown:
            raise BundleError(f"{unknown} are not inputs of {self.manifest['step']}: its feeds are {self.feeds}, its "
                              f"hyper-parameters {list(self.hyper)}; the state is carried by the loop")
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
        rate from a schedule). Returns the loss. Raises ``BundleError`` when the runtime handed back
        the state it was fed although the learning rate is not zero."""
        feeds = self._feeds(batch, hyper)
        out = self._run_step(feeds)
        new = {i: np.asarray(out[o]) for i, o in self.state_map.items()}
        if self._changes_expected(feeds) and all(np.array_equal(new[k], self.state[k]) for k in new):
            raise BundleError(f"step {self.steps + 1} on {self.runtime}: every state tensor came back equal to what "
                              "was fed, with a nonzero learning rate: the runtime ignores the fed state (folded "
                              "the state inputs into constants?)", hint="see docs/runtimes.md, 'quirks'")
        self.state = new
        self.steps += 1
        return float(np.asarray(out[self.loss_name]).reshape(-1)[0])

    def _run_step(self, feeds: dict) -> dict:
        out = self._step(feeds)
        missing = [o for o in list(self.state_map.values()) + [self.loss_name] if o not in out]
        if missing:
            raise BundleError(f"{self.runtime} returned no {missing[:5]} from {self.manifest['step']}")
        return out

    def _changes_expected(self, feeds: dict) -> bool:
        lrs = [v for k, v in feeds.items() if k in self.hyper and "learning_rate" in k]
        return not lrs or any(np.any(np.asarray(v) != 0) for v in lrs)


__all__ = ["BundleTrainer", "load_runner", "runtime_version", "Run"]
