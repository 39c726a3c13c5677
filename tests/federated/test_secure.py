"""SecAgg+ (Flower's ``secaggplus_mod`` on our client, ``SecAggPlusWorkflow`` through ``server_app(...,
secure_aggregation=...)``): three clients give FedAvg's global model within SecAgg+'s quantization bound, our
checkpoints and evaluation run per round, and an update SecAgg+ would clip is refused. Rounds run in this
process against ``LoopGrid`` (no Ray): under a second each."""
from __future__ import annotations

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402
from flwr.client.mod import secaggplus_mod  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from onnx_autodiff import TrainingSession  # noqa: E402
from onnx_autodiff.errors import FederatedError  # noqa: E402
from onnx_autodiff.federated import client_app, server_app  # noqa: E402
from onnx_autodiff.federated.model import FederatedModel  # noqa: E402
from onnx_autodiff.federated.secure import quantization_bound  # noqa: E402
from tests.cli_models import mlp_training_model  # noqa: E402
from tests.federated.loop_grid import LoopGrid  # noqa: E402
from tests.federated.test_client_server import as_a_server, parts  # noqa: E402, F401

SIZES = [5, 9, 14]
SECAGG = {"max_weight": 14.0, "clipping_range": 4.0}


@pytest.fixture(scope="module")
def model():
    return mlp_training_model("sgd", lr=0.1, hidden=16, features=8, classes=3)


