"""Data-parallel training over processes with torch.distributed (gloo), as launched by torchrun.

Every process holds the whole model and runs the gradient part of the step on its slice of the global
batch (``accumulate.SplitStep``); the averaged outputs (gradients, loss, NaN check, BatchNorm statistics),
already weighted by each slice's share of the batch, are summed over the processes with
``all_reduce`` in buckets of about ``BUCKET_BYTES``; then every process applies the same update, so the
weights, the optimizer state and the step counter stay identical without ever being sent. The flat
buffers are numpy arrays that torch reads without a copy (``torch.from_numpy``), and onnxruntime writes
the gradients of a process's first micro-batch straight into them (OrtValues over the same memory), as
DDP's gradients are views of its buckets: on CPU no gradient is copied between onnxruntime and gloo.

torch is imported here only, when a ``DataParallel`` is made: ``import onnx_autodiff`` never imports it
(``pip install "onnx-autodiff[distributed]"``). A process that fails or stops makes the others fail with
``DistributedError`` at their next all-reduce: at once when its connection closes (a crash, a kill), or
after ``timeout`` seconds when it hangs.
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping
from datetime import timedelta

import numpy as np

from ..errors import DistributedError

BUCKET_BYTES = 25 << 20
_HINT = ("read the other processes' errors above; the checkpoint of the last finished epoch is kept: rerun the "
         "same torchrun command to resume")


def environment() -> tuple[int, int, int] | None:
    """``(rank, world size, local rank)`` from the variables torchrun sets, or None outside torchrun."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError as e:
        raise DistributedError(f"RANK / WORLD_SIZE / LOCAL_RANK are not integers: {e}",
                               "launch with torchrun, which sets them") from e
    return rank, world, local


def _import_torch():
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        raise DistributedError("data-parallel training needs torch (torch.distributed), which is not installed",
                               'pip install "onnx-autodiff[distributed]"', code=2) from e
    return torch, dist


class DataParallel:
    """This process's membership in a group of ``world`` training processes: ``rank``, ``local_rank``.

    Joins the group torchrun's variables describe, or adopts one torch.distributed already has (Ray Train's
    TorchTrainer makes it before the training function runs). ``timeout`` (seconds) bounds how long a
    collective of a group made here waits for the others. Use ``reduce`` as the ``reduce`` of
    ``accumulate.SplitStep``, ``check_same`` before the first step, ``close`` at the end."""

    def __init__(self, rank: int | None = None, world: int | None = None, local_rank: int | None = None,
                 timeout: float = 600.0):
        self._torch, self._dist = _import_torch()
        if not self._dist.is_available():
            raise DistributedError("this torch build has no torch.distributed",
                                   'pip install "onnx-autodiff[distributed]"')
        self._owns = not self._dist.is_initialized()
        if self._owns:
            if rank is None or world is None:
                raise DistributedError("no process group exists and no rank / world size was given",
                                       "launch with torchrun, or use DataParallel.from_environment()")
            try:
                self._dist.init_process_group("gloo", timeout=timedelta(seconds=timeout), rank=rank, world_size=world)
            except Exception as e:  # noqa: BLE001 - the rendezvous' own errors vary by cause
                raise DistributedError(f"rank {rank} of {world} could not join the process group: {_first_line(e)}",
                                       "launch every process with the same torchrun --rdzv-endpoint / "
                                       "MASTER_ADDR:MASTER_PORT and --nnodes") from e
        self.rank, self.world = self._dist.get_rank(), self._dist.get_world_size()
        self.local_rank = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", self.rank))
        self.timeout = timeout
        self.step_count = 0

    @classmethod
    def from_environment(cls, timeout: float = 600.0) -> DataParallel | None:
        """The process group torch.distributed already has, else the one torchrun's variables describe;
        None when there is neither or it has one process."""
        import sys

        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            return cls(timeout=timeout) if dist.get_world_size() > 1 else None
        env = environment()
        if env is None or env[1] < 2:
            return None
        return cls(*env, timeout=timeout)

    def providers(self, device: str = "cpu") -> list:
        """onnxruntime providers for this process: CUDA on the GPU numbered by the local rank, or CPU."""
        if device == "cuda":
            return [("CUDAExecutionProvider", {"device_id": self.local_rank}), "CPUExecutionProvider"]
        return ["CPUExecutionProvider"]

    def reduce(self, buffers: list[np.ndarray]) -> None:
        """Sum every buffer over the processes, in place, in buckets of at most ``BUCKET_BYTES``."""
        self.step_count += 1
        works = []
        started = time.monotonic()
        try:
            for buf in buffers:
                flat = self._torch.from_numpy(buf.reshape(-1))  # the same memory: no copy
                size = max(1, BUCKET_BYTES // buf.itemsize)
                for start in range(0, flat.numel(), size):
                    works.append(self._dist.all_reduce(flat[start:start + size], async_op=True))
            for w in works:
                w.wait()
        except Exception as e:  # noqa: BLE001 - gloo reports a dead peer or a timeout as RuntimeError
            waited = time.monotonic() - started
            # gloo words a timeout several ways ("Timed out waiting", "Application timeout caused pair
            # closure"); the time we waited says which it was
            what = (f"another process did not answer within {self.timeout:g} s" if waited >= 0.9 * self.timeout
                    else f"another process stopped ({waited:.1f} s into the wait)")
            raise DistributedError(f"rank {self.rank} of {self.world}: a gradient all-reduce failed (number "
                                   f"{self.step_count} of this run): {what} ({_first_line(e)})", _HINT) from e

    def check_same(self, facts: Mapping[str, object]) -> None:
        """Refuse to start unless every process has the same ``facts`` (model and data fingerprints, the
        checkpoint's step count, batch size, seed, ...): a rank that resumed from another checkpoint or read
        other data would train a different model without a word."""
        gathered: list = [None] * self.world
        try:
            self._dist.all_gather_object(gathered, dict(facts))
        except Exception as e:  # noqa: BLE001
            raise DistributedError(f"rank {self.rank} of {self.world}: the other processes did not start within "
                                   f"{self.timeout:g} s or stopped ({_first_line(e)})", _HINT) from e
        for r, other in enumerate(gathered):
            for key, value in facts.items():
                if other.get(key) != value:
                    raise DistributedError(
                        f"rank {r} has {key} = {other.get(key)!r} but rank {self.rank} has {value!r}; every process "
                        "must start from the same model, data, checkpoint and options",
                        "give every machine the same files (a shared --checkpoint directory to resume) and flags")

    def close(self) -> None:
        """Leave the group if it was made here (an adopted group is its maker's to close)."""
        if self._owns and self._dist.is_initialized():
            self._dist.destroy_process_group()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


__all__ = ["BUCKET_BYTES", "DataParallel", "environment"]
