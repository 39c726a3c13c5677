"""Training on onnxruntime's WebGPU execution provider (the onnxruntime-ep-webgpu plugin; a software Vulkan adapter
where there is no GPU, tests/webgpu_runtime.py).

``TrainingSession(providers=["WebGpuExecutionProvider"])`` trains the demo CNN, an MLP and a TransformerEncoderLayer
(Adam and SGD) 5 steps within 1e-5 of ``TrainingSession`` on the CPU, with the CPU fallback off (every node on the
GPU: the batch fixed with ``dims``), state and optimizer moments in device memory, and only the batch and the
hyper-parameters up and the loss and two NaN checks down per step. The bundle runner, ``train --runtime webgpu``
and ``check --target webgpu`` on the same EP. Slow: software WebGPU compiles its shaders on the first step of
each session (seconds) and runs 10-500x slower than the CPU.
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from onnx_autodiff import TrainingSession
from onnx_autodiff.driver.devices import FALLBACK_OFF, WEBGPU
from onnx_autodiff.driver.state import TRANSFERS
from tests.runtime_models import training_case
from tests.webgpu_runtime import webgpu_device

RTOL = 1e-5
LRS = [0.01, 0.008, 0.006, 0.004, 0.002]
BATCH = {"cnn": 8, "mlp": 8, "transformer": 4}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.max(np.abs(b)) if b.size else 0.0
    diff = np.max(np.abs(a - b)) if b.size else 0.0
    return float(diff / scale) if scale else float(diff != 0)


def _strict() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry(FALLBACK_OFF, "1")
    return options


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("name", ["cnn", "mlp", "transformer"])
def test_webgpu_trains_as_the_cpu_does(name, optimizer):
    webgpu_device()
    training, batches = training_case(name, optimizer)
    cpu = TrainingSession(training, progress=False)
    gpu = TrainingSession(training, [WEBGPU], progress=False, session_options=_strict(), dims={"N": BATCH[name]},
                          outputs=[])
    assert gpu.device == "webgpu"
    ref, got = [], []
    for k, (b, lr) in enumerate(zip(batches, LRS)):
        feeds = {**b, "learning_rate": np.array(lr, np.float32)}
        ref.append(float(cpu.step(feeds)[cpu.loss_name]))
        TRANSFERS.reset()
        got.append(float(gpu.step(feeds)[gpu.loss_name]))
        if k:  # (the first step also reads the state back once, for its forward check)
            assert (TRANSFERS.up, TRANSFERS.down) == (len(feeds) + len(gpu.host_scalars), 3), k
    loss_err = max(rel(a, b) for a, b in zip(got, ref))
    errs = {k: rel(gpu.get_state(k), cpu.get_state(k)) for k in cpu.state}
    worst = max(errs, key=errs.get)
    print(f"\nwebgpu {name}-{optimizer}: loss {loss_err:.1e}, state {errs[worst]:.1e} ({worst})")
    assert loss_err <= RTOL, (got, ref)
    assert errs[worst] <= RTOL, worst
    assert int(gpu.get_state("train/iteration")) == 5


@pytest.mark.slow
def test_bundle_runner_train_command_and_check_target(tmp_path, capsys):
    """The bundle loop on the plugin EP (symbolic batch: its shape arithmetic on the CPU), ``train --runtime
    webgpu`` (TrainingSession on the EP) against ``train`` on onnxruntime, and ``check --target webgpu``."""
    webgpu_device()
    import onnx
    from onnx import numpy_helper

    from onnx_autodiff.cli import main
    from onnx_autodiff.driver.bundle import export_step
    from onnx_autodiff.runtimes import BundleTrainer
    from tests.cli_models import digits_like, mlp_training_model

    training, batches = training_case("mlp", "adam")
    export_step(training, tmp_path / "bundle", target="webgpu")
    cpu = TrainingSession(training, progress=False)
    trainer = BundleTrainer(tmp_path / "bundle", "webgpu")
    for b in batches:
        assert rel(trainer.step(b), cpu.step(b)[cpu.loss_name]) <= RTOL
    assert max(rel(trainer.state[k], cpu.get_state(k)) for k in cpu.state) <= RTOL

    onnx.save(mlp_training_model(hidden=16, features=8, classes=3), tmp_path / "t.onnx")
    x, y = digits_like(n=40, features=8, classes=3)
    np.savez(tmp_path / "d.npz", X=x, y=y)
    common = [str(tmp_path / "t.onnx"), "--data", str(tmp_path / "d.npz"), "--epochs", "2", "--batch-size", "16",
              "--quiet"]
    assert main(["train", *common, "--checkpoint", str(tmp_path / "ort"), "--export", str(tmp_path / "a.onnx")]) == 0
    assert main(["train", *common, "--checkpoint", str(tmp_path / "gpu"), "--runtime", "webgpu",
                 "--export", str(tmp_path / "b.onnx")]) == 0
    a = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "a.onnx").graph.initializer}
    b = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "b.onnx").graph.initializer}
    assert set(a) == set(b) == {"W1", "b1", "W2", "b2"}
    assert max(rel(b[k], a[k]) for k in a) <= RTOL

    capsys.readouterr()
    assert main(["check", str(tmp_path / "t.onnx"), "--target", "webgpu"]) == 0
    out = capsys.readouterr().out
    assert "node(s) of the step on the CPU" in out and "Size" in out, out
    assert main(["check", str(tmp_path / "t.onnx"), "--target", "webgpu", "--dim", "N=16"]) == 0
    assert "runs every node of the step on its webgpu execution provider" in capsys.readouterr().out


def test_the_cpu_fallback_off_names_the_nodes_it_refuses():
    """A symbolic batch leaves shape arithmetic to the CPU: with the fallback off, our error names those nodes."""
    webgpu_device()
    from onnx_autodiff.errors import DeviceError

    training, _ = training_case("mlp", "sgd")
    with pytest.raises(DeviceError, match=r"refuses the \d+ node\(s\) that would run on the CPU: .*Size"):
        TrainingSession(training, [WEBGPU], progress=False, session_options=_strict())
