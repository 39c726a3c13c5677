"""onnx_autodiff/web/train.js trains portable step bundles on onnxruntime-node and on onnxruntime-web (wasm, in
headless Chromium) as TrainingSession does: 5 steps with a learning rate that changes every step (a schedule, fed
as a function of the step); the loss of each step and every state tensor at the end within 1e-5 (relative) of
TrainingSession's.

The models and batches are those of the other runtimes' parity tests (tests/runtime_models.py: the demo CNN, an
MLP, a torch TransformerEncoderLayer export and a tiny random BERT, each with Adam and with SGD), so the matrix of
docs/runtimes.md is one set of cases. Relative difference: max |js - ref| / max |ref| per tensor (per loss).

Slow (about 1.5-2 minutes on 2 busy cores: two torch exports, 8 TrainingSessions, node, Chromium); .ci/run runs it.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from onnx_autodiff.driver.bundle import export_step
from onnx_autodiff.driver.session import TrainingSession
from onnx_autodiff.web.serve import start_server
from tests.js_runtime import read_result, relative, train_bundles, web_routes, write_batches
from tests.runtime_models import MODELS, OPTIMIZERS, training_case

RTOL = 1e-5
LRS = [0.01, 0.008, 0.006, 0.004, 0.002]  # training_case records 0.01; the schedule feeds these
CASES = [(m, o) for m in MODELS for o in OPTIMIZERS]


def _reference(training: onnx.ModelProto, steps: list[dict], lrs: list[float], state_names) -> tuple[list, dict]:
    sess = TrainingSession(training, progress=False)
    lr_input = next(i for i in sess.step_model.graph.input if i.name == "learning_rate")
    lr_shape = [d.dim_value for d in lr_input.type.tensor_type.shape.dim]
    initial = {name: sess.get_state(name).copy() for name in state_names}
    losses = [float(sess.step({**feeds, "learning_rate": np.full(lr_shape, lr, np.float32)})["loss"])
              for feeds, lr in zip(steps, lrs)]
    final = {name: sess.get_state(name) for name in state_names}
    assert any(not np.array_equal(final[n], initial[n]) for n in state_names), "no state tensor moved"
    return losses, final


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every case exported, trained by TrainingSession, by node and by Chromium: {case: {runtime: result}}."""
    pytest.importorskip("transformers")
    work = tmp_path_factory.mktemp("js_parity")
    jobs, refs = {"node": [], "web": []}, {}
    for name, opt in CASES:
        training, steps = training_case(name, opt, steps=len(LRS))
        case = f"{name}-{opt}"
        export_step(training, work / case / "bundle", target="portable")
        spec = json.loads((work / case / "bundle" / "bundle.json").read_text())
        write_batches(work / case / "batches", steps, {"learning_rate": LRS})
        refs[case] = _reference(training, steps, LRS, spec["state"])
        jobs["node"].append({"bundle": str(work / case / "bundle"), "batches": str(work / case / "batches"),
                             "out": str(work / case / "node.json")})
        jobs["web"].append({"bundle": f"/work/{case}/bundle", "batches": f"/work/{case}/batches",
                            "out": str(work / case / "web.json")})
    train_bundles("node", jobs["node"])
    server = start_server(web_routes(work))
    try:
        train_bundles("web", jobs["web"], origin=f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    return {case: {"ref": refs[case], **{rt: read_result(work / case / f"{rt}.json") for rt in ("node", "web")}}
            for case in refs}


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["node", "web"])
@pytest.mark.parametrize("case", [f"{m}-{o}" for m, o in CASES])
def test_js_driver_matches_training_session(trained, case, runtime):
    (ref_losses, ref_state), (losses, state) = trained[case]["ref"], trained[case][runtime]
    assert len(losses) == len(LRS)
    assert set(state) == set(ref_state)
    loss_err = max(relative(np.array(a), np.array(b)) for a, b in zip(losses, ref_losses))
    errs = {name: relative(state[name], ref_state[name]) for name in ref_state}
    worst = max(errs, key=errs.get)
    print(f"\nparity {case} {runtime}: loss {loss_err:.1e}, state {errs[worst]:.1e} ({worst})")
    assert loss_err <= RTOL, f"{case} on {runtime}: losses {losses} vs TrainingSession {ref_losses}"
    assert errs[worst] <= RTOL, f"{case} on {runtime}: state {worst!r} off by {errs[worst]:.2e} (max |ref| relative)"
