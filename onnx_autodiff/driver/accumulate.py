"""One step over a global batch as several gradient runs: micro-batches in this process (``--accumulate K``)
and, through a ``reduce`` function, slices in other processes (``distributed.py``). No torch here.

A global batch of ``b`` rows is cut into ``P = world * K`` contiguous parts; process ``r`` runs parts
``r*K .. r*K+K-1``, one ``TrainingSession.gradients`` each. The averaged outputs (gradients, loss, NaN check,
BatchNorm statistics; ``TrainingSession.averaged_outputs``) of part ``i`` are added with the weight
``n_i / b`` into one flat buffer per dtype (onnxruntime writes the first part's there, scaled in place
after: with one micro-batch per process the gradients are never copied); ``reduce`` sums these buffers
over the processes in place; then ``apply_gradients`` runs the update once. For a loss that is a mean
over the batch this is the gradient of the global batch: parts of equal size get ``1 / P`` each, and a
shorter last batch is cut into parts whose sizes differ by one row at most, weighted by their size. The
other outputs of the gradient part must agree between parts (constants such as a gradient seed); one
that differs is refused rather than guessed at.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np
import onnxruntime as ort

from ..errors import DataError, TrainingSpecError


def part_bounds(batch: int, world: int, accumulate: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of the ``world * accumulate`` contiguous parts of a batch of ``batch`` rows, sizes
    differing by one at most (equal when ``batch`` divides). Refuses a batch with fewer rows than parts."""
    parts = world * accumulate
    if batch < parts:
        raise DataError(f"a batch of {batch} sample(s) cannot be cut into {parts} parts ({world} process(es) x "
                        f"{accumulate} micro-batch(es)): every part needs a sample",
                        "use fewer processes or a smaller --accumulate, or a batch size that leaves a last batch "
                        "of at least that many samples")
    cuts = [k * batch // parts for k in range(parts + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


class HalfSteps(Protocol):
    """What ``SplitStep`` runs: a step in two public halves (``TrainingSession`` meets it)."""

    steps: int
    loss_name: str | None
    feed_names: list[str]

    @property
    def averaged_outputs(self) -> list[str]: ...

    @property
    def update_inputs(self) -> list[str]: ...

    def gradients(self, feeds: dict, into: Mapping[str, ort.OrtValue] | None = None) -> dict[str, ort.OrtValue]: ...

    def apply_gradients(self, values: Mapping, feeds: dict) -> dict[str, np.ndarray]: ...

    def save(self, path, *args, **kwargs) -> None: ...


class SplitStep:
    """``step(feeds)`` on a global batch, run as this process's ``accumulate`` micro-batches.

    ``session``: what runs the two halves of a step (``HalfSteps``: a ``TrainingSession``; only its public
    ``gradients``, ``apply_gradients``, ``averaged_outputs`` and ``update_inputs`` are used). ``batched``: the
    feeds cut along their first axis (the data); the others (the learning rate) go to every part.
    ``reduce(buffers)`` sums a list of flat arrays in place over the processes (None: one process). Has
    ``steps``, ``loss_name``, ``feed_names`` and ``save`` of the session, so a training loop can use either
    (other names still reach the session, with a DeprecationWarning: use ``.session``)."""

    def __init__(self, session: HalfSteps, batched: list[str], accumulate: int = 1, rank: int = 0, world: int = 1,
                 reduce: Callable[[list[np.ndarray]], None] | None = None):
        if accumulate < 1 or world < 1 or not 0 <= rank < world:
            raise ValueError(f"accumulate {accumulate}, rank {rank} of {world}: "
                             "need accumulate >= 1 and 0 <= rank < world")
        self.session, self.batched = session, list(batched)
        self.accumulate, self.rank, self.world, self.reduce = accumulate, rank, world, reduce
        self.averaged = session.averaged_outputs
        self._buffers: dict[np.dtype, np.ndarray] = {}
        self._views: dict[str, np.ndarray] = {}
        self._into: dict[str, ort.OrtValue] = {}
        self._read_by_update = set(session.update_inputs)

    def __getattr__(self, name):
        if name.startswith("__") or name == "session":
            raise AttributeError(name)
        warnings.warn(f"SplitStep.{name} forwards to the session and will stop doing so; use "
                      f"SplitStep.session.{name}", DeprecationWarning, stacklevel=2)
        return getattr(self.session, name)

    @property
    def steps(self) -> int:
        return self.session.steps

    @property
    def loss_name(self) -> str | None:
        return self.session.loss_name

    @property
    def feed_names(self) -> list[str]:
        return self.session.feed_names

    def save(self, *args, **kwargs) -> None:
        self.session.save(*args, **kwargs)

    def _layout(self, values) -> None:
        """One flat buffer per dtype with a view per averaged output, laid out from the first run."""
        sizes: dict[np.dtype, int] = {}
        spans = {}
        for name in self.averaged:
            arr = values[name].numpy()
            dt = arr.dtype
            spans[name] = (dt, sizes.get(dt, 0), arr.shape)
            sizes[dt] = sizes.get(dt, 0) + arr.size
        self._buffers = {dt: np.zeros(n, dt) for dt, n in sizes.items()}
        self._views = {name: self._buffers[dt][start:start + int(np.prod(shape, dtype=np.int64))].reshape(shape)
                       for name, (dt, start, shape) in spans.items()}
        self._into = {name: ort.OrtValue.ortvalue_from_numpy(view) for name, view in self._views.items()}

    def step(self, feeds: dict) -> dict[str, np.ndarray]:
        sizes = {len(feeds[n]) for n in self.batched}
        if len(sizes) != 1:
            raise DataError(f"the batched feeds {self.batched} have different lengths {sorted(sizes)}",
                            "give every data array the same number of samples")
        bounds = part_bounds(sizes.pop(), self.world, self.accumulate)
        total = bounds[-1][1]
        mine = bounds[self.rank * self.accumulate:(self.rank + 1) * self.accumulate]
        others: dict = {}
        for k, (start, stop) in enumerate(mine):
            part = {n: (v[start:stop] if n in self.batched else v) for n, v in feeds.items()}
            direct = k == 0 and bool(self._views)  # the first part writes straight into the buffers
            values = self.session.gradients(part, into=self._into if direct else None)
            if not self._views:
                self._layout(values)
            weight = (stop - start) / total
            for name in self.averaged:
                view, w = self._views[name], self._views[name].dtype.type(weight)
                if direct:
                    view *= w
                elif k == 0:
                    np.multiply(values[name].numpy(), w, out=view)
                else:
                    view += w * values[name].numpy()
            for name, v in values.items():
                if name in self.averaged:
                    continue
                if k and name in self._read_by_update and not np.array_equal(v.numpy(), others[name].numpy()):
                    raise TrainingSpecError(
                        f"the update reads {name!r} from the gradient part, and it differs between micro-batches; "
                        "only gradients, the loss and state updates can be combined over micro-batches or processes")
                others[name] = v
        if self.reduce is not None:
            self.reduce(list(self._buffers.values()))
        return self.session.apply_gradients({**others, **self._views}, feeds)


__all__ = ["SplitStep", "HalfSteps", "part_bounds"]
