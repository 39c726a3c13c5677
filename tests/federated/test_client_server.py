"""The federated client and server against the formulas: a round of one client is a centralized step, FedAvg
is numpy's weighted mean, FedProx's term is mu * (w - w_global) in the gradient, bad updates are left out."""
from __future__ import annotations

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from onnx_autodiff import TrainingSession  # noqa: E402
from onnx_autodiff.errors import FederatedError  # noqa: E402
from onnx_autodiff.federated import client_app, make_strategy  # noqa: E402
from onnx_autodiff.federated.client import to_record, unpack  # noqa: E402
from onnx_autodiff.federated.model import FederatedModel, LocalTrainer  # noqa: E402
from onnx_autodiff.federated.proximal import anchor_name, local_fit  # noqa: E402
from onnx_autodiff.federated.server import guard  # noqa: E402
from tests.cli_models import digits_like, mlp_training_model  # noqa: E402

LR = 0.1


@pytest.fixture(autouse=True)
def as_a_server():
    """Messages made outside a Flower process need the identity Flower's runtime would set."""
    from flwr.supercore.task_identity import TaskIdentity
    saved = TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


@pytest.fixture(scope="module")
def model():
    return mlp_training_model("sgd", lr=LR, hidden=16, features=8, classes=3)


def parts(sizes, seed=1):
    x, y = digits_like(sum(sizes), features=8, classes=3, seed=seed)
    edges = np.cumsum([0] + list(sizes))
    return [{"x": x[a:b], "labels": y[a:b]} for a, b in zip(edges[:-1], edges[1:])]


def call(app, kind, arrays, node, parts_, config=None, state=None):
    msg = Message(content=RecordDict({"arrays": to_record(arrays), "config": ConfigRecord(config or {})}),
                  dst_node_id=node + 1, message_type=kind)
    ctx = Context(run_id=1, node_id=node + 1, node_config={"partition-id": node, "num-partitions": len(parts_)},
                  state=state if state is not None else RecordDict(), run_config={})
    reply = app(msg, ctx)
    assert not reply.has_error(), reply.error
    return reply


def arrays_of(reply):
    return {k: v.numpy() for k, v in reply.content.array_records["arrays"].items()}


def test_one_client_one_round_is_one_centralized_step(model):
    data = parts([24])
    app = client_app(model, lambda p, n: data[p], local_epochs=1, batch_size=24)
    fed = FederatedModel(model)
    start = fed.initial_arrays()
    got = arrays_of(call(app, "train", start, 0, data, {"server-round": 1}))
    sess = TrainingSession(model, progress=False)
    sess.step({"x": data[0]["x"], "labels": data[0]["labels"]})
    assert set(got) == {"W1", "b1", "W2", "b2"}
    for name, value in got.items():
        np.testing.assert_allclose(value, sess.get_state(name), rtol=0, atol=1e-6)
        assert not np.array_equal(value, start[name])  # the step moved it


def test_fedavg_of_three_clients_is_the_weighted_mean(model):
    data = parts([5, 9, 14])
    app = client_app(model, lambda p, n: data[p], local_epochs=1, batch_size=4)
    start = FederatedModel(model).initial_arrays()
    replies = [call(app, "train", start, k, data, {"server-round": 1}) for k in range(3)]
    counts = [r.content.metric_records["metrics"]["num-examples"] for r in replies]
    assert counts == [5, 9, 14]
    agg, _ = FedAvg().aggregate_train(1, replies)
    mine = [arrays_of(r) for r in replies]
    for name, value in agg.items():
        want = sum(c * m[name].astype(np.float64) for c, m in zip(counts, mine)) / sum(counts)
        np.testing.assert_allclose(value.numpy(), want, rtol=0, atol=1e-7)


def test_fedprox_adds_mu_times_the_distance_to_the_global_weights(model):
    fed = FederatedModel(model)
    data = parts([12])[0]
    start = fed.initial_arrays()
    anchor = {k: v + np.float32(0.25) for k, v in start.items()}
    after = {}
    for mu in (0.0, 0.5):
        local = LocalTrainer(fed, proximal=True)
        local.set(start)
        local_fit(local, data, epochs=1, batch_size=12, seed=[0], mu=mu, anchor=anchor)
        after[mu] = local.get(fed.names)
        assert local.get([anchor_name("W1")])[anchor_name("W1")].tolist() == anchor["W1"].tolist()
    for name in fed.names:  # SGD: w1 = w0 - lr * (g + mu * (w0 - anchor))
        np.testing.assert_allclose(after[0.5][name] - after[0.0][name], -LR * 0.5 * (start[name] - anchor[name]),
                                   rtol=0, atol=1e-6)


