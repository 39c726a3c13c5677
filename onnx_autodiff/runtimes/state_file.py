"""The state file: a NumPy ``.npz`` mapping each state input of ``step.onnx`` (the names in
``bundle.json``'s ``"state"`` keys: weights, optimizer moments, the iteration counter) to its array.
``import_state`` puts such a file back into the training model and writes the inference ``.onnx``.

Since ``train --runtime R`` writes ``DIR/checkpoint.onnx`` as ``train`` on onnxruntime does, the state file is
deprecated (still written for one release). ``load_state`` reads either: a checkpoint's state is its
initializers named like the state."""
from __future__ import annotations

import io
import os
import zipfile

import numpy as np
from onnx import numpy_helper

from ..errors import BundleError
from ..model.io import write_atomic


def save_state(path, state: dict) -> None:
    """Write the state map as an ``.npz`` atomically."""
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in state.items()})
    write_atomic(path, buf.getvalue())


def load_state(path) -> dict[str, np.ndarray]:
    """The state map of a state file (``.npz``), or the initializers of a checkpoint (``checkpoint.onnx``, any
    runtime's: ``import_state`` keeps those that are state of the model)."""
    if not zipfile.is_zipfile(os.fspath(path)) and os.path.isfile(path):
        return _checkpoint_state(path)
    try:
        with np.load(os.fspath(path), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise BundleError(f"cannot read the state file {os.fspath(path)!r}: {e}",
                          hint="a state file is an .npz of {state input: array}, see docs/runtimes.md") from None


class _CheckpointState(dict):
    """A checkpoint's initializers: every tensor of it, of which ``import_state`` takes the state."""


def _checkpoint_state(path) -> dict[str, np.ndarray]:
    from ..model.carrier import open_model
    from ..model.weights import is_detached, top_graphs

    try:
        light = open_model(os.fspath(path), what="checkpoint")
    except (OSError, ValueError) as e:
        raise BundleError(f"cannot read {os.fspath(path)!r}: not an .npz state file nor a checkpoint ({e})",
                          hint="pass DIR/state.npz or DIR/checkpoint.onnx of a train run") from None
    return _CheckpointState({t.name: light.arrays[t.name] if is_detached(t) else numpy_helper.to_array(t)
                             for g in top_graphs(light.proto) for t in g.initializer})


def import_state(training_model, state: dict, out_path) -> int:
    """The inference model of ``training_model`` with the weights of ``state`` written to ``out_path``;
    every name must be a mutable tensor of the model with the same shape and dtype. Returns the steps
    the state has done (its iteration counter when there is one, else 0)."""
    from ..driver.session import TrainingSession

    sess = TrainingSession(training_model)
    known = set(sess.state)
    if isinstance(state, _CheckpointState):  # a checkpoint holds constants beside the state
        state = {k: v for k, v in state.items() if k in known}
    unknown = sorted(set(state) - known)
    if unknown:
        raise BundleError(f"the state file names {unknown[:5]}, which are not state of this model (its state: "
                          f"{sorted(known)[:5]}...)", hint="import the state into the model the bundle was made from")
    for name, value in state.items():
        have = np.asarray(sess.state[name])
        value = np.asarray(value)
        if value.shape != have.shape or value.dtype != have.dtype:
            raise BundleError(f"state {name!r}: the file holds {value.dtype}{list(value.shape)}, the model "
                              f"{have.dtype}{list(have.shape)}")
        sess.state[name] = value
    sess.export_inference(out_path)
    return len(state)


__all__ = ["save_state", "load_state", "import_state"]
