"""``client_app``: a Flower ``ClientApp`` that trains a training model locally on any runtime ``train --runtime``
takes, and sends back the shared tensors (``model.py``).

A train message carries the global tensors (``msg.content["arrays"]``, an ``ArrayRecord`` by name) and a
``ConfigRecord`` (``server-round``; FedProx's ``proximal-mu``; ``lr``, ``local-epochs``, ``batch-size`` when the
server sets them). The client sets the global tensors, restores its own optimizer state from ``context.state``
(moments persist between rounds on a node; a node's first round starts them from the model's initialization),
trains ``local_epochs`` epochs of its partition with the one ``fit`` every runtime uses, and replies with its
tensors and ``num-examples`` / ``train_loss``. An evaluate message gets the loss and accuracy of the global
tensors on the partition.
"""
from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx

from ..errors import FederatedError
from . import legacy
from .bundle import bundle_loss
from .evaluation import evaluate_arrays
from .model import Data, FederatedModel, LocalTrainer, load_partition, partition_of
from .proximal import local_fit

try:
    from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
except ImportError as e:  # pragma: no cover - the federated extra
    raise FederatedError(f"Flower is not installed ({e})", hint="pip install 'onnx-autodiff[federated]'") from None

OPTIMIZER = "onnx_autodiff.optimizer"  # context.state key: this node's optimizer state between rounds


@dataclass(frozen=True)
class _Spec:
    """What a ``ClientApp`` carries to the processes that run it (picklable: Ray ships it to its actors)."""

    model: object
    data: object
    runtime: object  # a name, or partition id -> name
    local_epochs: int
    batch_size: int
    lr: float | None
    share: str | None
    seed: int


_made: dict = {}  # this process's models and trainers: a simulation runs many nodes in one process
_lock = threading.Lock()


def _model(spec: _Spec) -> FederatedModel:
    key = ("model", id(spec.model) if isinstance(spec.model, onnx.ModelProto) else spec.model, spec.share)
    with _lock:
        if key not in _made:
            _made[key] = FederatedModel(spec.model, spec.share)
        return _made[key]


def _trainer(spec: _Spec, runtime: str, proximal: bool) -> LocalTrainer:
    fed = _model(spec)
    key = ("trainer", id(fed), runtime, proximal)
    with _lock:
        if key not in _made:
            _made[key] = LocalTrainer(fed, runtime, proximal=proximal)
        return _made[key]