def test_optimizer_state_stays_on_the_node_between_rounds():
    model = mlp_training_model("adam", lr=0.01, hidden=16, features=8, classes=3)
    data = parts([8])
    app = client_app(model, lambda p, n: data[p], batch_size=8)
    fed = FederatedModel(model)
    assert fed.private and all(n not in fed.names for n in fed.private)
    state = RecordDict()
    first = arrays_of(call(app, "train", fed.initial_arrays(), 0, data, {"server-round": 1}, state))
    kept = unpack(state.array_records["onnx_autodiff.optimizer"], LocalTrainer(fed).start)
    assert set(kept) == set(fed.private) and any(np.any(v != 0) for v in kept.values())
    again = arrays_of(call(app, "train", first, 0, data, {"server-round": 2}, state))
    fresh = arrays_of(call(app, "train", first, 0, data, {"server-round": 2}, RecordDict()))
    assert any(not np.allclose(again[k], fresh[k]) for k in again)  # the moments carried over


def test_a_bad_update_is_left_out_with_a_line_naming_the_node(model):
    data = parts([6, 6, 6])
    app = client_app(model, lambda p, n: data[p], batch_size=6)
    start = FederatedModel(model).initial_arrays()
    replies = [call(app, "train", start, k, data, {"server-round": 1}) for k in range(3)]
    bad = arrays_of(replies[1])
    bad["W1"][0, 0] = np.nan
    replies[1].content["arrays"] = to_record(bad)
    lines = []
    expected = {k: (v.dtype, v.shape) for k, v in start.items()}
    agg, _ = guard(FedAvg(), expected, 2, lines.append).aggregate_train(1, replies)
    assert len(lines) == 1 and "'W1' holds NaN or Inf" in lines[0]
    good = [arrays_of(replies[0]), arrays_of(replies[2])]
    np.testing.assert_allclose(agg["W2"].numpy(), (good[0]["W2"] + good[1]["W2"]) / 2, atol=1e-7)
    wrong = arrays_of(replies[2])
    wrong["b1"] = wrong["b1"][:3]
    replies[2].content["arrays"] = to_record(wrong)
    with pytest.raises(FederatedError, match="fewer than min_clients=2"):
        guard(FedAvg(), expected, 2, lines.append).aggregate_train(1, replies)
    assert "is float32 [3], the model's is float32 [16]" in lines[-1]


def test_strategies_by_name_and_bad_names():
    assert type(make_strategy("fedprox", 3, proximal_mu=0.1)).__name__ == "FedProx"
    assert make_strategy("FedAdam", 2).min_train_nodes == 2
    with pytest.raises(FederatedError, match="unknown strategy 'fedfoo'"):
        make_strategy("fedfoo", 2)
    with pytest.raises(FederatedError, match="FedAvg"):
        make_strategy("fedavg", 2, no_such_option=1)


def test_a_missing_partition_file_is_our_error(model, tmp_path):
    app = client_app(model, tmp_path, batch_size=4)
    with pytest.raises(Exception, match="no file .*client-0.npz"):
        call(app, "train", FederatedModel(model).initial_arrays(), 0, [None])


def test_fixed_clipping_mod_bounds_the_sent_update(model):
    from flwr.clientapp.mod import fixedclipping_mod
    data = parts([16])
    start = FederatedModel(model).initial_arrays()
    app = client_app(model, lambda p, n: data[p], batch_size=4, local_epochs=3, mods=[fixedclipping_mod])
    free = client_app(model, lambda p, n: data[p], batch_size=4, local_epochs=3)
    clip = 0.01
    sent = arrays_of(call(app, "train", start, 0, data, {"server-round": 1, "clipping_norm": clip}))
    raw = arrays_of(call(free, "train", start, 0, data, {"server-round": 1}))
    norm = lambda a: np.sqrt(sum(float(np.sum((a[k] - start[k]) ** 2)) for k in start))  # noqa: E731
    assert norm(raw) > clip  # the clipping had something to do
    assert norm(sent) <= clip * (1 + 1e-5)


def test_cli_simulate_without_partitions_is_our_error(model, tmp_path, capsys):
    from onnx_autodiff.cli import main
    path = tmp_path / "train.onnx"
    import onnx
    onnx.save(model, path)
    (tmp_path / "parts").mkdir()
    assert main(["federated", "simulate", str(path), "--data-dir", str(tmp_path / "parts")]) == 2
    assert "holds no client-0.npz" in capsys.readouterr().err


def test_federated_new_writes_a_flower_app_flower_accepts(model, tmp_path, capsys):
    import importlib
    import sys

    import onnx
    from flwr.clientapp import ClientApp
    from flwr.common.config import get_project_config, validate_config
    from flwr.serverapp import ServerApp

    from onnx_autodiff.cli import main
    path = tmp_path / "train.onnx"
    onnx.save(model, path)
    app_dir = tmp_path / "my-app"
    assert main(["federated", "new", str(app_dir), "--model", str(path), "--data-dir", str(tmp_path),
                 "--clients", "3"]) == 0
    assert "flwr run" in capsys.readouterr().out
    config = get_project_config(app_dir)
    ok, errors, _ = validate_config(config, check_module=True, project_dir=app_dir)
    assert ok, errors
    sys.path.insert(0, str(app_dir))
    try:
        server = importlib.import_module("my_app.server_app").app
        client = importlib.import_module("my_app.client_app").app
    finally:
        sys.path.remove(str(app_dir))
    assert isinstance(server, ServerApp) and isinstance(client, ClientApp)
    assert main(["federated", "new", str(app_dir), "--model", str(path), "--data-dir", str(tmp_path)]) == 2


