"""A Flower deployment of the App ``onnx-autodiff federated new`` writes, as real processes on 127.0.0.1: a
SuperLink, three SuperNodes and ``flwr run DIR local-deployment`` train 3 rounds; one SuperNode is killed with
SIGKILL while it holds its round-2 train message, and the run finishes with the other two (min-clients 2) with the
global model on disk intact. Free ports are picked at run time, Flower's home is a temporary folder (nothing
touches ~/.flwr), every process group is killed in the end, and every wait has a deadline. Slow: each message
starts a ``flwr-clientapp`` process, and the SuperLink needs a minute to call the killed node offline."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

pytest.importorskip("flwr")

from onnx_autodiff.cli import main  # noqa: E402
from onnx_autodiff.federated import FederatedModel  # noqa: E402
from tests.cli_models import digits_like, mlp_training_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, ok, deadline: float, logs: Path) -> None:
    while not ok():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}\n{tails(logs)}")
        time.sleep(0.5)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def tails(logs: Path, n: int = 40) -> str:
    return "\n".join(f"== {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-n:])
                     for p in sorted(logs.glob("*.log")))


def text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def rounds_done(path: Path) -> int:
    if not path.exists():
        return 0
    props = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}
    return int(props.get("onnx_autodiff.federated_round", 0))


def assert_global_model(model: Path, out: Path, x: np.ndarray, rounds: int, classes: int) -> None:
    """The server's out folder after `rounds`: the checkpoint is at that round, every shared tensor finite and
    moved from the model's initial value, model.onnx holds the checkpoint's tensors and runs on `x`."""
    assert rounds_done(out / "checkpoint.onnx") == rounds
    glob = FederatedModel(model).session(str(out / "checkpoint.onnx"))
    inference = {t.name: numpy_helper.to_array(t) for t in onnx.load(out / "model.onnx").graph.initializer}
    for name, start_value in FederatedModel(model).initial_arrays().items():
        value = glob.get_state(name)
        assert np.all(np.isfinite(value)) and not np.array_equal(value, start_value), name
        np.testing.assert_array_equal(inference[name], value)
    logits = ort.InferenceSession(str(out / "model.onnx")).run(None, {"x": x})[0]
    assert logits.shape == (len(x), classes) and np.all(np.isfinite(logits))


def test_the_app_has_a_run_config_and_no_legacy_federations(tmp_path, capsys):
    from flwr.common.config import get_project_config

    onnx.save(mlp_training_model("adam", hidden=4, features=3, classes=2), tmp_path / "train.onnx")
    app = tmp_path / "app"
    assert main(["federated", "new", str(app), "--model", str(tmp_path / "train.onnx"), "--data-dir", str(tmp_path),
                 "--clients", "3", "--min-clients", "2", "--superlink", "10.0.0.5:9000"]) == 0
    said = capsys.readouterr().out
    assert '[superlink.local-deployment]\naddress = "10.0.0.5:9000"\ninsecure = true' in said
    assert "[superlink.local-simulation]" in said and "options.num-supernodes = 3" in said
    tool = get_project_config(app)["tool"]["flwr"]
    assert "federations" not in tool  # flwr run would migrate it into ~/.flwr and comment it out of the App
    assert tool["app"]["config"] == {"num-server-rounds": 3, "min-clients": 2, "fraction-evaluate": 1.0,
                                     "round-timeout": 3600.0, "local-epochs": 1, "batch-size": 32}
    assert get_project_config(app)["project"]["dependencies"] == ["flwr>=1.42,<2"]
    assert main(["federated", "new", str(tmp_path / "other"), "--model", str(tmp_path / "train.onnx"),
                 "--data-dir", str(tmp_path), "--clients", "2", "--min-clients", "3"]) == 2
    assert "--min-clients 3 is not in 1..--clients (2)" in capsys.readouterr().err


@pytest.mark.slow
def test_three_supernodes_train_and_the_run_outlives_one_killed_in_round_2(tmp_path):
    model = mlp_training_model("adam", lr=0.05, hidden=16, features=8, classes=3)
    onnx.save(model, tmp_path / "train.onnx")
    x, _ = digits_like(96, features=8, classes=3, seed=2)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0)
    (tmp_path / "data").mkdir()
    for i in range(3):
        np.savez(tmp_path / "data" / f"client-{i}.npz", x=x[i::3], labels=y[i::3])
    link = free_port()
    app, out, logs, home = tmp_path / "app", tmp_path / "out", tmp_path / "logs", tmp_path / "flwr-home"
    assert main(["federated", "new", str(app), "--model", str(tmp_path / "train.onnx"), "--data-dir",
                 str(tmp_path / "data"), "--clients", "3", "--min-clients", "2", "--rounds", "3", "--out", str(out),
                 "--superlink", f"127.0.0.1:{link}"]) == 0
    logs.mkdir()
    home.mkdir()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "local-deployment"\n\n[superlink.local-deployment]\n'
                                      f'address = "127.0.0.1:{link}"\ninsecure = true\n')
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, *cmd: str) -> subprocess.Popen:
        log = open(logs / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        procs[name] = subprocess.Popen([str(BIN / cmd[0]), *cmd[1:]], stdout=log, stderr=subprocess.STDOUT,
                                       env=env, cwd=tmp_path, start_new_session=True)
        log.close()
        return procs[name]

    try:
        # no uv sync per run: the App needs nothing but flwr, and the test needs no package index
        start("superlink", "flower-superlink", "--insecure", "--port", str(link),
              "--disable-runtime-dependency-installation")
        wait_for("the SuperLink", lambda: listening(link), time.monotonic() + 90, logs)
        for i in range(3):
            start(f"supernode-{i}", "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{link}",
                  "--port", str(free_port()), "--node-config", f"partition-id={i} num-partitions=3")
        wait_for("three SuperNodes", lambda: all("SuperNode ID" in text(logs / f"supernode-{i}.log")
                                                 for i in range(3)), time.monotonic() + 90, logs)
        started = time.monotonic()
        run = start("flwr-run", "flwr", "run", str(app), "local-deployment", "--stream",
                    "--run-config", "fraction-evaluate=0.0 round-timeout=600.0")
        victim = logs / "supernode-2.log"
        wait_for("node 2's round-2 train message", lambda: text(victim).count("Receiving: train message") >= 2,
                 time.monotonic() + 300, logs)
        assert rounds_done(out / "checkpoint.onnx") == 1
        os.kill(procs["supernode-2"].pid, signal.SIGKILL)
        procs["supernode-2"].wait(timeout=30)  # reaped: its children see their parent gone
        try:
            rc = run.wait(timeout=420)
        except subprocess.TimeoutExpired:
            pytest.fail(f"flwr run did not finish in 7 minutes\n{tails(logs)}")
        seconds = time.monotonic() - started
        said = text(logs / "flwr-run.log")
        assert rc == 0 and "round 3/3" in said, tails(logs)
        assert "Received 2 results and 1 failures" in said, tails(logs)  # round 2 lost the killed node
        assert "Sampled 2 nodes (out of 2)" in said, tails(logs)  # and round 3 went on without it
    finally:
        for p in procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)
    print(f"flwr run: 3 rounds, one node killed in round 2, in {seconds:.0f} s")
    assert_global_model(tmp_path / "train.onnx", out, x[:8], rounds=3, classes=3)
