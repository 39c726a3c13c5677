"""onnx_autodiff/web/train.js trains ``webgpu`` step bundles on onnxruntime-web's WebGPU EP in headless Chromium
(SwiftShader's software adapter, tests/js/chromium.mjs) as ``TrainingSession`` does on the CPU: the demo CNN, an
MLP and a TransformerEncoderLayer (Adam and SGD), 5 steps with a learning-rate schedule, the loss of each step
and every state tensor within 1e-5 (relative), with the CPU fallback off (``session.disable_cpu_ep_fallback``:
every node on the GPU; the batch fixed with ``dims``) and no wasm to fall back on.

Slow (software WebGPU compiles its shaders for each page; about 1-2 minutes here); .ci/run runs it.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from onnx_autodiff.driver.bundle import export_step
from onnx_autodiff.driver.session import TrainingSession
from onnx_autodiff.web.serve import start_server
from tests.js_runtime import read_backend, read_result, relative, train_bundles, web_routes, write_batches
from tests.runtime_models import training_case

RTOL = 1e-5
LRS = [0.01, 0.008, 0.006, 0.004, 0.002]
BATCH = {"cnn": 8, "mlp": 8, "transformer": 4}
CASES = [(m, o) for m in BATCH for o in ("adam", "sgd")]


def _reference(training: onnx.ModelProto, steps: list[dict], state_names) -> tuple[list, dict]:
    sess = TrainingSession(training, progress=False)
    losses = [float(sess.step({**feeds, "learning_rate": np.array(lr, np.float32)})["loss"])
              for feeds, lr in zip(steps, LRS)]
    return losses, {name: sess.get_state(name) for name in state_names}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    pytest.importorskip("transformers")
    work = tmp_path_factory.mktemp("webgpu_browser")
    jobs, refs = [], {}
    for name, opt in CASES:
        training, steps = training_case(name, opt, steps=len(LRS))
        case = f"{name}-{opt}"
        export_step(training, work / case / "bundle", target="webgpu", dims={"N": BATCH[name]})
        spec = json.loads((work / case / "bundle" / "bundle.json").read_text())
        write_batches(work / case / "batches", steps, {"learning_rate": LRS})
        refs[case] = _reference(training, steps, spec["state"])
        jobs.append({"bundle": f"/work/{case}/bundle", "batches": f"/work/{case}/batches",
                     "out": str(work / case / "webgpu.json"), "strict": True})
    server = start_server(web_routes(work))
    try:
        train_bundles("webgpu", jobs, origin=f"http://127.0.0.1:{server.server_address[1]}", timeout=900)
    finally:
        server.shutdown()
    return {case: (refs[case], read_result(work / case / "webgpu.json"), read_backend(work / case / "webgpu.json"))
            for case in refs}


@pytest.mark.slow
@pytest.mark.parametrize("case", [f"{m}-{o}" for m, o in CASES])
def test_train_js_on_webgpu_in_chromium_matches_training_session(trained, case):
    (ref_losses, ref_state), (losses, state), backend = trained[case]
    assert backend == "webgpu"
    assert len(losses) == len(LRS) and set(state) == set(ref_state)
    loss_err = max(relative(np.array(a), np.array(b)) for a, b in zip(losses, ref_losses))
    errs = {name: relative(state[name], ref_state[name]) for name in ref_state}
    worst = max(errs, key=errs.get)
    print(f"\nparity {case} onnxruntime-web webgpu: loss {loss_err:.1e}, state {errs[worst]:.1e} ({worst})")
    assert loss_err <= RTOL, f"{case}: losses {losses} vs TrainingSession {ref_losses}"
    assert errs[worst] <= RTOL, f"{case}: state {worst!r} off by {errs[worst]:.2e} (max |ref| relative)"
