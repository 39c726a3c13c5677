"""The state file: a NumPy ``.npz`` mapping each state input of ``step.onnx`` (the names in
``bundle.json``'s ``"state"`` keys: weights, optimizer moments, the iteration counter) to its array.
``import_state`` puts such a file back into the training model and writes the inference ``.onnx``."""
from __future__ import annotations

import io
import os

import numpy as np

from ..errors import BundleError
from ..model.io import write_atomic


def save_state(path, state: dict) -> None:
    """Write the state map as an ``.npz`` atomically."""
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in state.items()})
    write_atomic(path, buf.getvalue())


def load_state(path) -> dict[str, np.ndarray]:
    try:
        with np.load(os.fspath(path), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise BundleError(f"cannot read the state file {os.fspath(path)!r}: {e}",
                          hint="a state file is an .npz of {state input: array}, see docs/runtimes.md") from None


def import_state(training_model, state: dict, out_path) -> int:
    """The inference model of ``training_model`` with the weights of ``state`` written to ``out_path``;
    every name must be a mutable tensor of the model with the same shape and dtype. Returns the steps
    the state has done (its iteration counter when there is one, else 0)."""
    from ..driver.session import TrainingSession

    sess = TrainingSession(training_model)
    known = set(sess.state)
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
