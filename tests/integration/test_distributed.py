"""Gradient accumulation and data-parallel training (accumulate.py, distributed.py, train --accumulate / torchrun).

The exactness claims are held in float64, where summation order moves the weights by ~1e-15: in float32 the
different order of the batch sums (one batch of 16 vs two of 8) alone moves them by ~1e-7, and Adam turns the
rounding noise of an exactly-zero gradient (the attention key bias) into +-lr steps (measured 9e-4 relative on
that tensor of the transformer block; the others stay under 4e-7). 2 processes and ``--accumulate 2`` do the
same arithmetic, so they must agree bit for bit. Every multi-process test starts torch in each process (import
torch alone took 8 s on the loaded machine). Measured on 2 cores shared with other jobs (load 9-18): the default
tests of this file 110-140 s with -n 2 (the torchrun fixture 26-36 s, the CLI test 27 s), the three slow ones
(kill + resume, stop, other data) 114 s together.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnx_autodiff.driver.accumulate import SplitStep, part_bounds
from onnx_autodiff.driver.session import TrainingSession
from onnx_autodiff.errors import DataError
from onnx_autodiff.model.metadata import TRAIN_STATE
from onnx_autodiff.training import make_training_model
from tests.cli_models import digits_like, mlp, mlp_training_model, transformer_block

ROOT = Path(__file__).resolve().parents[2]
BATCH, STEPS = 16, 4


def env(**extra):
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **extra)


def torchrun(*args, cwd, timeout=120):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           *args]
    return subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(np.asarray(b, np.float64)), 1e-300))


def batches(data, batch=BATCH, steps=STEPS):
    return [{n: a[k * batch:(k + 1) * batch] for n, a in data.items()} for k in range(steps)]


def models64():
    """float64 MLP and transformer block, SGD and Adam: name -> (training model, data)."""
    rng = np.random.default_rng(0)
    x, y = digits_like(BATCH * STEPS, features=32)
    mlp_data = {"x": x.astype(np.float64), "labels": y}
    block_data = {"x": rng.standard_normal((BATCH * STEPS, 4, 16)), "labels": rng.integers(0, 5, BATCH * STEPS)}
    base = {"mlp": (mlp(hidden=24, features=32, dtype=np.float64), mlp_data),
            "block": (transformer_block(dtype="float64"), block_data)}
    return {f"{name}_{opt}": (make_training_model(m, "cross_entropy", opt, lr=0.05), data)
            for name, (m, data) in base.items() for opt in ("sgd", "adam")}


def floats(state):
    return {n: v for n, v in state.items() if np.asarray(v).dtype.kind == "f"}


# ---- in one process ---------------------------------------------------------------------------------

def test_import_does_not_import_torch():
    """Neither the package nor the distributed module imports torch; outside torchrun there is no group."""
    code = ("import sys, onnx_autodiff, onnx_autodiff.driver.accumulate, onnx_autodiff.cli\n"
            "from onnx_autodiff.driver.distributed import DataParallel\n"
            "print(DataParallel.from_environment(), 'torch' in sys.modules)")
    clean = {k: v for k, v in env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "None False", out.stderr


def test_part_bounds():
    assert part_bounds(16, 2, 2) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert part_bounds(7, 1, 3) == [(0, 2), (2, 4), (4, 7)]
    with pytest.raises(DataError, match="cannot be cut into 4 parts"):
        part_bounds(3, 2, 2)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_accumulate_float32_mlp(optimizer):
    """float32: --accumulate K (3 gives parts of 5, 5, 6 rows, weighted by size) against one batch."""
    x, y = digits_like(BATCH * STEPS)
    m = mlp_training_model(optimizer)
    ref = TrainingSession(m, progress=False)
    for f in batches({"x": x, "labels": y}):
        ref.step(f)
    for k in (2, 3):
        sess = TrainingSession(m, progress=False)
        step = SplitStep(sess, ["x", "labels"], accumulate=k)
        for f in batches({"x": x, "labels": y}):
            out = step.step(f)
        assert sess.steps == STEPS
        for name, value in floats(ref.state).items():
            assert rel(sess.state[name], value) < 1e-6, (k, name, rel(sess.state[name], value))
    assert np.isfinite(out["loss"])


def test_accumulate_averages_batchnorm_statistics():
    """The running statistics after a micro-batched step are the mean of each micro-batch's update
    (the BatchNormalization + Dropout model of test_training_mode; the statistics come before the dropout)."""
    from tests.driver.test_training_mode import batches as bn_batches
    from tests.driver.test_training_mode import training_model as bn_training_model

    sess = TrainingSession(bn_training_model(), progress=False)
    f = bn_batches(1)[0]
    stats = {k: v for k, v in sess.update_binding.items() if "running" in k}
    assert len(stats) == 2 and set(stats.values()) <= set(sess.averaged_outputs), sess.averaged_outputs
    halves = [sess.gradients({n: a[s] for n, a in f.items()}) for s in (slice(0, 8), slice(8, 16))]
    before = {k: sess.state[k] for k in stats}
    SplitStep(sess, ["X", "labels"], accumulate=2).step(f)
    for key, value in stats.items():
        want = (halves[0][value].numpy() + halves[1][value].numpy()) / 2
        assert not np.allclose(want, before[key])
        np.testing.assert_allclose(sess.state[key], want, rtol=1e-6, atol=1e-7)


def test_cli_refuses_batch_not_divisible(tmp_path):
    onnx.save(mlp_training_model(), str(tmp_path / "m.onnx"))
    x, y = digits_like(64)
    np.savez(tmp_path / "d.npz", X=x, y=y)
    out = subprocess.run([sys.executable, "-m", "onnx_autodiff", "train", "m.onnx", "--data", "d.npz", "--batch-size",
                          "16", "--accumulate", "3", "--checkpoint", "ck"], cwd=tmp_path, env=env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "--batch-size 16 (the global batch) is not divisible by 1 process(es) x --accumulate 3" in out.stderr
    assert not (tmp_path / "ck").exists()


# ---- 2 processes through torchrun -------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every float64 model trained by 2 processes (tests/dist_worker.py under torchrun)."""
    d = tmp_path_factory.mktemp("dist")
    models = models64()
    for name, (m, data) in models.items():
        onnx.save(m, str(d / f"{name}.onnx"))
        np.savez(d / f"data_{name}.npz", **data)
    start = time.perf_counter()
    run = torchrun(str(ROOT / "tests" / "dist_worker.py"), str(d), str(BATCH), str(STEPS), cwd=d)
    assert run.returncode == 0, run.stderr[-3000:]
    print(f"torchrun, 2 processes, {len(models)} models: {time.perf_counter() - start:.1f} s")
    return d, models


