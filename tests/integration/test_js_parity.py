"""onnx_autodiff/web/train.js trains portable step bundles on onnxruntime-node and on onnxruntime-web (wasm, in
headless Chromium) as TrainingSession does: 5 steps with a learning rate that changes every step; the loss
of each step and every state tensor at the end within 1e-5 (relative) of TrainingSession's.

Models: the demo CNN, an MLP, a torch TransformerEncoderLayer export and a tiny random BERT (transformers),
each with Adam and with SGD. Relative difference: max |js - ref| / max |ref| per tensor (per loss).

The attention key biases stay frozen: softmax ignores a per-row shift, so their gradient is zero in exact
arithmetic and float32 leaves noise (~1e-9) whose sign depends on the order of the sums; Adam divides it by
its own root mean square and moves the bias by about +-lr per step in a direction no two runtimes (nor two
thread counts of one) agree on. (Measured with them trained: SGD 2e-7, Adam off by 2e-3 on web and on node.)
torch packs the q/k/v biases into one ``in_proj_bias``, so the whole of it is frozen there. For the same reason
a small gradient's rounding error becomes an error of its Adam step relative to lr: Adam runs at its usual 1e-3
(decaying); at 1e-2 BERT's query biases came out 2.3e-5 off on web.

Slow (about 1.5-2 minutes on 2 busy cores: two torch exports, 8 TrainingSessions, node, Chromium); .ci/run runs it.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from onnx_autodiff import demo
from onnx_autodiff.driver.bundle import export_step
from onnx_autodiff.driver.session import TrainingSession
from onnx_autodiff.training import make_training_model
from onnx_autodiff.web.serve import start_server
from tests.cli_models import mlp, transformer_block
from tests.js_runtime import read_result, train_bundles, web_routes, write_batches

RTOL = 1e-5
STEPS = 5
LRS = {"adam": [1e-3, 8e-4, 6e-4, 4e-4, 2e-4], "sgd": [0.1, 0.08, 0.06, 0.04, 0.02]}
MODELS = ["cnn", "mlp", "transformer", "bert"]
CASES = [(m, o) for m in MODELS for o in ("adam", "sgd")]


FROZEN = {"transformer": ["layer.self_attn.in_proj_bias"], "bert": ["*.attention.self.key.bias"]}


def _model(name: str, rng) -> tuple[onnx.ModelProto, str, object]:
    """(inference model, loss, batch() -> feeds) for one model of the matrix."""
    if name == "cnn":
        return demo.cnn_model(0), "cross_entropy", lambda: {
            "image": rng.random((8, 1, 8, 8), dtype=np.float32), "labels": rng.integers(0, 10, 8)}
    if name == "mlp":
        return mlp(hidden=32, features=16, classes=5), "cross_entropy", lambda: {
            "x": rng.standard_normal((8, 16)).astype(np.float32), "labels": rng.integers(0, 5, 8)}
    if name == "transformer":
        return transformer_block(), "cross_entropy", lambda: {
            "x": rng.standard_normal((4, 4, 16)).astype(np.float32), "labels": rng.integers(0, 5, 4)}
    from tests.hf_models import build, export

    module, inputs = build("bert")
    return export(module, inputs, "ts17"), "mse", lambda: {
        "input_ids": rng.integers(1, 64, (2, 5)), "attention_mask": np.ones((2, 5), np.int64),
        "labels": rng.standard_normal((2, 5, 16)).astype(np.float32)}


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
    for k, (name, opt) in enumerate(CASES):
        rng = np.random.default_rng(k)
        inference, loss, batch = _model(name, rng)
        training = make_training_model(inference, loss, opt, lr=LRS[opt][0], frozen=FROZEN.get(name))
        case = f"{name}-{opt}"
        export_step(training, work / case / "bundle", target="portable")
        spec = json.loads((work / case / "bundle" / "bundle.json").read_text())
        steps = [batch() for _ in range(STEPS)]
        write_batches(work / case / "batches", steps, {"learning_rate": LRS[opt]})
        refs[case] = _reference(training, steps, LRS[opt], spec["state"])
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


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    scale = float(np.abs(want).max()) if want.size else 0.0
    diff = float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max()) if want.size else 0.0
    return diff / scale if scale else diff


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["node", "web"])
@pytest.mark.parametrize("case", [f"{m}-{o}" for m, o in CASES])
def test_js_driver_matches_training_session(trained, case, runtime):
    (ref_losses, ref_state), (losses, state) = trained[case]["ref"], trained[case][runtime]
    assert len(losses) == STEPS
    assert set(state) == set(ref_state)
    loss_err = max(_relative(np.array(a), np.array(b)) for a, b in zip(losses, ref_losses))
    errs = {name: _relative(state[name], ref_state[name]) for name in ref_state}
    worst = max(errs, key=errs.get)
    print(f"\nparity {case} {runtime}: loss {loss_err:.1e}, state {errs[worst]:.1e} ({worst})")
    assert loss_err <= RTOL, f"{case} on {runtime}: losses {losses} vs TrainingSession {ref_losses}"
    assert errs[worst] <= RTOL, f"{case} on {runtime}: state {worst!r} off by {errs[worst]:.2e} (max |ref| relative)"
