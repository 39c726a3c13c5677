"""CPU vs CUDA: the same 5 training steps on onnxruntime's CPU and CUDA execution providers. Skips where
onnxruntime offers no CUDAExecutionProvider (run with ``-m gpu`` on a machine with a GPU)."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from onnx_autodiff import TrainingSession
from tests.runtime_models import training_case

pytestmark = pytest.mark.gpu
CUDA = ("CUDAExecutionProvider", {"use_tf32": 0})  # TF32 matmuls would round to 10 mantissa bits


@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(), reason="no CUDA here")
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_cuda_matches_cpu(name, optimizer):
    training, batches = training_case(name, optimizer)
    cpu, gpu = TrainingSession(training), TrainingSession(training, providers=[CUDA])
    assert gpu.device == "cuda"
    for b in batches:
        lc, lg = cpu.step(b)[cpu.loss_name], gpu.step(b)[gpu.loss_name]
        np.testing.assert_allclose(lg, lc, rtol=1e-5)
    for k in cpu.state:
        ref = np.asarray(cpu.state[k], np.float64)
        diff = np.max(np.abs(np.asarray(gpu.state[k], np.float64) - ref)) if ref.size else 0.0
        assert diff <= 1e-5 * max(np.max(np.abs(ref)), 1e-30), k