def _peak_mb() -> float:
    """This process's peak resident memory (0 where the platform does not say)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return 0.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _arrays(record) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


def _partition(spec: _Spec, part: int, parts: int) -> dict[str, np.ndarray]:
    """A node's arrays, loaded once per process. The entry holds the data callable too: were it collected, a
    new callable could get its id and be handed its arrays."""
    key = ("data", id(spec.data) if callable(spec.data) else spec.data, part, parts)
    with _lock:
        if key not in _made:
            _made[key] = (spec.data, load_partition(spec.data, part, parts))
        return _made[key][1]


def _prepare(spec: _Spec, msg: Message, context: Context):
    part, parts = partition_of(context.node_config)
    arrays = _partition(spec, part, parts)
    if legacy.is_legacy(msg):  # Flower's DefaultWorkflow / SecAggPlusWorkflow
        sent, config = legacy.incoming(msg, _model(spec).names)
    elif "arrays" not in msg.content.array_records:
        raise FederatedError(legacy.unexpected(msg))
    else:
        sent, config = _arrays(msg.content.array_records["arrays"]), msg.content.config_records.get("config", {})
    mu = float(config.get("proximal-mu", 0.0))
    default = spec.runtime(part) if callable(spec.runtime) else spec.runtime
    local = _trainer(spec, str(context.node_config.get("runtime", default)), mu > 0)
    local.check_shared(sent, "the server's arrays")
    return local, arrays, config, mu, sent, part


def train(spec: _Spec, msg: Message, context: Context) -> Message:
    """A train message: the global tensors in, local epochs, this node's tensors out. Its metrics say how long
    the local epochs took (``fit_seconds``) of the whole handler (``client_seconds``: arrays in and out too),
    and the peak memory of the process running it (``process_peak_mb``)."""
    start = time.perf_counter()
    local, arrays, config, mu, sent, part = _prepare(spec, msg, context)
    fed = local.fed
    kept = context.state.array_records.get(OPTIMIZER)
    local.set(unpack(kept, local.start) if kept is not None else local.start)
    local.set(sent)
    rnd = int(config.get("server-round", 1))
    fit_start = time.perf_counter()
    loss, n = local_fit(local, arrays, epochs=int(config.get("local-epochs", spec.local_epochs)),
                        batch_size=int(config.get("batch-size", spec.batch_size)), seed=[spec.seed, rnd, part],
                        lr=config.get("lr", spec.lr), mu=mu, anchor=sent)
    fit_seconds = time.perf_counter() - fit_start
    context.state[OPTIMIZER] = pack(local.get(fed.private))
    mine = local.get(list(sent))  # in the order received (the DP mods compare it)
    metrics = {"num-examples": n, "train_loss": loss, "fit_seconds": fit_seconds,
               "client_seconds": time.perf_counter() - start, "process_peak_mb": _peak_mb()}
    if legacy.is_legacy(msg):
        legacy.check_secure(mine, n, context.state)
        return legacy.fit_reply(msg, list(mine.values()), n, metrics)
    out = to_record(mine)
    return Message(content=RecordDict({"arrays": out, "metrics": MetricRecord(metrics)}), reply_to=msg)


def evaluate(spec: _Spec, msg: Message, context: Context) -> Message:
    """An evaluate message: loss and accuracy of the global tensors on this node's partition."""
    local, arrays, _, _, sent, _ = _prepare(spec, msg, context)
    if local.fed.bundle is not None:  # no inference model: the step's loss at learning rate 0
        metrics = bundle_loss(local.trainer, sent, arrays)
    else:
        metrics = evaluate_arrays(local.fed, sent, arrays)
    metrics["num-examples"] = len(next(iter(arrays.values())))
    if legacy.is_legacy(msg):
        return legacy.evaluate_reply(msg, metrics, metrics["num-examples"])
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


def client_app(model, data: Data, *, runtime="onnxruntime", local_epochs: int = 1, batch_size: int = 32,
               lr: float | None = None, share: str | None = None, seed: int = 0, mods=None) -> ClientApp:
    """A Flower ``ClientApp`` training ``model`` on ``data`` (a callable ``(partition_id, num_partitions) ->
    {input name: array}`` or a folder of ``client-<i>.npz``); the partition comes from the node's
    ``node_config`` (``partition-id``, ``num-partitions``), and so may the runtime (``node_config["runtime"]``;
    else ``runtime``: a name any ``train --runtime`` takes, or ``partition_id -> name`` for a mixed fleet).
    ``mods``: Flower's client mods (``fixedclipping_mod``, ``LocalDpMod``, ``secaggplus_mod``)."""
    FederatedModel(model, share)  # bad input fails here, not in every node
    spec = _Spec(model if isinstance(model, onnx.ModelProto) else os.fspath(model),
                 data if callable(data) else os.fspath(data), runtime, local_epochs, batch_size, lr, share, seed)
    app = ClientApp(mods=list(mods or []))
    app.train()(functools.partial(train, spec))
    app.evaluate()(functools.partial(evaluate, spec))
    return app


def pack(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Tensors that never leave the node (its optimizer state), one flat array per dtype: a record of one
    ``Array`` per tensor costs a serialization each, a tenth of a small model's local epoch."""
    groups: dict[str, list[np.ndarray]] = {}
    for value in arrays.values():
        groups.setdefault(value.dtype.str, []).append(np.ravel(value))
    return ArrayRecord({k: Array(np.concatenate(v)) for k, v in groups.items()})


def unpack(record: ArrayRecord, like: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``pack``'s tensors again, shaped and named as ``like`` (the same names in the same order)."""
    flat = {k: v.numpy() for k, v in record.items()}
    at = dict.fromkeys(flat, 0)
    out = {}
    for name, ref in like.items():
        key, n = ref.dtype.str, ref.size
        out[name] = flat[key][at[key]:at[key] + n].reshape(ref.shape)
        at[key] += n
    return out


def to_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """An ``ArrayRecord`` of named arrays (what crosses the wire)."""
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


__all__ = ["client_app", "to_record"]
