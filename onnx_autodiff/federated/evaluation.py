"""Loss and accuracy of a set of shared tensors, through the inference model (eval mode) in onnxruntime.

For each output the training model's loss reads (``make_training_model``'s record names its label input):
integer labels give the mean cross-entropy of the logits (class axis 1, as ``cross_entropy``) and the accuracy;
float targets give the mean squared error. Other losses: pass a callable of your own as ``evaluate``.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
import onnxruntime as ort

from ..errors import FederatedError
from ..ort_options import session_options
from .model import FederatedModel

_sessions: dict[int, object] = {}
_lock = threading.Lock()


def _holder(fed: FederatedModel):
    with _lock:  # the entry holds ``fed``: were it collected, a new model could get its id and this session
        if id(fed) not in _sessions:
            _sessions[id(fed)] = (fed, fed.session())
        return _sessions[id(fed)][1]


def inference_session(fed: FederatedModel, arrays: Mapping[str, np.ndarray]) -> ort.InferenceSession:
    """An onnxruntime session of the inference model with ``arrays`` as its shared tensors."""
    sess = _holder(fed)
    with _lock:
        for name, value in arrays.items():
            sess.set_state(name, value)
        model = sess.inference_model()
    return ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])


def metrics_of(outputs: Mapping[str, np.ndarray], labels: Mapping[str, np.ndarray]) -> dict[str, float]:
    """``loss`` (mean over the labelled outputs) and, for class labels, ``accuracy``."""
    losses, accuracies = [], []
    for out, y in labels.items():
        z = np.asarray(outputs[out], np.float64)
        if y.dtype.kind in "iu":
            z = np.moveaxis(z, 1, -1).reshape(-1, z.shape[1]) if z.ndim > 2 else z
            t = y.reshape(-1).astype(np.int64)
            shifted = z - z.max(axis=1, keepdims=True)
            logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            losses.append(float(-logp[np.arange(len(t)), t].mean()))
            accuracies.append(float((z.argmax(axis=1) == t).mean()))
        else:
            losses.append(float(np.mean((z - y) ** 2)))
    out = {"loss": float(np.mean(losses))}
    if accuracies:
        out["accuracy"] = float(np.mean(accuracies))
    return out


def evaluate_arrays(fed: FederatedModel, arrays: Mapping[str, np.ndarray],
                    data: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Loss and accuracy of the shared ``arrays`` on ``data`` (input name -> array, labels included)."""
    sess = inference_session(fed, arrays)
    record = fed.record
    pairs = dict(zip(record.get("outputs", []), record.get("labels", [])))
    if not pairs:
        raise FederatedError("the model does not say which input holds its labels (it was not made by "
                             "make_training_model)", hint="pass evaluate=callable(round, session) instead")
    inputs = {i.name for i in sess.get_inputs()}
    missing = [n for n in list(inputs) + list(pairs.values()) if n not in data]
    if missing:
        raise FederatedError(f"the evaluation data lacks {missing}", hint=f"give arrays named {sorted(inputs)} "
                             f"and the labels {list(pairs.values())}")
    outs = sess.run(list(pairs), {n: data[n] for n in inputs})
    return metrics_of(dict(zip(pairs, outs)), {o: np.asarray(data[lab]) for o, lab in pairs.items()})


__all__ = ["evaluate_arrays", "inference_session", "metrics_of"]
