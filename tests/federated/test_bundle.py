"""A step bundle folder (``export-step``) as a federation's model: it shares the same tensors as the training
model it was made from and, on the same runtime, gives the same global model (1e-6 after two rounds); the
server's ``out/`` is itself a bundle holding the global tensors, and a restarted server resumes from it."""
from __future__ import annotations

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402

from onnx_autodiff import TrainingSession  # noqa: E402
from onnx_autodiff.driver.bundle import export_step  # noqa: E402
from onnx_autodiff.errors import FederatedError  # noqa: E402
from onnx_autodiff.federated import client_app, server_app  # noqa: E402
from onnx_autodiff.federated.bundle import BundleInfo  # noqa: E402
from onnx_autodiff.federated.model import FederatedModel  # noqa: E402
from onnx_autodiff.runtimes.loop import BundleTrainer  # noqa: E402
from tests.cli_models import mlp_training_model  # noqa: E402
from tests.federated.loop_grid import LoopGrid  # noqa: E402
from tests.federated.test_client_server import as_a_server, parts  # noqa: E402, F401

SIZES = [6, 10, 8]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    model = mlp_training_model("adam", lr=0.02, hidden=16, features=8, classes=3)
    folder = tmp_path_factory.mktemp("bundle")
    export_step(model, folder)
    return model, folder


def federate(model, out, runtime="onnxruntime", rounds=2, log=None, strategy="fedavg"):
    data = parts(SIZES)
    client = client_app(model, lambda p, n: data[p], runtime=runtime, batch_size=4)
    server = server_app(model, strategy, rounds=rounds, min_clients=len(SIZES), out=out, evaluate=data[0],
                        log=log or (lambda s: None))
    grid = LoopGrid(client, len(SIZES))
    server(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    assert not grid.errors, grid.errors
    return server


def test_a_bundle_shares_what_its_training_model_shares(made):
    model, folder = made
    fed, bundle = FederatedModel(model), FederatedModel(folder)
    assert bundle.names == fed.names and sorted(bundle.private) == sorted(fed.private)
    start = fed.initial_arrays()
    for name, value in bundle.initial_arrays().items():
        assert value.dtype == start[name].dtype and np.array_equal(value, start[name])


@pytest.mark.parametrize("runtime", ["onnxruntime", "reference"])
def test_a_bundle_federation_equals_the_training_model_federation(made, tmp_path, runtime):
    model, folder = made
    federate(model, tmp_path / "model", runtime)
    server = federate(folder, tmp_path / "bundle", runtime)
    want = TrainingSession(str(tmp_path / "model" / "checkpoint.onnx"), progress=False)
    got = BundleInfo(str(tmp_path / "bundle")).initial_arrays()  # out/ is a bundle: its init gives the tensors
    start = FederatedModel(model).initial_arrays()
    for name, value in got.items():
        np.testing.assert_allclose(value, want.get_state(name), rtol=0, atol=1e-6)
        assert not np.allclose(value, start[name])  # two rounds moved it
    assert [h["round"] for h in server.history] == [0, 1, 2]
    assert server.history[2]["loss"] < server.history[0]["loss"]


def test_the_servers_bundle_trains_on_and_resumes(made, tmp_path):
    _, folder = made
    lines = []
    federate(folder, tmp_path, rounds=1, log=lines.append)
    BundleTrainer(tmp_path, "onnxruntime").step(parts([4])[0])
    again = federate(folder, tmp_path, rounds=2, log=lines.append)
    assert "1 round(s) done" in " ".join(lines)
    assert [h["round"] for h in again.history] == [1, 2]


def test_what_a_bundle_cannot_do_is_our_error(made, tmp_path):
    _, folder = made
    with pytest.raises(FederatedError, match="no inference model"):
        server_app(folder, evaluate=lambda rnd, sess: {})
    data = parts(SIZES)
    server = server_app(folder, "fedprox", proximal_mu=0.1, rounds=1, min_clients=3)
    grid = LoopGrid(client_app(folder, lambda p, n: data[p], batch_size=4), 3)
    with pytest.raises(FederatedError, match="fewer than min_clients"):
        server(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    assert all("a step bundle cannot take it" in e for e in grid.errors) and len(grid.errors) == 3


def test_a_bundle_under_secagg_plus_on_reference(made, tmp_path):
    """The bundle's shared names are the order SecAgg+'s positional arrays take: one round of onnx.reference
    clients under SecAgg+ is the plain round within its bound."""
    from flwr.client.mod import secaggplus_mod

    from onnx_autodiff.federated.secure import quantization_bound
    _, folder = made
    secure = {"max_weight": float(max(SIZES)), "clipping_range": 4.0}
    data = parts(SIZES)
    got = {}
    for name, options in (("plain", None), ("secure", secure)):
        client = client_app(folder, lambda p, n: data[p], runtime="reference", batch_size=4,
                            mods=[secaggplus_mod] if options else [])
        server = server_app(folder, rounds=1, min_clients=3, out=tmp_path / name, secure_aggregation=options)
        grid = LoopGrid(client, len(SIZES))
        server(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
        assert not grid.errors, grid.errors
        got[name] = BundleInfo(str(tmp_path / name)).initial_arrays()
    bound = quantization_bound(SIZES, **secure)
    for name, value in got["plain"].items():
        float32 = np.finfo(np.float32).eps * float(np.max(np.abs(value)))
        np.testing.assert_allclose(got["secure"][name], value, rtol=0, atol=bound + 2 * float32)
