"""``server_app``: a Flower ``ServerApp`` that federates a training model with one of Flower's strategies.

The first global tensors are the model's own. After every round the server evaluates the global tensors on
held-out feeds (``evaluate``), and with ``out`` writes them as our checkpoint (``out/checkpoint.onnx``, replaced
atomically, its round in the metadata): a restarted server continues from the round after it. At the end
``out/model.onnx`` is the inference model (and, for LoRA, ``out/adapter.onnx_adapter``). Replies whose tensors
have other names, dtypes or shapes, or hold NaN/Inf, are left out of the aggregate with one log line naming the
node; if fewer than ``min_clients`` remain the run stops with ``FederatedError``, the last good model on disk.
"""
from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Mapping

import numpy as np

from ..errors import FederatedError
from .bundle import BundleGlobal, bundle_loss
from .client import to_record
from .evaluation import evaluate_arrays, inference_session
from .model import FederatedModel, mismatch
from .secure import legacy_strategy_of, run_secure, secure_workflow

try:
    from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp import strategy as flwr_strategy
except ImportError as e:  # pragma: no cover - the federated extra
    raise FederatedError(f"Flower is not installed ({e})", hint="pip install 'onnx-autodiff[federated]'") from None

_log = logging.getLogger("onnx_autodiff")
ROUND = "onnx_autodiff.federated_round"  # checkpoint metadata: rounds done
SHARED = "onnx_autodiff.federated_shared"  # checkpoint metadata: the shared tensors' names, JSON
STRATEGIES = {"fedavg": "FedAvg", "fedprox": "FedProx", "fedadam": "FedAdam", "fedyogi": "FedYogi",
              "fedadagrad": "FedAdagrad", "fedmedian": "FedMedian", "fedtrimmedavg": "FedTrimmedAvg",
              "krum": "Krum", "fedavgm": "FedAvgM", "multikrum": "MultiKrum", "bulyan": "Bulyan"}


def make_strategy(strategy, min_clients: int, **options):
    """One of Flower's strategies by name (``STRATEGIES``) with its options, or a ``Strategy`` as it is."""
    if not isinstance(strategy, str):
        return strategy
    name = STRATEGIES.get(strategy.lower())
    if name is None:
        raise FederatedError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}, or pass a "
                             "Flower Strategy")
    cls = getattr(flwr_strategy, name)
    options = {"min_train_nodes": min_clients, "min_evaluate_nodes": min_clients,
               "min_available_nodes": min_clients, **options}
    try:
        return cls(**options)
    except TypeError as e:
        raise FederatedError(f"{name}: {e}", hint=f"see flwr.serverapp.strategy.{name}'s options") from None


def guard(strategy, expected: Mapping[str, tuple], min_clients: int, log: Callable[[str], None]):
    """Wrap ``strategy.aggregate_train`` so that a reply with wrong or non-finite tensors is left out, and the
    aggregate goes out in the model's dtypes."""
    aggregate = strategy.aggregate_train

    def aggregate_train(server_round, replies):
        good = []
        for msg in replies:
            if not msg.has_error():
                record = msg.content.array_records.get("arrays")
                arrays = {k: v.numpy() for k, v in record.items()} if record is not None else {}
                problem = mismatch(expected, arrays)
                if problem:
                    log(f"round {server_round}: the update of node {msg.metadata.src_node_id} is left out: {problem}")
                    continue
            good.append(msg)
        if sum(not m.has_error() for m in good) < min_clients:
            raise FederatedError(f"round {server_round}: {sum(not m.has_error() for m in good)} good update(s), "
                                 f"fewer than min_clients={min_clients}; the last good global model is kept",
                                 hint="see the lines above for the nodes left out and why")
        arrays, metrics = aggregate(server_round, good)
        if arrays is not None:  # FedOpt's strategies compute in float64: the model's dtypes go out
            arrays = to_record({k: v.numpy().astype(expected[k][0], copy=False) if k in expected else v.numpy()
                                for k, v in arrays.items()})
        return arrays, metrics

    strategy.aggregate_train = aggregate_train
    return strategy


class GlobalModel:
    """The global tensors on the server, in an onnxruntime session of the model: ``out/checkpoint.onnx`` after
    every round (a restarted server continues from it), the inference model and adapters at the end."""

    def __init__(self, fed: FederatedModel, out: str | None, log: Callable[[str], None]):
        self.fed, self.out, self.done = fed, out, 0
        path = os.path.join(out, "checkpoint.onnx") if out else None
        if path and os.path.exists(path):
            self.session = fed.session(path)
            if json.loads(self.session.metadata.get(SHARED, "[]")) != fed.names:
                raise FederatedError(f"{path} is a checkpoint of another model (other shared tensors)",
                                     hint="give another out= folder")
            self.done = int(self.session.metadata.get(ROUND, 0))
            log(f"resuming from {path}: {self.done} round(s) done")
        else:
            self.session = fed.session()
        if out:
            os.makedirs(out, exist_ok=True)

    def arrays(self) -> dict[str, np.ndarray]:
        return {n: self.session.get_state(n) for n in self.fed.names}

    def update(self, rnd: int, tensors: Mapping[str, np.ndarray]) -> None:
        """Round ``rnd``'s global tensors; saved atomically with the round number."""
        for name, value in tensors.items():
            self.session.set_state(name, value)
        if self.out:
            self.session.save(os.path.join(self.out, "checkpoint.onnx"),
                              metadata={ROUND: str(rnd), SHARED: json.dumps(self.fed.names)})
        self.done = rnd

    def finish(self) -> list[str]:
        """``out/model.onnx`` (and the LoRA adapters beside it); returns the paths written."""
        if not self.out:
            return []
        written = [os.path.join(self.out, "model.onnx")]
        self.session.export_inference(written[0])
        if self.fed.share == "lora" and self.done:
            from ..training.lora.adapters import export_adapter
            written += export_adapter(os.path.join(self.out, "checkpoint.onnx"), self.out, format="onnxruntime")
        return written


