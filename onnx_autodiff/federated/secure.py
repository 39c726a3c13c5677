"""``server_app(..., secure_aggregation=...)``: our rounds through Flower's SecAgg+ (``SecAggPlusWorkflow``).

In Flower 1.42 SecAgg+ exists only as a workflow of the older server API: ``DefaultWorkflow(fit_workflow=
SecAggPlusWorkflow(...))`` over a ``LegacyContext`` whose strategy is one of ``flwr.server.strategy``'s (it calls
``configure_fit`` / ``aggregate_fit``); the Message-API strategies of ``flwr.serverapp.strategy`` cannot run in
it. So a secure ``server_app`` takes the older class of the same name, and only the strategies whose aggregate
is the weighted mean of the updates (the server sees nothing else): ``SECURE``. The model's tensors travel in
the order of ``FederatedModel.names``; the round's checkpoint, evaluation and history are the same as without.

SecAgg+ quantization (Flower's ``quantize``): a client with n examples and tensor w sends the integers
``SR((r * w + C) * Q / (2C))``, ``r = round(n / M * Q) / Q`` its quantized weight, ``C`` = clipping_range,
``Q`` = quantization_range, ``M`` = max_weight, SR a stochastic rounding (off by less than 1). The server
unmasks the sum and gets ``sum(r_i w_i) / R`` (``R = sum r_i``) off by less than ``k * 2C / (Q * R)`` per
element for k clients. The weights ``r_i`` differ from FedAvg's ``n_i / M`` by at most ``1 / (2Q)``, which moves
the mean by at most ``k * C / (Q * R)`` (every ``|w| <= C``, so each lies within 2C of the mean). In all, a
SecAgg+ round gives FedAvg's mean to within ``3 * k * C / (Q * R)`` (``quantization_bound``), ``R ~ N / M`` for
N examples in all: a ``max_weight`` near the largest client's example count keeps it small.
"""
from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping

import numpy as np

from ..errors import FederatedError
from .model import mismatch

try:
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import ServerConfig
    from flwr.server import strategy as legacy_strategy
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
    from flwr.serverapp import strategy as flwr_strategy
except ImportError as e:  # pragma: no cover - the federated extra
    raise FederatedError(f"Flower is not installed ({e})", hint="pip install 'onnx-autodiff[federated]'") from None

SECURE = {"fedavg": "FedAvg", "fedprox": "FedProx", "fedadam": "FedAdam", "fedyogi": "FedYogi",
          "fedadagrad": "FedAdagrad", "fedavgm": "FedAvgM"}
DEFAULTS = {"num_shares": 1.0, "reconstruction_threshold": 0.5}  # every client a neighbour; half reconstruct
OLDER_NAMES = {"fraction_train": "fraction_fit", "min_train_nodes": "min_fit_clients",
               "min_evaluate_nodes": "min_evaluate_clients", "min_available_nodes": "min_available_clients"}


def quantization_bound(counts, *, clipping_range: float = 8.0, quantization_range: int = 4194304,
                       max_weight: float = 1000.0, **_) -> float:
    """How far a SecAgg+ round's mean may lie from FedAvg's, per element, for clients with ``counts`` examples
    (see the module's docstring): ``3 * k * C / (Q * R)``."""
    q = quantization_range
    total = sum(round(n / max_weight * q) / q for n in counts)
    return 3 * len(counts) * clipping_range / (q * total)


def secure_workflow(secure_aggregation, timeout: float | None = None) -> SecAggPlusWorkflow:
    """A ``SecAggPlusWorkflow`` as it is, from a dict of its options, or with ``DEFAULTS`` for True; ``timeout``
    (how long a stage waits for replies: a dead node must not hold the run for ever) unless the options set it."""
    if isinstance(secure_aggregation, SecAggPlusWorkflow):
        return secure_aggregation
    options = {**DEFAULTS, "timeout": timeout}
    if isinstance(secure_aggregation, Mapping):
        options.update(secure_aggregation)
    elif secure_aggregation is not True:
        raise FederatedError(f"secure_aggregation={secure_aggregation!r}: give True, a dict of "
                             "SecAggPlusWorkflow's options, or a SecAggPlusWorkflow")
    try:
        return SecAggPlusWorkflow(**options)
    except (TypeError, ValueError) as e:
        raise FederatedError(f"SecAggPlusWorkflow: {e}", hint="see flwr.server.workflow.SecAggPlusWorkflow") from None


