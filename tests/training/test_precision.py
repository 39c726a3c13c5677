"""Mixed precision (training/precision.py): float32 masters of what trains, float32 optimizer state, the loss in
float32, dynamic loss scaling that skips an overflowing step, and the export in the model's own precision; on a
float16 file, and on a float32 model converted to float16 or bfloat16 (bfloat16 steps on the CPU compute in float32
between Casts)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from onnx_autodiff import LossSpec, Precision, TrainingSession, make_training_model
from onnx_autodiff.errors import TrainingBuilderError
from onnx_autodiff.training import builder_record
from onnx_autodiff.training.precision import precision_record
from tests.optimum_models import feeds

pytest.importorskip("transformers")
LOSS = LossSpec("causal_lm", options={"mask": "attention_mask"})


def _batch(path, seed=0):
    return feeds(path, np.random.default_rng(seed).integers(3, 1000, (4, 12)))


def _losses(model, path, steps, **kw):
    sess = TrainingSession(make_training_model(model, LOSS, "sgd", lr=1e-2, **kw), outputs=["loss"], progress=False)
    return [float(sess.step(_batch(path))["loss"]) for _ in range(steps)], sess


def test_float16_file_trains_float32_masters_and_exports_float16(optimum_models, tmp_path):
    path = optimum_models.get("gpt2", "fp16")
    training = make_training_model(str(path), LOSS, "adamw", lr=1e-3)
    record = precision_record(training)
    assert record["dtype"] == "fp16" and record["loss_scale"]["dynamic"]
    trained = builder_record(training)["trainable"]
    assert trained and all(name.endswith(".fp32") for name in trained)
    sess = TrainingSession(training, outputs=["loss"], progress=False)
    floats = {n: v.dtype for n, v in sess.state.items() if v.dtype.kind == "f"}
    assert set(floats.values()) == {np.dtype(np.float32)}  # masters, Adam's moments, the loss scale
    losses = [float(sess.step(_batch(path))["loss"]) for _ in range(3)]
    assert all(b < a for a, b in zip(losses, losses[1:]))
    sess.export_inference(tmp_path / "out.onnx")
    out, original = onnx.load(str(tmp_path / "out.onnx")), onnx.load(str(path))
    assert {t.name: t.data_type for t in out.graph.initializer} == {t.name: t.data_type for t in
                                                                    original.graph.initializer}
    assert not any(n.output[0].endswith(".fp32") or n.input[0].endswith(".fp32") for n in out.graph.node
                   if n.input)


def test_float16_follows_float32_from_the_same_start(optimum_models):
    """A float32 model trained with precision="fp16" against itself in float32, 5 SGD steps: the losses within
    1e-3 relative (float16 keeps 11 bits: 4.9e-4 per rounding; the loss itself is float32)."""
    path = optimum_models.get("gpt2", "plain")
    ref, _ = _losses(str(path), path, 5)
    half, sess = _losses(str(path), path, 5, precision="fp16")
    assert np.max(np.abs(np.array(half) - ref) / np.array(ref)) < 1e-3
    masters = precision_record(sess.model)["masters"]
    start = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    fresh = make_training_model(str(path), LOSS, "sgd", precision="fp16")
    values = {t.name: t for t in fresh.graph.initializer}
    for weight, master in list(masters.items())[:4]:  # masters start from the float32 values, not their rounding
        assert np.array_equal(numpy_helper.to_array(values[master]), start[weight])


def test_overflow_skips_the_step_and_backs_off_then_grows(optimum_models):
    """A scale of 2^40 makes the float16 backward overflow: the step is skipped (no weight, no optimizer state, no
    step count changes) and the scale halves, until a step goes through; after 2 clean steps it doubles."""
    path = optimum_models.get("gpt2", "fp16")
    precision = Precision("fp16", init_scale=2.0 ** 40, growth_interval=2)
    training = make_training_model(str(path), LOSS, "adamw", lr=1e-3, precision=precision)
    sess = TrainingSession(training, outputs=["loss"], progress=False)
    master = builder_record(training)["trainable"][0]
    iteration = builder_record(training)["iteration"]
    log = []
    for _ in range(30):
        before = sess.get_state(master)
        out = sess.step(_batch(path))
        log.append((float(out["loss_scale"]), bool(out["step_skipped"])))
        assert np.array_equal(sess.get_state(master), before) == log[-1][1]  # a skipped step changes nothing
    assert log[0] == (2.0 ** 40, True) and not all(s for _, s in log)
    scale, clean = log[0][0], 0
    for used, skipped in log:  # torch.amp.GradScaler's schedule, replayed from the skip flags
        assert used == scale
        clean = 0 if skipped else clean + 1
        scale = scale / 2 if skipped else scale * 2 if clean == 2 else scale
        clean = 0 if clean == 2 else clean
    assert int(sess.get_state(iteration)) == sum(not s for _, s in log)


def test_bfloat16_converts_trains_on_the_cpu_and_exports_bfloat16(optimum_models, tmp_path):
    path = optimum_models.get("gpt2", "plain")
    ref, _ = _losses(str(path), path, 4)
    bf16, sess = _losses(str(path), path, 4, precision="bf16")
    assert precision_record(sess.model)["loss_scale"] is None  # bfloat16 has float32's range: no scaling
    assert np.max(np.abs(np.array(bf16) - ref) / np.array(ref)) < 2e-2  # 8 bits: 3.9e-3 per rounding
    sess.export_inference(tmp_path / "out.onnx")
    out = onnx.load(str(tmp_path / "out.onnx"))
    kinds = {t.data_type for t in out.graph.initializer if t.data_type in (TensorProto.FLOAT, TensorProto.BFLOAT16)}
    assert kinds == {TensorProto.BFLOAT16}
    wte = next(t for t in out.graph.initializer if t.name == "transformer.wte.weight")
    assert numpy_helper.to_array(wte).view(ml_dtypes.bfloat16).dtype == ml_dtypes.bfloat16


def test_a_float16_model_does_not_train_in_bfloat16(optimum_models):
    with pytest.raises(TrainingBuilderError, match="train it in its own precision"):
        make_training_model(str(optimum_models.get("gpt2", "fp16")), LOSS, "sgd", precision="bf16")