@pytest.mark.parametrize("name", ["mlp_sgd", "mlp_adam", "block_sgd", "block_adam"])
def test_two_processes_match_one(trained, name):
    d, models = trained
    model, data = models[name]
    two = dict(np.load(d / f"{name}.world2.npz"))
    one = TrainingSession(model, progress=False)
    acc = TrainingSession(model, progress=False)
    step = SplitStep(acc, list(data), accumulate=2)
    for f in batches(data):
        one.step(f)
        step.step(f)
    assert set(two) == set(one.state)
    for n, value in one.state.items():
        if value.dtype.kind == "f":
            assert rel(two[n], value) < 1e-6, (name, n, rel(two[n], value))
        else:
            np.testing.assert_array_equal(two[n], value, err_msg=f"{name} {n}")  # the step counter
        np.testing.assert_array_equal(two[n], acc.state[n], err_msg=f"{name} {n}: 2 processes vs --accumulate 2")


def checkpoint_tensors(path):
    m = onnx.load(str(path))
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}


def test_cli_torchrun_and_accumulate(tmp_path):
    """The CLI: torchrun with 2 processes == one process with --accumulate 2 (bit for bit) ~= one process
    (1e-6), float64 MLP with Adam over 2 epochs of a shuffled 200-sample set (a last batch of 8)."""
    onnx.save(make_training_model(mlp(hidden=24, features=32, dtype=np.float64), "cross_entropy", "adam", lr=0.01),
              str(tmp_path / "m.onnx"))
    x, y = digits_like(200, features=32)
    np.savez(tmp_path / "d.npz", X=x.astype(np.float64), y=y)
    train = ["-m", "onnx_autodiff", "train", "m.onnx", "--data", "d.npz", "--epochs", "2", "--batch-size", "16",
             "--quiet"]
    for ck, extra in (("one", []), ("acc", ["--accumulate", "2"])):
        out = subprocess.run([sys.executable, *train, "--checkpoint", ck, *extra], cwd=tmp_path, env=env(),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
    out = torchrun(*train, "--checkpoint", "two", "--timeout", "30", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("epoch 2/2: loss") == 1  # rank 0 alone prints
    one, acc, two = (checkpoint_tensors(tmp_path / ck / "checkpoint.onnx") for ck in ("one", "acc", "two"))
    assert set(one) == set(two) == set(acc)
    for n in one:
        np.testing.assert_array_equal(two[n], acc[n], err_msg=n)
        if one[n].dtype.kind == "f":
            assert rel(two[n], one[n]) < 1e-6, (n, rel(two[n], one[n]))


def workers(launcher: int) -> dict[str, int]:
    """RANK -> pid of the processes torchrun (pid ``launcher``) started, found through /proc."""
    found, todo = {}, [launcher]
    while todo:
        pid = todo.pop()
        for task in Path(f"/proc/{pid}/task").glob("*"):
            kids = (task / "children").read_text().split()
            todo += [int(k) for k in kids]
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = [e[5:].decode() for e in environ if e.startswith(b"RANK=")]
        if rank and pid != launcher:
            found[rank[0]] = pid
    assert set(found) == {"0", "1"}, found
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def launch_ranks(cwd, args, port, rank1_args=None):
    """Two train processes with the variables torchrun would set (so a test can kill one of them);
    ``rank1_args`` replaces rank 1's arguments."""
    procs = []
    for rank in range(2):
        e = env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        argv = rank1_args if rank == 1 and rank1_args is not None else args
        procs.append(subprocess.Popen([sys.executable, "-m", "onnx_autodiff", "train", *argv], cwd=cwd, env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.slow
def test_ranks_with_other_data_refuse_to_start(tmp_path):
    """A rank that reads other data (or found another checkpoint) stops the run before the first step."""
    onnx.save(mlp_training_model(), str(tmp_path / "m.onnx"))
    for name, seed in (("a.npz", 1), ("b.npz", 2)):
        x, y = digits_like(64, seed=seed)
        np.savez(tmp_path / name, X=x, y=y)
    args = ["m.onnx", "--epochs", "1", "--batch-size", "16", "--quiet", "--timeout", "20", "--checkpoint", "ck"]
    procs = launch_ranks(tmp_path, args + ["--data", "a.npz"], free_port(), rank1_args=args + ["--data", "b.npz"])
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [1, 1], errs
    for err in errs:
        assert "has data = " in err and "every process must start from the same model, data, checkpoint" in err, err
    assert not (tmp_path / "ck" / "checkpoint.onnx").exists()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_failed_rank_stops_the_other_and_resume_works(tmp_path, how):
    """After the first checkpoint rank 1 is killed (SIGKILL: rank 0's next all-reduce sees the connection
    close) or stopped (SIGSTOP: rank 0 waits --timeout 8 s). Either way rank 0 exits non-zero with our error
    in time; after the kill, the same command resumes from the checkpoint directory to the result of an
    uninterrupted run."""
    onnx.save(make_training_model(mlp(hidden=64, features=32, dtype=np.float64), "cross_entropy", "adam", lr=0.01),
              str(tmp_path / "m.onnx"))
    x, y = digits_like(2048, features=32)
    np.savez(tmp_path / "d.npz", X=x.astype(np.float64), y=y)
    timeout = 8
    args = ["m.onnx", "--data", "d.npz", "--epochs", "40", "--batch-size", "16", "--quiet", "--timeout", str(timeout)]
    if how == "kill":  # through torchrun, whose agent also stops the other workers when one dies
        launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                     "--master-port", str(free_port()), "-m", "onnx_autodiff", "train", *args,
                                     "--checkpoint", "ck"], cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
    else:
        procs = launch_ranks(tmp_path, args + ["--checkpoint", "ck"], free_port())
        launcher = procs[0]
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "ck" / "checkpoint.onnx").exists():
            assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate()[1][-2000:]
            time.sleep(0.1)
        if how == "kill":
            ranks = workers(launcher.pid)
            os.kill(ranks["1"], signal.SIGKILL)
        else:
            procs[1].send_signal(signal.SIGSTOP)
        failed = time.monotonic()
        _, err = launcher.communicate(timeout=timeout + 20)
        took = time.monotonic() - failed
    finally:
        for p in [launcher] + (procs if how == "stop" else []):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert launcher.returncode not in (0, None), err
    if how == "kill":
        assert not alive(ranks["0"]), "rank 0 outlived torchrun"
        # rank 0 fails at its next all-reduce, unless torchrun's SIGTERM reaches it first
        assert "a gradient all-reduce failed" in err or "interrupted (SIGTERM)" in err, err[-3000:]
    else:
        assert "a gradient all-reduce failed" in err and "rerun the same torchrun command" in err, err
    who = "rank 0 reported the failed all-reduce" if "gradient all-reduce failed" in err else "SIGTERM first"
    print(f"{how}: {'torchrun' if how == 'kill' else 'rank 0'} exited {launcher.returncode} {took:.1f} s after rank 1 "
          f"failed ({who})")
    if how == "stop":
        assert took >= timeout - 1 and f"another process did not answer within {timeout} s" in err, (took, err)
        return
    done = json.loads({p.key: p.value for p in onnx.load(str(tmp_path / "ck" / "checkpoint.onnx")).metadata_props}
                      [TRAIN_STATE])["epochs_done"]
    assert 1 <= done < 40
    # resume (through torchrun this time) two more epochs; compare with one process and --accumulate 2
    epochs = str(done + 2)
    resumed = torchrun("-m", "onnx_autodiff", "train", *args, "--checkpoint", "ck", "--epochs", epochs, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    ref = subprocess.run([sys.executable, "-m", "onnx_autodiff", "train", *args, "--checkpoint", "ref",
                          "--epochs", epochs, "--accumulate", "2"], cwd=tmp_path, env=env(), capture_output=True,
                         text=True, timeout=120)
    assert ref.returncode == 0, ref.stderr
    got, want = (checkpoint_tensors(tmp_path / ck / "checkpoint.onnx") for ck in ("ck", "ref"))
    for n in want:
        np.testing.assert_array_equal(got[n], want[n], err_msg=n)
