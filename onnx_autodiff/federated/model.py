"""What a federation trains: a training model, the tensors that cross the wire, and one local trainer per runtime.

The tensors sent are the model's trainable tensors (the ``xs`` of its Gradient nodes) and the running
statistics a step updates in the inference graph (BatchNormalization's mean and variance): ``share="trainable"``.
With LoRA adapters only the adapters train, so only they cross (``share="lora"``, the default for such a model).
Optimizer moments and step counters never leave a client.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping

import numpy as np
import onnx

from ..driver.session import TrainingSession
from ..driver.step_model import gradient_names
from ..errors import FederatedError
from ..model import metadata
from .bundle import BundleInfo, is_bundle

SHARES = ("trainable", "lora")
Data = Callable[[int, int], Mapping[str, np.ndarray]] | str | os.PathLike


def _proto_of(model) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    path = os.fspath(model)
    if not os.path.isfile(path):
        raise FederatedError(f"no training model at {path!r}")
    return onnx.load(path, load_external_data=False)


class FederatedModel:
    """The training model (a path, or the ``ModelProto`` ``make_training_model`` returns) or a step bundle folder
    (``bundle.py``), and its shared names."""

    def __init__(self, model, share: str | None = None):
        self.model = model if isinstance(model, onnx.ModelProto) else os.fspath(model)
        self.bundle = BundleInfo(self.model) if is_bundle(model) else None
        if self.bundle is not None:
            self._from_bundle(self.bundle, share)
            return
        proto = _proto_of(model)
        if not len(proto.training_info):
            raise FederatedError("the model has no training_info: federated learning needs a training model",
                                 hint="add a loss and an optimizer first (make_training_model / make-training)")
        params = gradient_names(proto, 0)["parameters"]
        bound = [b.key for b in proto.training_info[0].update_binding]
        inference = {t.name for t in proto.graph.initializer}
        buffers = [k for k in bound if k in inference and k not in params]  # running statistics
        lora = metadata.read_json(proto, metadata.LORA)
        default = "lora" if lora else "trainable"
        self.share = share or default
        if self.share not in SHARES:
            raise FederatedError(f"share={self.share!r}: choose one of {', '.join(SHARES)}")
        if self.share == "lora":
            if not lora:
                raise FederatedError("share='lora', but the model has no LoRA adapters",
                                     hint="share='trainable', or make the model with lora=")
            self.names = list(params)
        else:
            self.names = list(params) + buffers
        if not self.names:
            raise FederatedError("the model trains no tensor: nothing to federate")
        self.params = list(params)
        self.record = metadata.read_json(proto, metadata.BUILDER) or {}
        self.private = [k for k in bound if k not in self.names]  # optimizer moments, counters

    def _from_bundle(self, info: BundleInfo, share: str | None) -> None:
        self.share = share or ("lora" if info.lora else "trainable")
        if self.share not in SHARES:
            raise FederatedError(f"share={self.share!r}: choose one of {', '.join(SHARES)}")
        if self.share == "lora" and not info.lora:
            raise FederatedError("share='lora', but the bundle's step has no LoRA adapters",
                                 hint="share='trainable', or make the model with lora=")
        self.names = info.params if self.share == "lora" else info.names
        if not self.names:
            raise FederatedError(f"the bundle {info.dir!r} keeps no stored tensor in its state: nothing to federate")
        self.params, self.record, self.private = info.params, info.record, info.private

    def session(self, path: str | None = None) -> TrainingSession:
        """An onnxruntime session of the model (or of ``path``, a checkpoint of it)."""
        if self.bundle is not None:
            raise FederatedError(f"{self.bundle.dir!r} is a step bundle: it has no training model to open a session "
                                 "of (nor an inference model)", hint="give the training model it was made from")
        return TrainingSession(path or self.model, progress=False, check_forward=False)

    def initial_arrays(self) -> dict[str, np.ndarray]:
        """The shared tensors as the model stores them (its initializers: the first global model)."""
        if self.bundle is not None:
            return self.bundle.initial_arrays()
        sess = self.session()
        return {n: sess.get_state(n) for n in self.names}


class LocalTrainer:
    """One runtime's trainer of a ``FederatedModel`` in this process: its state in and out by name. With
    ``proximal``, the step carries FedProx's term (``proximal.py``)."""

    def __init__(self, fed: FederatedModel, runtime: str = "onnxruntime", proximal: bool = False):
        self.fed, self.runtime, self.proximal, self.params = fed, runtime, proximal, fed.params
        self.trainer = self._trainer(fed, runtime, proximal)
        self.start = self.get(fed.private)  # the optimizer state a node starts from
        self.shapes = {n: (v.dtype, v.shape) for n, v in self.get(fed.names).items()}
        self._shape_of = {n: v.shape for n, v in {**self.start, **self.get(fed.names)}.items()}

    def _trainer(self, fed: FederatedModel, runtime: str, proximal: bool):
        from .proximal import with_proximal_term

        if fed.bundle is not None:
            if proximal:
                raise FederatedError("FedProx's term enters the step's gradient: a step bundle cannot take it",
                                     hint="give the training model the bundle was made from")
            return fed.bundle.trainer(runtime)
        model = fed.model
        if proximal:
            whole = model if isinstance(model, onnx.ModelProto) else onnx.load(model)
            model = with_proximal_term(whole, fed.params)
        if runtime == "onnxruntime":
            return TrainingSession(model, progress=False, check_forward=False)
        from ..driver.bundle import build_bundle, write_bundle
        from ..runtimes.loop import BundleTrainer
        step, init, manifest = build_bundle(model, runtime)
        self._dir = tempfile.TemporaryDirectory(prefix="onnx-autodiff-federated-")
        bundle = os.path.dirname(write_bundle(step, init, manifest, self._dir.name))
        return BundleTrainer(bundle, runtime, model=model)

    def get(self, names) -> dict[str, np.ndarray]:
        t = self.trainer
        if isinstance(t, TrainingSession):
            return {n: t.get_state(n) for n in names}
        return {n: np.array(t.state[n]) for n in names}

    def set(self, arrays: Mapping[str, np.ndarray]) -> None:
        t = self.trainer
        for name, value in arrays.items():
            value = np.asarray(value)
            shape = self._shape_of.get(name)
            if shape is not None and value.shape != shape and value.size == int(np.prod(shape)):
                value = value.reshape(shape)  # Flower hands a 0-d array back as shape (1,)
            if isinstance(t, TrainingSession):
                t.set_state(name, value)
            else:
                t.state[name] = value.astype(t.state[name].dtype, copy=False)

    def check_shared(self, arrays: Mapping[str, np.ndarray], what: str) -> None:
        """``arrays`` are exactly the shared tensors, with their dtypes and shapes."""
        problem = mismatch(self.shapes, arrays)
        if problem:
            raise FederatedError(f"{what}: {problem}", hint="the server and the clients must use the same model")