def federate(model, out, *, secure=None, rounds=1, sizes=SIZES, log=None, strategy="fedavg", grids=None,
             nodes=None, min_clients=None, **options):
    data = parts(sizes)
    nodes = nodes or len(sizes)
    client = client_app(model, lambda p, n: data[p], batch_size=4, mods=[secaggplus_mod] if secure else [])
    server = server_app(model, strategy, rounds=rounds, min_clients=min_clients or nodes, out=out,
                        evaluate=data[0], secure_aggregation=secure, log=log or (lambda s: None), **options)
    grid = LoopGrid(client, nodes)
    if grids is not None:
        grids.append(grid)
    server(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    sess = TrainingSession(str(out / "checkpoint.onnx"), progress=False)
    return server, {n: sess.get_state(n) for n in FederatedModel(model).names}, grid


@pytest.mark.parametrize("strategy, options", [("fedavg", {}), ("fedprox", {"proximal_mu": 0.5})])
def test_secagg_plus_gives_fedavg_within_its_quantization_bound(model, tmp_path, strategy, options):
    """FedProx too: Flower's older FedProx sends ``proximal_mu``, which the client takes as ``proximal-mu``."""
    _, plain, _ = federate(model, tmp_path / "plain", strategy=strategy, **options)
    server, secure, grid = federate(model, tmp_path / "secure", secure=SECAGG, strategy=strategy, **options)
    assert not grid.errors
    start = FederatedModel(model).initial_arrays()
    bound = quantization_bound(SIZES, **SECAGG)
    assert bound < 1e-5  # 3 * 3 * 4 / (2**22 * 2): the test is not vacuous
    for name, value in plain.items():
        float32 = np.finfo(np.float32).eps * float(np.max(np.abs(value)))  # both means are rounded to float32
        np.testing.assert_allclose(secure[name], value, rtol=0, atol=bound + 2 * float32)
        assert np.max(np.abs(value - start[name])) > 100 * bound  # the round moved the model much further
    assert any(not np.array_equal(secure[k], plain[k]) for k in plain)  # it did go through the quantization
    assert [h["round"] for h in server.history] == [0, 1] and "loss" in server.history[-1]
    assert type(server.result).__name__ == "History"


@pytest.mark.parametrize("strategy", ["fedadam", "fedyogi", "fedadagrad", "fedavgm"])
def test_the_server_optimizers_run_under_secagg_plus(model, tmp_path, strategy):
    server, secure, grid = federate(model, tmp_path, secure=SECAGG, strategy=strategy, rounds=2)
    start = FederatedModel(model).initial_arrays()
    assert not grid.errors and [h["round"] for h in server.history] == [0, 1, 2]
    assert all(np.all(np.isfinite(v)) for v in secure.values())
    assert any(not np.allclose(secure[k], start[k]) for k in start)


def test_secagg_plus_rounds_checkpoint_and_resume(model, tmp_path):
    lines = []
    server, _, _ = federate(model, tmp_path, secure=SECAGG, rounds=2, log=lines.append)
    assert [h["round"] for h in server.history] == [0, 1, 2]
    assert server.history[2]["loss"] < server.history[0]["loss"]
    assert (tmp_path / "model.onnx").exists()
    again, _, _ = federate(model, tmp_path, secure=SECAGG, rounds=3, log=lines.append)
    assert "2 round(s) done" in " ".join(lines)
    assert [h["round"] for h in again.history] == [2, 3]


def test_an_update_secagg_would_clip_is_refused_and_the_round_stops(model, tmp_path):
    start = FederatedModel(model).initial_arrays()
    top = max(float(np.max(np.abs(v))) for v in start.values())
    secure = {"max_weight": 14.0, "clipping_range": top / 10}  # weights 5/14 .. 1: every update lies beyond
    grids = []
    with pytest.raises(FederatedError, match="round 1: SecAgg\\+ did not complete"):
        federate(model, tmp_path, secure=secure, grids=grids)
    assert not (tmp_path / "checkpoint.onnx").exists()
    errors = grids[0].errors
    assert len(errors) == 3 and all("SecAgg+ would clip" in e and "clipping_range" in e for e in errors)


def test_a_client_that_drops_out_leaves_the_mean_of_the_others(model, tmp_path):
    """The client of weight 14/14 refuses (its update lies beyond clipping_range, the others' weights 5/14 and
    9/14 keep theirs inside): SecAgg+ removes its masks from its neighbours' shares, and the round gives the
    FedAvg of the other two within the bound for two clients; with min_clients=3 the round stops."""
    start = FederatedModel(model).initial_arrays()
    top = max(float(np.max(np.abs(v))) for v in start.values())
    secure = {"max_weight": 14.0, "clipping_range": 0.8 * top}
    grids = []
    _, got, _ = federate(model, tmp_path / "secure", secure=secure, min_clients=2, grids=grids)
    assert len(grids[0].errors) == 1 and grids[0].errors[0].startswith("node 3: SecAgg+ would clip")
    _, want, _ = federate(model, tmp_path / "plain", nodes=2)  # partitions 0 and 1 alone
    bound = quantization_bound(SIZES[:2], **secure)
    for name, value in want.items():
        float32 = np.finfo(np.float32).eps * float(np.max(np.abs(value)))
        np.testing.assert_allclose(got[name], value, rtol=0, atol=bound + 2 * float32)
    with pytest.raises(FederatedError, match="round 1: 2 client\\(s\\) sent an update under SecAgg\\+, fewer than "
                                             "min_clients=3"):
        federate(model, tmp_path / "three", secure=secure)


def test_an_older_strategy_instance_runs_as_it_is_and_stays_unpatched(model, tmp_path):
    from flwr.server.strategy import FedAvg as OlderFedAvg
    mine = OlderFedAvg(min_fit_clients=3, min_available_clients=3, min_evaluate_clients=3)
    _, got, grid = federate(model, tmp_path / "mine", secure=SECAGG, strategy=mine)
    _, plain, _ = federate(model, tmp_path / "plain")
    assert not grid.errors
    bound = quantization_bound(SIZES, **SECAGG)
    for name, value in plain.items():
        float32 = np.finfo(np.float32).eps * float(np.max(np.abs(value)))
        np.testing.assert_allclose(got[name], value, rtol=0, atol=bound + 2 * float32)
    assert "aggregate_fit" not in vars(mine) and "evaluate" not in vars(mine)  # run_secure patched a copy


def test_a_client_without_the_mod_says_it_needs_it(model, tmp_path):
    data = parts(SIZES)
    server = server_app(model, rounds=1, min_clients=3, secure_aggregation=SECAGG)
    grid = LoopGrid(client_app(model, lambda p, n: data[p], batch_size=4), 3)
    with pytest.raises(FederatedError, match="SecAgg\\+ did not complete"):
        server(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    assert len(grid.errors) == 3 and all("mods=[secaggplus_mod]" in e for e in grid.errors)


def test_strategies_secagg_cannot_run_are_our_error(model, tmp_path):
    with pytest.raises(FederatedError, match="only the weighted sum"):
        server_app(model, "fedmedian", secure_aggregation=True)
    with pytest.raises(FederatedError, match="not FedAvg"):
        server_app(model, FedAvg(), secure_aggregation=True)
    with pytest.raises(FederatedError, match="FedAdam: .*no_such_option"):
        server_app(model, "fedadam", secure_aggregation=True, no_such_option=1)
    with pytest.raises(FederatedError, match="SecAggPlusWorkflow"):
        server_app(model, secure_aggregation={"num_shares": 2})


@pytest.mark.slow
def test_secagg_plus_under_a_ray_simulation(model, tmp_path):
    """Flower's own simulation (Ray, three SuperNodes): the same round as in process, within the bound. Slow:
    Ray starts (about 1 minute at load 12 on 2 cores)."""
    import onnx
    from flwr.simulation import run_simulation

    path = tmp_path / "train.onnx"
    onnx.save(model, path)
    data = parts(SIZES)

    def partition(p, n):
        return data[p]

    client = client_app(path, partition, batch_size=4, mods=[secaggplus_mod])
    server = server_app(path, "fedavg", rounds=1, min_clients=3, out=tmp_path / "ray", evaluate=data[0],
                        secure_aggregation=SECAGG, log=lambda s: None)
    run_simulation(server_app=server, client_app=client, num_supernodes=3,
                   backend_config={"client_resources": {"num_cpus": 1}})
    assert [h["round"] for h in server.history] == [0, 1]
    sess = TrainingSession(str(tmp_path / "ray" / "checkpoint.onnx"), progress=False)
    _, plain, _ = federate(model, tmp_path / "plain")
    bound = quantization_bound(SIZES, **SECAGG)
    for name, value in plain.items():
        float32 = np.finfo(np.float32).eps * float(np.max(np.abs(value)))
        np.testing.assert_allclose(sess.get_state(name), value, rtol=0, atol=bound + 2 * float32)


def test_cli_simulate_takes_secure_aggregation(model, tmp_path, monkeypatch, capsys):
    """``federated simulate --secure-aggregation``: the clients get secaggplus_mod and the server SecAgg+'s
    workflow (with the flag on one side only, the round fails: the client's handler refuses a SecAgg+ message).
    Flower's simulation is replaced by LoopGrid, so no Ray starts."""
    import flwr.simulation
    import onnx

    from onnx_autodiff.cli import main

    def in_process(server_app, client_app, num_supernodes, **_):
        server_app(LoopGrid(client_app, num_supernodes),
                   Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))

    monkeypatch.setattr(flwr.simulation, "run_simulation", in_process)
    path, folder = tmp_path / "train.onnx", tmp_path / "parts"
    onnx.save(model, path)
    folder.mkdir()
    for i, part in enumerate(parts(SIZES)):
        np.savez(folder / f"client-{i}.npz", **part)
    states = {}
    for side, flags in (("plain", []), ("secure", ["--secure-aggregation"])):
        assert main(["federated", "simulate", str(path), "--data-dir", str(folder), "--rounds", "1",
                     "--batch-size", "4", "--out", str(tmp_path / side), *flags]) == 0
        sess = TrainingSession(str(tmp_path / side / "checkpoint.onnx"), progress=False)
        states[side] = {n: sess.get_state(n) for n in FederatedModel(model).names}
    bound = quantization_bound(SIZES)  # SecAgg+'s defaults: clipping range 8, max weight 1000
    assert any(not np.array_equal(states["secure"][n], v) for n, v in states["plain"].items())  # it was SecAgg+
    for name, value in states["plain"].items():
        float32 = np.finfo(np.float32).eps * float(np.max(np.abs(value)))
        np.testing.assert_allclose(states["secure"][name], value, rtol=0, atol=bound + 2 * float32)
