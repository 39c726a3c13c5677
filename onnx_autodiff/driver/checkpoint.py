"""The checkpoint directory of ``TrainingSession.fit`` and the ``train`` command.

One file, ``checkpoint.onnx``, is the whole checkpoint: the weights and optimizer state as initializers and
the training state (epochs done, steps, per-epoch losses, lr, seed, data order, fingerprints of the model and
the data) as one JSON entry of its ``metadata_props``. ``TrainingSession.save`` replaces the file atomically,
so after a kill at any moment the directory holds either the previous checkpoint or the new one, never a mix.

While a trainer runs it holds an exclusive ``flock`` on the directory itself (no lock file to leave behind),
so a second trainer on the same directory stops with a clear error. Whoever takes the lock removes the
temporary files a killed save left (``.checkpoint.onnx.*``): nobody else can be writing them. SIGTERM and
SIGINT become an ``Interrupted`` exception, deferred while a save is under way, so a save is never cut short
by them and its temporary files are removed on the way out.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import signal
from dataclasses import asdict, dataclass, field

import onnx

from ..errors import CheckpointError
from ..model.io import external_data_files
from ..model.metadata import TRAIN_STATE

CHECKPOINT = "checkpoint.onnx"
_STATE_VERSION = 1


def model_file_fingerprint(path: str) -> str:
    """sha256 of a model file and of the external-data files it names: which training model a checkpoint
    started from (file bytes, so it does not depend on how a loader represents the weights)."""
    h = hashlib.sha256(file_fingerprint(path).encode())
    base = os.path.dirname(os.path.abspath(path))
    for location in external_data_files(onnx.load(path, load_external_data=False)):
        h.update(location.encode() + file_fingerprint(os.path.join(base, location)).encode())
    return h.hexdigest()


def file_fingerprint(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class TrainState:
    """What ``train`` needs to continue exactly where it stopped (stored in the checkpoint's metadata)."""

    model_sha256: str
    data_sha256: str
    batch_size: int
    seed: int
    shuffle: bool
    lr: float | None
    model: str = ""
    data: str = ""
    epochs_done: int = 0
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    version: int = _STATE_VERSION

    def to_metadata(self) -> dict[str, str]:
        return {TRAIN_STATE: json.dumps(asdict(self), sort_keys=True)}

    @classmethod
    def from_metadata(cls, metadata: dict[str, str]) -> TrainState | None:
        text = metadata.get(TRAIN_STATE)
        if text is None:
            return None
        raw = json.loads(text)
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        return cls(**known)

    def mismatch(self, other: TrainState) -> tuple[str, str] | None:
        """(what differs, the option that sets it) between this checkpoint's run and a new command line."""
        for key, option in (("batch_size", "--batch-size"), ("seed", "--seed"), ("shuffle", "--no-shuffle")):
            if getattr(self, key) != getattr(other, key):
                return f"{option} {'off' if key == 'shuffle' and getattr(self, key) else getattr(self, key)}", option
        return None


def check_resume(ckdir: CheckpointDir, saved: TrainState, fresh: TrainState, model_name: str,
                 data_name: str) -> None:
    """Refuse to resume another model's checkpoint, or one trained on other data or in another order.
    ``model_name`` / ``data_name``: how the messages call this run's model and data."""
    start_fresh = f"or start fresh with another --checkpoint directory (or delete {ckdir.path!r})"
    if saved.model_sha256 != fresh.model_sha256:
        raise CheckpointError(f"{ckdir.path!r} holds a checkpoint of another training model "
                              f"({saved.model or 'unknown'}), not of {model_name}",
                              f"pass the model it was started from to resume, {start_fresh}")
    if saved.data_sha256 != fresh.data_sha256:
        raise CheckpointError(f"{ckdir.path!r} was trained on other data ({saved.data or 'unknown'}), "
                              f"not on {data_name}; resuming would not continue that run",
                              f"pass the same --data to resume, {start_fresh}")
    diff = saved.mismatch(fresh)
    if diff:
        raise CheckpointError(f"{ckdir.path!r} was trained with {diff[0]}; a resumed run must use the same data order",
                              f"pass the same {diff[1]} to resume, {start_fresh}")


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived; raised where it cannot cut a save short."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _raise(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_as_exceptions():
    """SIGTERM and SIGINT raise ``Interrupted`` inside the block (so ``finally`` clauses run)."""
    old = {s: signal.signal(s, _raise) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def signals_deferred():
    """SIGTERM and SIGINT wait until the block is done, then raise ``Interrupted``."""
    pending: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if pending:
        raise Interrupted(pending[0])


class CheckpointDir:
    """``DIR/checkpoint.onnx`` plus the lock on ``DIR``; use as a context manager around a training run.
    ``writer=False`` (the ranks of a data-parallel run other than 0) only reads: no lock, no saves."""

    def __init__(self, path: str, writer: bool = True):
        self.path = path
        self.writer = writer
        self.model_path = os.path.join(path, CHECKPOINT)
        self._fd: int | None = None
        self.removed: list[str] = []
        self.state: TrainState | None = None  # the training state ``load`` read last

    def exists(self) -> bool:
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise CheckpointError(f"--checkpoint {self.path!r} is a file, not a directory",
                                  "pass a directory (it is created if missing)")
        return os.path.isdir(self.path)

    def has_checkpoint(self) -> bool:
        return os.path.exists(self.model_path)

    @property
    def locked(self) -> bool:
        return self._fd is not None or not self.writer

    def lock(self, create: bool = False) -> None:
        """Take the directory's lock (creating it first if ``create``), then remove stale temporary files."""
        if not self.writer:
            return
        if create:
            try:
                os.makedirs(self.path, exist_ok=True)
            except OSError as e:
                raise CheckpointError(f"cannot create the checkpoint directory {self.path!r}: {e.strerror}",
                                      "pass a --checkpoint directory you can write") from e
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointError(
                f"another onnx-autodiff train is running on the checkpoint directory {self.path!r}",
                "wait for it to finish, or pass another --checkpoint directory") from None
        self._fd = fd
        self.removed = self._remove_stale()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> CheckpointDir:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _remove_stale(self) -> list[str]:
        """Temporary files of a save that was killed (-9): ours to remove, since we hold the lock."""
        removed = []
        prefix = f".{CHECKPOINT}."
        for entry in os.scandir(self.path):
            if not entry.name.startswith(prefix):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
            removed.append(entry.name)
        return removed

    def load(self, base=None):
        """The checkpoint (a ``LightModel``: its weights memory-mapped) and its training state. ``base``: the
        model file its referenced frozen weights are in (a LoRA run's training model, outside the directory)."""
        from ..model.carrier import open_model

        try:
            light = open_model(self.model_path, what="checkpoint", base=base)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read the checkpoint {self.model_path!r}: {e}",
                                  "start fresh with another --checkpoint directory") from e
        meta = {p.key: p.value for p in light.proto.metadata_props}
        state = TrainState.from_metadata(meta)
        if state is None:
            raise CheckpointError(
                f"{self.model_path!r} was not written by onnx-autodiff train (its metadata has no training state)",
                "start fresh with another --checkpoint directory, or move that file away")
        self.state = state
        return light, state

    def saved_state(self) -> TrainState:
        """The checkpoint's training state (read again only if ``load`` has not read it)."""
        return self.state if self.state is not None else self.load()[1]

    def save(self, session, state: TrainState) -> None:
        """Replace the checkpoint (weights and state together); signals wait until it is done."""
        if not self.writer:
            return
        assert self.locked, "save() needs the directory's lock"
        with signals_deferred():
            try:
                session.save(self.model_path, metadata=state.to_metadata())
            except OSError as e:
                self._remove_stale()
                full = e.errno in (errno.ENOSPC, errno.EDQUOT)
                what = "the disk is full" if full else (e.strerror or str(e))
                raise CheckpointError(
                    f"cannot write the checkpoint {self.model_path!r}: {what}; the previous checkpoint "
                    f"({'none' if not self.has_checkpoint() else 'epoch ' + str(state.epochs_done - 1)}) is kept",
                    "free some space and rerun the same command to resume" if full
                    else "check the directory's permissions and rerun the same command to resume") from e


__all__ = ["CHECKPOINT", "CheckpointDir", "TrainState", "Interrupted", "check_resume",
           "model_file_fingerprint", "file_fingerprint", "signals_as_exceptions", "signals_deferred"]