def legacy_strategy_of(strategy, min_clients: int, initial: list[np.ndarray], **options):
    """The ``flwr.server.strategy`` class named ``strategy`` (``SECURE``), or a copy of a
    ``flwr.server.strategy.Strategy`` (``run_secure`` patches its methods; the caller's stays as it was)."""
    if isinstance(strategy, legacy_strategy.Strategy):
        return copy.copy(strategy)
    if not isinstance(strategy, str):
        raise FederatedError(f"secure_aggregation runs through Flower's SecAggPlusWorkflow, which takes the older "
                             f"flwr.server.strategy classes, not {type(strategy).__name__}",
                             hint=f"give a name ({', '.join(SECURE)}) or a flwr.server.strategy.Strategy")
    name = SECURE.get(strategy.lower())
    if name is None:
        raise FederatedError(f"strategy {strategy!r} with secure_aggregation: SecAgg+ shows the server only the "
                             f"weighted sum of the updates; choose one of {', '.join(SECURE)}")
    cls = getattr(legacy_strategy, name)
    options = {"min_fit_clients": min_clients, "min_evaluate_clients": min_clients,
               "min_available_clients": min_clients, "initial_parameters": ndarrays_to_parameters(initial),
               **same_defaults(cls, getattr(flwr_strategy, name)),
               **{OLDER_NAMES.get(k, k): v for k, v in options.items()}}
    try:
        return cls(**options)
    except TypeError as e:
        raise FederatedError(f"{name}: {e}", hint=f"see flwr.server.strategy.{name}'s options") from None


def same_defaults(older, newer) -> dict:
    """The defaults of the Message-API class ``newer`` where the older class of the same name has another
    (FedAdam's and FedAdagrad's ``tau``, FedProx's ``proximal_mu``): the same strategy with or without SecAgg+."""
    new = inspect.signature(newer).parameters
    return {k: new[k].default for k, p in inspect.signature(older).parameters.items()
            if k in new and new[k].default is not inspect.Parameter.empty and new[k].default != p.default}


def _as_expected(value, dtype, shape) -> np.ndarray:
    """The aggregate (float64, a 0-d tensor maybe as [1]) in the model's dtype and shape where its size fits."""
    value = np.asarray(value).astype(dtype)
    return value.reshape(shape) if value.size == int(np.prod(shape)) else value


def run_secure(grid, context, *, strategy, workflow: SecAggPlusWorkflow, initial: Mapping[str, np.ndarray],
               rounds: int, done: int, min_clients: int, timeout: float, train_config: Mapping | None,
               on_round: Callable[[int, dict], Mapping], **options):
    """``rounds`` rounds (after ``done``) of ``strategy`` under SecAgg+; ``on_round(server_round, tensors)``
    checkpoints and evaluates each round's global tensors (round 0: the initial ones) and returns metrics.
    Returns Flower's ``History``."""
    names = list(initial)
    expected = {n: (v.dtype, v.shape) for n, v in initial.items()}
    strat = legacy_strategy_of(strategy, min_clients, list(initial.values()), **options)
    aggregated: set[int] = set()
    init, aggregate = strat.initialize_parameters, strat.aggregate_fit

    def initialize_parameters(client_manager):
        init(client_manager)  # FedOpt keeps its own copy
        return ndarrays_to_parameters(list(initial.values()))

    def aggregate_fit(server_round, results, failures):
        if len(results) < min_clients:
            raise FederatedError(f"round {done + server_round}: {len(results)} client(s) sent an update under "
                                 f"SecAgg+, fewer than min_clients={min_clients}; the last good global model is kept",
                                 hint="see the clients' errors (an update SecAgg+ would clip is refused)")
        params, metrics = aggregate(server_round, results, failures)
        if params is not None:
            arrays = parameters_to_ndarrays(params)
            tensors = {n: _as_expected(a, *expected[n]) for n, a in zip(names, arrays)} if len(arrays) == len(
                names) else {}
            problem = mismatch(expected, tensors) if tensors else f"{len(arrays)} arrays, not {len(names)}"
            if problem:
                raise FederatedError(f"round {done + server_round}: the securely aggregated model is unusable: "
                                     f"{problem}; the last good global model is kept",
                                     hint="a client's update may lie beyond clipping_range")
            aggregated.add(server_round)
            params = ndarrays_to_parameters(list(tensors.values()))
        return params, metrics

    def evaluate(server_round, parameters):
        if server_round > 0 and server_round not in aggregated:
            raise FederatedError(f"round {done + server_round}: SecAgg+ did not complete (too few clients "
                                 "answered for its reconstruction threshold, or min_clients); the last good "
                                 "global model is kept", hint="see Flower's log lines above")
        tensors = dict(zip(names, parameters_to_ndarrays(parameters)))
        metrics = {k: float(v) for k, v in on_round(server_round, tensors).items()}
        return (metrics.pop("loss", 0.0), metrics) if metrics else None

    strat.initialize_parameters, strat.aggregate_fit, strat.evaluate = initialize_parameters, aggregate_fit, evaluate
    if getattr(strat, "on_fit_config_fn", False) is None:
        strat.on_fit_config_fn = lambda rnd: {"server-round": done + rnd, **dict(train_config or {})}
    legacy = LegacyContext(context, config=ServerConfig(num_rounds=rounds - done, round_timeout=timeout),
                           strategy=strat)
    DefaultWorkflow(fit_workflow=workflow)(grid, legacy)
    return legacy.history


__all__ = ["run_secure", "secure_workflow", "quantization_bound", "SECURE"]
