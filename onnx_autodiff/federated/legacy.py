"""The client's side of Flower's older message format (``fitins.*`` / ``fitres.*`` records of positional arrays),
which Flower's ``DefaultWorkflow`` and its ``SecAggPlusWorkflow`` send in Flower 1.42 (``secure.py``).

Arrays arrive in the order the server sent them: the model's shared names (``FederatedModel.names``). Under
SecAgg+ (``secaggplus_mod`` on the client) an update is quantized after scaling by its weight
``num_examples / max_weight``, and values beyond ``clipping_range`` are clipped silently; the client refuses to
send such an update, or one holding NaN/Inf, with our error (the node then counts as dropped for the round).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import FederatedError

try:
    from flwr.app import Message, RecordDict
    from flwr.common import Code, EvaluateRes, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE
    from flwr.compat.common import recorddict_compat as compat
except ImportError as e:  # pragma: no cover - the federated extra
    raise FederatedError(f"Flower is not installed ({e})", hint="pip install 'onnx-autodiff[federated]'") from None

PREFIXES = ("fitins", "evaluateins")


def is_legacy(msg: Message) -> bool:
    return any(f"{p}.parameters" in msg.content.array_records for p in PREFIXES)


def incoming(msg: Message, names: Sequence[str]) -> tuple[dict[str, np.ndarray], dict]:
    """The named global tensors and the config of a ``fitins`` / ``evaluateins`` message."""
    prefix = next(p for p in PREFIXES if f"{p}.parameters" in msg.content.array_records)
    convert = compat.recorddict_to_fitins if prefix == "fitins" else compat.recorddict_to_evaluateins
    ins = convert(msg.content, keep_input=True)
    arrays = parameters_to_ndarrays(ins.parameters)
    if len(arrays) != len(names):
        raise FederatedError(f"the server sent {len(arrays)} arrays; the model shares {len(names)}",
                             hint="the server and the clients must use the same model")
    config = dict(ins.config)
    if "proximal_mu" in config:  # Flower's older FedProx
        config.setdefault("proximal-mu", config["proximal_mu"])
    return dict(zip(names, arrays)), config


def unexpected(msg: Message) -> str:
    """Why a message that carries no global tensors reached the client's handler."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return ("a SecAgg+ message reached the client's handler: the server runs secure_aggregation, so the client "
                "needs Flower's mod (client_app(..., mods=[secaggplus_mod]), from flwr.client.mod)")
    return (f"the message carries no 'arrays' record (it has {sorted(msg.content.array_records)}): it is not from "
            "our server_app")


def check_secure(arrays: Mapping[str, np.ndarray], n: int, state: RecordDict) -> None:
    """Refuse an update SecAgg+ would clip or garble: it scales each tensor by its quantized weight
    ``round(n / max_weight * quantization_range) / quantization_range`` and clips to ``[-clipping_range,
    clipping_range]``."""
    sa = state.config_records.get(RECORD_KEY_STATE)
    if sa is None or "clipping_range" not in sa:
        return
    clip, target, most = float(sa["clipping_range"]), int(sa["target_range"]), float(sa["max_weight"])
    weight = round(n / most * target) / target
    for name, value in arrays.items():
        if not np.all(np.isfinite(value)):
            raise FederatedError(f"the update's {name!r} holds NaN or Inf: not sent (SecAgg+ would hide it in "
                                 "the sum)", hint="lower the learning rate")
        top = float(np.max(np.abs(value))) * weight if value.size else 0.0
        if top > clip:
            raise FederatedError(f"SecAgg+ would clip {name!r}: max |value| x weight {n}/{most:g} is {top:.4g}, "
                                 f"beyond clipping_range {clip:g}",
                                 hint="raise clipping_range (its quantization error grows with it) or max_weight")


def fit_reply(msg: Message, arrays: Sequence[np.ndarray], n: int, metrics: Mapping) -> Message:
    res = FitRes(Status(Code.OK, "OK"), ndarrays_to_parameters(list(arrays)), n, dict(metrics))
    return Message(content=compat.fitres_to_recorddict(res, keep_input=False), reply_to=msg)


def evaluate_reply(msg: Message, metrics: Mapping, n: int) -> Message:
    metrics = {k: float(v) for k, v in metrics.items()}
    res = EvaluateRes(Status(Code.OK, "OK"), float(metrics.get("loss", 0.0)), n, metrics)
    return Message(content=compat.evaluateres_to_recorddict(res), reply_to=msg)


__all__ = ["is_legacy", "incoming", "unexpected", "check_secure", "fit_reply", "evaluate_reply"]