def server_app(model, strategy="fedavg", *, rounds: int = 3, min_clients: int = 2,
               evaluate: Mapping[str, np.ndarray] | Callable | None = None, out: str | os.PathLike | None = None,
               share: str | None = None, timeout: float = 3600, train_config: Mapping | None = None,
               log: Callable[[str], None] | None = None, secure_aggregation=None,
               **strategy_options) -> ServerApp:
    """A Flower ``ServerApp``: ``rounds`` rounds of ``strategy`` (a name of ``STRATEGIES`` with its options as
    keywords, e.g. ``proximal_mu=0.1``, or a Flower ``Strategy``) over at least ``min_clients`` clients.
    ``evaluate``: held-out feeds (input name -> array, labels included) or ``callable(round, session)`` returning
    a dict of metrics; ``out``: a folder for the checkpoint after every round and the final inference model.
    ``train_config``: sent to the clients every round (``lr``, ``local-epochs``, ``batch-size``).
    ``app.history`` holds one dict per round (``round`` and the centralized metrics); ``app.result`` Flower's
    ``Result`` (the clients' aggregated metrics per round, ``fit_seconds`` / ``client_seconds`` among them).
    ``secure_aggregation``: True, a dict of ``SecAggPlusWorkflow``'s options or one itself: the rounds run
    through Flower's SecAgg+ (``secure.py``; the clients need ``mods=[secaggplus_mod]``), and ``app.result`` is
    Flower's ``History``."""
    say = log or _log.info
    fed = FederatedModel(model, share)
    workflow = (secure_workflow(secure_aggregation, timeout) if secure_aggregation not in (None, False)
                else None)
    if workflow is not None:
        legacy_strategy_of(strategy, min_clients, [], **strategy_options)  # a bad strategy fails here, not later
    if fed.bundle is not None and callable(evaluate):
        raise FederatedError("evaluate= as a function takes an inference session, and a step bundle has no "
                             "inference model", hint="give held-out feeds: the step's loss at learning rate 0")
    scorer = functools.cache(lambda: fed.bundle.trainer("onnxruntime"))
    app = ServerApp()
    app.history = []
    app.result = None  # Flower's Result of the last start: per-round train/evaluate metrics of the clients
    out = os.fspath(out) if out is not None else None

    def on_round(glob: GlobalModel, done: int) -> Callable:
        def fn(server_round: int, tensors: dict) -> dict:
            rnd = done + server_round
            if server_round > 0:
                glob.update(rnd, tensors)
            metrics = {}
            if callable(evaluate):
                metrics = dict(evaluate(rnd, inference_session(fed, tensors)))
            elif evaluate is not None and fed.bundle is not None:
                metrics = bundle_loss(scorer(), tensors, evaluate)
            elif evaluate is not None:
                metrics = evaluate_arrays(fed, tensors, evaluate)
            app.history.append({"round": rnd, **metrics})
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            say(f"round {rnd}/{rounds}" + (f": {shown}" if shown else ""))
            return metrics
        return fn

    def evaluate_fn(glob: GlobalModel, done: int) -> Callable:
        record = on_round(glob, done)

        def fn(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            metrics = record(server_round, {k: v.numpy() for k, v in arrays.items()})
            return MetricRecord(metrics) if metrics else None
        return fn

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        glob = (BundleGlobal(fed.bundle, out, say, ROUND, SHARED) if fed.bundle is not None
                else GlobalModel(fed, out, say))
        if glob.done < rounds and workflow is not None:
            app.result = run_secure(grid, context, strategy=strategy, workflow=workflow, initial=glob.arrays(),
                                    rounds=rounds, done=glob.done, min_clients=min_clients, timeout=timeout,
                                    train_config=train_config, on_round=on_round(glob, glob.done),
                                    **strategy_options)
        elif glob.done < rounds:
            initial = glob.arrays()
            expected = {n: (v.dtype, v.shape) for n, v in initial.items()}
            strat = guard(make_strategy(strategy, min_clients, **strategy_options), expected, min_clients, say)
            app.result = strat.start(grid=grid, initial_arrays=to_record(initial), num_rounds=rounds - glob.done,
                        timeout=timeout, train_config=ConfigRecord(dict(train_config or {})),
                        evaluate_fn=evaluate_fn(glob, glob.done))
        else:
            say(f"already trained {glob.done} round(s); nothing to do (raise rounds to train more)")
        glob.finish()

    return app


__all__ = ["server_app", "make_strategy", "guard", "GlobalModel", "STRATEGIES"]
