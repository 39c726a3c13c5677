"""``flwr run DIR local-simulation`` on the App ``onnx-autodiff federated new`` writes, as it is: Flower 1.42's
``:local:`` connection starts a local SuperLink in simulation mode, which runs the App on Ray. The connection is
the one ``federated new`` prints, plus the Ray options docs/federated.md gives for a small machine. Flower's home,
its local SuperLink's ports and Ray's temporary folder are the test's own (nothing touches ~/.flwr or /tmp/ray);
every wait has a deadline, and every process the run started (the detached local SuperLink, ``flwr-simulation``,
Ray's) is killed at the end: they all carry the test's ``FLWR_HOME`` in their environment. Slow: Ray starts."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")

from onnx_autodiff.cli import main  # noqa: E402
from onnx_autodiff.cli.demo import load_digits  # noqa: E402
from tests.cli_models import mlp_training_model  # noqa: E402
from tests.federated.test_deployment import assert_global_model, free_port, text  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# what docs/federated.md adds to the printed connection for a 2-core machine: one Ray CPU, one ClientApp at a time
RAY_OPTIONS = ("options.backend.client-resources.num-cpus = 1\noptions.backend.init-args.num-cpus = 1\n"
               "options.backend.init-args.logging-level = \"INFO\"\n")


def ours(marker: str) -> list[int]:
    """The pids whose environment holds ``marker`` (the test's FLWR_HOME): only processes this test started."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def kill_all(marker: str, deadline: float) -> None:
    while (pids := ours(marker)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)


@pytest.mark.slow
def test_flwr_run_local_simulation_runs_the_app_as_written(tmp_path, capsys):
    model = mlp_training_model("adam", lr=0.05, hidden=16, features=64, classes=10)
    onnx.save(model, tmp_path / "train.onnx")
    images, labels = load_digits()  # the bundled 8x8 digits, 60 per node
    x, y = images[:180].reshape(180, 64).astype(np.float32) / 16.0, labels[:180].astype(np.int64)
    (tmp_path / "data").mkdir()
    for i in range(3):
        np.savez(tmp_path / "data" / f"client-{i}.npz", x=x[i::3], labels=y[i::3])
    app, out, home = tmp_path / "app", tmp_path / "out", tmp_path / "flwr-home"
    capsys.readouterr()
    assert main(["federated", "new", str(app), "--model", str(tmp_path / "train.onnx"), "--data-dir",
                 str(tmp_path / "data"), "--clients", "3", "--rounds", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    connection = re.search(r"\[superlink\.local-simulation\]\n(?:.+\n)+", printed)
    assert connection and 'address = ":local:"' in connection.group(0), printed
    home.mkdir()
    (home / "config.toml").write_text('[superlink]\ndefault = "local-simulation"\n\n'
                                      + connection.group(0) + RAY_OPTIONS)
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0",
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()), "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
           # no uv sync per run in the local SuperLink: the App needs nothing but flwr, the test no package index
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "RAY_TMPDIR": ray_tmp,
           "RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION": "0.02",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("RAY_ADDRESS", None)
    log_path = tmp_path / "flwr-run.log"
    marker = f"FLWR_HOME={home}"
    started, run = time.monotonic(), None
    try:
        for attempt in range(2):  # flwr gives the local SuperLink a fixed 15 s to start: once more if it missed
            with open(log_path, "wb") as log:
                run = subprocess.Popen([str(BIN / "flwr"), "run", str(app), "local-simulation", "--stream"],
                                       stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                       start_new_session=True)
            try:
                rc = run.wait(timeout=480 - 60 * attempt)
            except subprocess.TimeoutExpired:
                rc = None
            said = text(log_path)
            if rc == 0 or "Failed to start local SuperLink within" not in said:
                break
            print(f"flwr run: the local SuperLink did not start in 15 s; trying again\n{said}")
            kill_all(marker, time.monotonic() + 30)
        seconds = time.monotonic() - started
        superlink_log = text(home / "local-superlink" / "superlink.log")
        failure = f"{said}\n== local SuperLink log (tail)\n" + "\n".join(superlink_log.splitlines()[-60:])
        assert rc is not None, f"flwr run did not finish in 8 minutes\n{failure}"
        assert rc == 0 and "round 2/2" in said, failure
        assert "(3 simulated SuperNodes)" in said, failure  # the printed connection's options.num-supernodes
        assert said.count("aggregate_train: Received 3 results and 0 failures") == 2, failure
        losses = [float(v) for v in re.findall(r"Aggregated MetricRecord: \{'loss': ([0-9.eE+-]+)", said)]
        assert len(losses) == 2 and losses[1] < losses[0], failure  # federated evaluation: the 2 rounds trained
    finally:
        if run is not None:
            try:
                os.killpg(run.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            run.wait(timeout=30)
        kill_all(marker, time.monotonic() + 30)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not ours(marker), "processes of the run are still alive"
    print(f"flwr run local-simulation: 2 rounds in {seconds:.0f} s")
    assert_global_model(tmp_path / "train.onnx", out, x[:8], rounds=2, classes=10)