def mismatch(expected: Mapping[str, tuple], arrays: Mapping[str, np.ndarray]) -> str | None:
    """Why ``arrays`` are not the tensors ``expected`` names (name -> (dtype, shape)), or None."""
    missing = [n for n in expected if n not in arrays]
    extra = [n for n in arrays if n not in expected]
    if missing or extra:
        return f"tensors missing {missing[:3]}, unexpected {extra[:3]}"
    for n, (dtype, shape) in expected.items():
        a = arrays[n]
        if a.dtype != dtype or tuple(a.shape) != tuple(shape):
            return f"{n!r} is {a.dtype} {list(a.shape)}, the model's is {np.dtype(dtype)} {list(shape)}"
        if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
            return f"{n!r} holds NaN or Inf"
    return None


def load_partition(data: Data, partition: int, partitions: int) -> dict[str, np.ndarray]:
    """A client's arrays: ``data(partition, partitions)``, or ``DIR/client-<partition>.npz``."""
    if callable(data):
        out = data(partition, partitions)
        if not isinstance(out, Mapping):
            raise FederatedError(f"data({partition}, {partitions}) returned {type(out).__name__}, not a mapping "
                                 "of input name -> array")
        return {k: np.asarray(v) for k, v in out.items()}
    folder = os.fspath(data)
    path = os.path.join(folder, f"client-{partition}.npz")
    if not os.path.isfile(path):
        have = sorted(f for f in os.listdir(folder) if f.startswith("client-")) if os.path.isdir(folder) else []
        raise FederatedError(f"partition {partition} of {partitions}: no file {path!r} (the folder has "
                             f"{len(have)} client-<i>.npz files)", hint="one client-<i>.npz per partition, i from 0")
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def partition_of(node_config: Mapping) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` from a Flower node's ``node_config``."""
    try:
        return int(node_config["partition-id"]), int(node_config["num-partitions"])
    except KeyError as e:
        raise FederatedError(f"the node's config has no {e.args[0]!r}",
                             hint='start the node with --node-config "partition-id=I num-partitions=N"') from None


__all__ = ["FederatedModel", "LocalTrainer", "load_partition", "partition_of", "mismatch", "SHARES"]
