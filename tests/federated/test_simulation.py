"""A Flower simulation (Ray) of our ServerApp and ClientApp: rounds, centralized evaluation, the checkpoint of
every round, the final inference model, and a restarted server that continues from its last round. Slow: Ray
starts twice (2 min at load 11 on 2 cores, mostly waiting)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

flwr = pytest.importorskip("flwr")

from flwr.simulation import run_simulation  # noqa: E402

from onnx_autodiff.federated import client_app, server_app  # noqa: E402
from tests.cli_models import digits_like, mlp_training_model  # noqa: E402


@pytest.mark.slow
def test_simulation_trains_checkpoints_and_resumes(tmp_path):
    model = mlp_training_model("adam", lr=0.05, hidden=16, features=8, classes=3)
    path = tmp_path / "train.onnx"
    onnx.save(model, path)
    x, y = digits_like(96, features=8, classes=3, seed=2)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0)  # a learnable rule
    test = {"x": x[:32], "labels": y[:32]}

    def data(p, n):
        return {"x": x[32 + p::n], "labels": y[32 + p::n]}

    client = client_app(path, data, local_epochs=2, batch_size=8)
    out = tmp_path / "global"
    lines = []
    server = server_app(path, "fedavg", rounds=2, min_clients=2, evaluate=test, out=out, log=lines.append)
    run_simulation(server_app=server, client_app=client, num_supernodes=2,
                   backend_config={"client_resources": {"num_cpus": 1}})
    assert [h["round"] for h in server.history] == [0, 1, 2], lines
    assert server.history[-1]["loss"] < server.history[0]["loss"]
    assert lines[-1].startswith("round 2/2: loss ")
    sess = ort.InferenceSession(str(out / "model.onnx"))
    logits = sess.run(None, {"x": test["x"]})[0]
    assert logits.shape == (32, 3)

    again = server_app(path, "fedavg", rounds=3, min_clients=2, evaluate=test, out=out, log=lines.append)
    run_simulation(server_app=again, client_app=client, num_supernodes=2,
                   backend_config={"client_resources": {"num_cpus": 1}})
    assert "resuming from" in " ".join(lines) and "2 round(s) done" in " ".join(lines)
    assert [h["round"] for h in again.history] == [2, 3]
    np.testing.assert_allclose(again.history[0]["loss"], server.history[-1]["loss"], rtol=1e-6)
