"""The LoRA training step of a tiny Llama (dynamo export, float32, rank 4 on q_proj/v_proj, ``causal_lm``, AdamW)
exported as a portable step bundle trains on every runtime the portable target names: the loss of each of 3
steps and every state tensor after them within 1e-5 (relative, as tests/integration/test_runtimes.py and
test_js_parity.py require) of ``TrainingSession`` on the same training model. The bundle's state is the
adapters, their AdamW moments and the step counter; the base weights are constants of step.onnx, unchanged.

Two runtime quirks this model met (``passes/step_quirks.py``): OpenVINO computed the backward's
``MatMul(dY, Transpose(W))`` as ``dY @ W`` where ``W`` (a frozen base weight, a constant) also feeds the
forward MatMul; tract could not unify the export's symbolic intermediate shapes with its concrete plan.

The adapters start as in test_lora.py: B random (0.1 N(0, 1)), not PEFT's zeros. From B = 0 the A gradients
are exactly zero at the first step and ~1e-10 at the next (q_proj), around Adam's eps = 1e-8, where float32
rounding decides the step (docs/runtimes.md, "Adam and zero gradients"): there onnxruntime's own float32 state
differs by 1.3e-5 from the same steps computed in float64, and the runtimes by 0.6-1.8e-5 from it.

Slow (the export and five runtimes: about a minute on 2 busy cores); .ci/run runs it.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from onnx_autodiff import TrainingSession, save_model  # noqa: E402
from onnx_autodiff.driver.bundle import export_step  # noqa: E402
from onnx_autodiff.runtimes import BundleTrainer  # noqa: E402
from onnx_autodiff.training import LossSpec, OptimizerSpec, make_training_model  # noqa: E402
from tests.integration.lora_models import VOCAB, causal_lm, export_dynamo  # noqa: E402
from tests.integration.test_runtimes import RTOL, rel  # noqa: E402
from tests.js_runtime import read_result, train_bundles, write_batches  # noqa: E402

pytestmark = pytest.mark.slow

LORA = {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}
ADAMW = {"weight_decay": 0.01}  # torch's AdamW otherwise, eps 1e-8
LR = 1e-2
STEPS = 3


def _batches() -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        mask = np.ones((2, 8), np.int64)
        mask[1, 6:] = 0  # a padded row
        out.append({"input_ids": rng.integers(0, VOCAB, (2, 8)), "attention_mask": mask})
    return out


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(bundle dir, inference model, batches, TrainingSession's losses, its state after the steps, before)."""
    work = tmp_path_factory.mktemp("lora_bundle")
    model = export_dynamo(causal_lm("llama", dtype=torch.float32), str(work / "llama.onnx"))
    training = make_training_model(model, LossSpec("causal_lm", options={"mask": "attention_mask"}),
                                   OptimizerSpec("adamw", ADAMW), lr=LR, lora=LORA)
    save_model(training, work / "training.onnx")
    training = onnx.load(work / "training.onnx")
    rng = np.random.default_rng(1)
    for t in training.graph.initializer:  # B off zero, as in test_lora.py: A's gradients are then not ~0
        if t.name.endswith(".lora_B"):
            t.CopyFrom(onnx.numpy_helper.from_array((rng.standard_normal(tuple(t.dims)) * 0.1).astype(np.float32),
                                                    t.name))
    export_step(training, work / "bundle", target="portable")
    sess = TrainingSession(training, progress=False)
    initial = {k: np.asarray(sess.state[k]).copy() for k in sess.state}
    batches = _batches()
    losses = [float(np.asarray(sess.step(b)[sess.loss_name]).reshape(-1)[0]) for b in batches]
    return work / "bundle", model, batches, losses, {k: np.asarray(sess.state[k]) for k in sess.state}, initial


def _compare(losses, state, ref_losses, ref_state, runtime):
    assert set(state) == set(ref_state)
    loss_err = max(rel(a, b) for a, b in zip(losses, ref_losses))
    errs = {k: rel(state[k], ref_state[k]) for k in ref_state}
    worst = max(errs, key=errs.get)
    print(f"\nLORA PARITY {runtime}: loss {loss_err:.1e}, state {errs[worst]:.1e} ({worst})")
    assert len(losses) == STEPS and loss_err <= RTOL, (losses, ref_losses)
    assert errs[worst] <= RTOL, f"{runtime}: {worst!r} off by {errs[worst]:.2e}"


def test_bundle_state_is_the_adapters_and_their_moments(case):
    bundle, model, _, _, ref_state, initial = case
    start = BundleTrainer(bundle, "onnxruntime").state  # what init.onnx gives
    assert set(start) == set(initial) and all(np.array_equal(start[k], initial[k]) for k in initial)
    state = json.loads((bundle / "bundle.json").read_text())["state"]
    adapters = {k for k in state if k.endswith((".lora_A", ".lora_B"))}
    assert len(adapters) == 8  # 2 layers x (q, v) x (A, B)
    moments = {f"train/{a}.{m}" for a in adapters for m in ("exp_avg", "exp_avg_sq")}
    assert set(state) == adapters | moments | {"train/iteration"}
    assert set(state) == set(ref_state)
    step = onnx.load(bundle / "step.onnx")
    base = {t.name: t for t in model.graph.initializer}
    inputs = {i.name for i in step.graph.input}
    assert not inputs & set(base)  # no base weight is fed: they are constants of the step
    consts = {t.name: t for t in step.graph.initializer if t.name in base}
    assert len(consts) == len(base)
    for name, t in consts.items():
        assert t.raw_data == base[name].raw_data or onnx.numpy_helper.to_array(t).tobytes() == \
            onnx.numpy_helper.to_array(base[name]).tobytes(), name


@pytest.mark.parametrize("runtime", ["onnxruntime", "reference", "openvino", "tract"])
def test_lora_bundle_trains_like_training_session(case, runtime):
    pytest.importorskip({"onnxruntime": "onnxruntime", "reference": "onnx", "openvino": "openvino",
                         "tract": "tract"}[runtime])
    bundle, _, batches, ref_losses, ref_state, _ = case
    trainer = BundleTrainer(bundle, runtime)
    losses = [trainer.step(b) for b in batches]
    assert losses[-1] != losses[0]
    _compare(losses, trainer.state, ref_losses, ref_state, runtime)


def test_lora_bundle_on_onnxruntime_node(case, tmp_path):
    """onnx_autodiff/web/train.js on onnxruntime-node (skips without node and tests/js's packages, unless
    ONNX_AUTODIFF_REQUIRE_JS=1)."""
    bundle, _, batches, ref_losses, ref_state, _ = case
    write_batches(tmp_path / "batches", batches, {"learning_rate": [LR] * STEPS})
    train_bundles("node", [{"bundle": str(bundle), "batches": str(tmp_path / "batches"),
                            "out": str(tmp_path / "node.json")}])
    losses, state = read_result(tmp_path / "node.json")
    _compare(losses, state, ref_losses, ref_state, "onnxruntime-node")
