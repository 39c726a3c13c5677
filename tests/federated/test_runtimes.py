"""Clients on different runtimes in one federation: onnxruntime, onnx.reference and OpenVINO clients give the
global model an all-onnxruntime federation gives (within the runtimes' own agreement, 1e-5)."""
from __future__ import annotations

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")
pytest.importorskip("openvino")

from flwr.app import RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from onnx_autodiff.federated import client_app  # noqa: E402
from onnx_autodiff.federated.model import FederatedModel  # noqa: E402
from tests.cli_models import mlp_training_model  # noqa: E402
from tests.federated.test_client_server import as_a_server, call, parts  # noqa: E402, F401

RUNTIMES = ["onnxruntime", "reference", "openvino"]


def _federate(model, data, runtime, rounds=2):
    app = client_app(model, lambda p, n: data[p], runtime=runtime, batch_size=4)
    arrays = FederatedModel(model).initial_arrays()
    states = [RecordDict() for _ in data]
    for rnd in range(1, rounds + 1):
        replies = [call(app, "train", arrays, k, data, {"server-round": rnd}, states[k]) for k in range(len(data))]
        agg, _ = FedAvg().aggregate_train(rnd, replies)
        arrays = {k: v.numpy() for k, v in agg.items()}
    return arrays


def test_a_mixed_fleet_matches_an_onnxruntime_fleet():
    model = mlp_training_model("adam", lr=0.01, hidden=16, features=8, classes=3)
    data = parts([8, 12, 10])
    same = _federate(model, data, "onnxruntime")
    mixed = _federate(model, data, lambda p: RUNTIMES[p])
    for name, value in same.items():
        np.testing.assert_allclose(mixed[name], value, rtol=0, atol=1e-5)
    # the other runtimes did compute: their float rounding differs from onnxruntime's somewhere
    assert any(not np.array_equal(mixed[k], same[k]) for k in same)