def test_the_apps_run_config_sets_each_clients_epochs_and_batch(model, tmp_path, monkeypatch):
    """The App's client once hard-coded batch_size=32 and local_epochs=1; now `federated new --local-epochs
    --batch-size` write them in the run config, which flwr run --run-config overrides, and the server sends them
    with every round."""
    import importlib
    import sys

    import onnx
    from flwr.common.config import get_project_config

    from onnx_autodiff.cli import main
    path = tmp_path / "train.onnx"
    onnx.save(model, path)
    app_dir = tmp_path / "epochs-app"
    assert main(["federated", "new", str(app_dir), "--model", str(path), "--data-dir", str(tmp_path),
                 "--local-epochs", "3", "--batch-size", "8"]) == 0
    config = dict(get_project_config(app_dir)["tool"]["flwr"]["app"]["config"])
    assert (config["local-epochs"], config["batch-size"]) == (3, 8)
    sys.path.insert(0, str(app_dir))
    try:
        module = importlib.import_module("epochs_app.server_app")
    finally:
        sys.path.remove(str(app_dir))
    made = {}
    monkeypatch.setattr(module, "server_app", lambda *a, **kw: made.update(kw) or (lambda grid, context: None))
    module.main(None, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                              run_config={**config, "batch-size": 4}))  # as flwr run --run-config 'batch-size=4'
    assert made["train_config"] == {"local-epochs": 3, "batch-size": 4}
    data = parts([12])
    app = client_app(model, lambda p, n: data[p])
    start = FederatedModel(model).initial_arrays()
    steps = {}
    for kind, sent in (("plain", {}), ("sent", made["train_config"])):
        reply = call(app, "train", start, 0, data, {"server-round": 1, **sent})
        steps[kind] = arrays_of(reply)
    assert any(not np.array_equal(steps["plain"][k], steps["sent"][k]) for k in start)  # the config was used
    assert main(["federated", "new", str(tmp_path / "bad"), "--model", str(path), "--data-dir", str(tmp_path),
                 "--batch-size", "0"]) == 2


def test_fedadam_aggregates_go_out_in_the_models_dtypes(model):
    data = parts([6, 6])
    app = client_app(model, lambda p, n: data[p], batch_size=6)
    start = FederatedModel(model).initial_arrays()
    replies = [call(app, "train", start, k, data, {"server-round": 1}) for k in range(2)]
    strategy = make_strategy("fedadam", 2)
    strategy.current_arrays = {k: v.astype(np.float64) for k, v in start.items()}  # as start() sets it
    expected = {k: (v.dtype, v.shape) for k, v in start.items()}
    agg, _ = guard(strategy, expected, 2, lambda s: None).aggregate_train(1, replies)
    assert {k: v.numpy().dtype for k, v in agg.items()} == {k: np.dtype(np.float32) for k in start}
    call(app, "train", {k: v.numpy() for k, v in agg.items()}, 0, data, {"server-round": 2})


def test_the_nodes_own_state_packs_and_unpacks_exactly():
    like = {"m": np.arange(6, dtype=np.float32).reshape(2, 3), "t": np.array(7, np.int64),
            "v": np.full((4,), -1.5, np.float32)}
    from onnx_autodiff.federated.client import pack
    back = unpack(pack(like), {k: np.zeros_like(v) for k, v in like.items()})
    assert list(back) == list(like)
    for k, v in like.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and np.array_equal(back[k], v)


def test_local_dp_mod_noises_our_clients_update(model):
    from flwr.clientapp.mod import LocalDpMod
    data = parts([16])
    start = FederatedModel(model).initial_arrays()
    mod = LocalDpMod(clipping_norm=0.05, sensitivity=0.05, epsilon=1.0, delta=1e-5)
    noisy = arrays_of(call(client_app(model, lambda p, n: data[p], batch_size=4, mods=[mod]), "train", start, 0,
                           data, {"server-round": 1}))
    plain = arrays_of(call(client_app(model, lambda p, n: data[p], batch_size=4), "train", start, 0, data,
                           {"server-round": 1}))
    assert list(noisy) == list(start) and all(noisy[k].shape == start[k].shape for k in start)
    assert all(np.all(np.isfinite(v)) for v in noisy.values())
    assert any(not np.allclose(noisy[k], plain[k]) for k in start)  # the mechanism acted on our update


def test_each_client_app_trains_on_its_own_data(model):
    """A process caches each node's partition; a data function collected and replaced by a new one at the same
    id must not be handed the old one's arrays."""
    start = FederatedModel(model).initial_arrays()
    for k in range(6):
        data = parts([4 + k])
        app = client_app(model, lambda p, n, mine=data: mine[p], batch_size=4)
        reply = call(app, "train", start, 0, data, {"server-round": 1})
        assert reply.content.metric_records["metrics"]["num-examples"] == 4 + k
        del app
