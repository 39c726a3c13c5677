"""Clients on different runtimes in one federation: onnxruntime, onnx.reference and OpenVINO clients give the
global model an all-onnxruntime federation gives (within the runtimes' own agreement, 1e-5); so do tract and
onnxruntime-node clients beside an onnxruntime one (each skipped, with what to install, where missing; CI has
both, and ``ONNX_AUTODIFF_REQUIRE_JS=1`` makes a missing onnxruntime-node a failure)."""
from __future__ import annotations

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

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


@pytest.fixture(scope="module")
def fleet():
    """The model, the partitions and the global model of an all-onnxruntime federation."""
    from flwr.supercore.task_identity import TaskIdentity
    model = mlp_training_model("adam", lr=0.01, hidden=16, features=8, classes=3)
    data = parts([8, 12, 10])
    saved = TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0  # as as_a_server does
    try:
        return model, data, _federate(model, data, "onnxruntime")
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def _same_global(mixed, same, rounds_alike=False):
    for name, value in same.items():
        np.testing.assert_allclose(mixed[name], value, rtol=0, atol=1e-5)
    if not rounds_alike:  # the other runtimes did compute: their float rounding differs from onnxruntime's
        assert any(not np.array_equal(mixed[k], same[k]) for k in same)


def _steps(runtime):
    """Steps taken by this process's client trainers on ``runtime``."""
    from onnx_autodiff.federated import client
    return sum(t.trainer.steps for t in client._made.values() if getattr(t, "runtime", None) == runtime)


def test_a_mixed_fleet_matches_an_onnxruntime_fleet(fleet):
    pytest.importorskip("openvino")
    model, data, same = fleet
    _same_global(_federate(model, data, lambda p: RUNTIMES[p]), same)


@pytest.mark.parametrize("runtime", ["tract", "onnxruntime-node"])
def test_tract_and_node_clients_match_an_onnxruntime_fleet(fleet, runtime):
    if runtime == "onnxruntime-node":
        from tests.js_runtime import node
        node()  # skips (fails under ONNX_AUTODIFF_REQUIRE_JS=1) with what to install
    else:
        pytest.importorskip("tract")
    model, data, same = fleet
    before = _steps(runtime)
    mixed = _federate(model, data, lambda p: "onnxruntime" if p == 0 else runtime)
    assert _steps(runtime) - before == 2 * (3 + 3)  # two rounds of clients 1 and 2 (12 and 10 samples, batch 4)
    # onnxruntime-node runs onnxruntime's own kernels: it may round exactly as the Python package does
    _same_global(mixed, same, rounds_alike=runtime == "onnxruntime-node")
