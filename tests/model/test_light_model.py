"""make_training_model returns a LightModel: no weight copied into protobuf, the optimizer's zeros made
where they are used, and still usable as the ModelProto it stands for (issue 21)."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from onnx_autodiff import LightModel, TrainingSession, TrainingSpecError, export_step, lower, make_training_model
from onnx_autodiff.graph import top_graphs
from onnx_autodiff.model.io import load_split
from onnx_autodiff.model.weights import detached_names
from tests.training.test_training_builder import PARAMS, mlp, weights

X = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
FEEDS = {"X": X, "labels": np.arange(8, dtype=np.int64) % 3}


def big_mlp(n=64):
    """The builder tests' MLP with W1 and W2 large enough to leave protobuf (>= 1 KiB)."""
    rng = np.random.default_rng(1)
    w = {"W1": rng.normal(size=(4, n)).astype(np.float32) * 0.3, "B1": np.full(n, 0.01, np.float32),
         "W2": rng.normal(size=(n, 3)).astype(np.float32) * 0.3, "B2": np.full(3, 0.02, np.float32)}
    return mlp(w)


def losses(model, steps=3):
    s = TrainingSession(model, progress=False)
    out = [float(s.step(FEEDS)["loss"]) for _ in range(steps)]
    return out, {k: s.get_state(k) for k in PARAMS}


def test_the_result_is_light_and_trains_as_the_whole_model():
    model = big_mlp()
    tm = make_training_model(model, "cross_entropy", "adam")
    assert isinstance(tm, LightModel) and not tm.is_whole
    light_losses, light_state = losses(tm)
    assert not tm.is_whole  # the session read the light model and its arrays, no ModelProto field
    whole = tm.whole_copy()
    assert isinstance(whole, onnx.ModelProto) and not detached_names(whole)
    whole_losses, whole_state = losses(whole)
    assert light_losses == whole_losses
    for k in PARAMS:
        np.testing.assert_array_equal(light_state[k], whole_state[k])
    # a second session starts from the model's values again: the first trained its own copies
    again, _ = losses(tm)
    assert again == light_losses


def test_no_weight_is_copied_and_the_optimizer_state_is_zeros_outside_protobuf():
    model = big_mlp()
    tm = make_training_model(model, "cross_entropy", "adam")
    light, arrays, copied = tm.parts()
    big = {t.name for t in model.graph.initializer if t.raw_data and len(t.raw_data) >= 1024}
    assert big and big <= copied  # read from the caller's ModelProto when needed, not held
    assert not set(arrays.own) & big
    moments = [n for n in detached_names(light) if n not in copied]
    assert moments and all(not arrays[n].any() for n in moments)
    assert all(len(t.raw_data) < 1024 for g in top_graphs(light) for t in g.initializer)


def test_from_a_path_the_weights_are_memory_maps(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(big_mlp(), str(path), save_as_external_data=True, location="mlp.onnx.data", size_threshold=0)
    tm = make_training_model(str(path), "cross_entropy", "adam")
    assert isinstance(tm.arrays["W1"], np.memmap)
    from_path, _ = losses(tm)
    from_proto, _ = losses(make_training_model(big_mlp(), "cross_entropy", "adam"))
    assert from_path == from_proto


def test_save_lower_export_step_and_onnx_tools_keep_it_light(tmp_path):
    tm = make_training_model(big_mlp(), "cross_entropy", "adam")
    tm.save(tmp_path / "train.onnx", external_data_threshold=0)
    light, arrays = load_split(str(tmp_path / "train.onnx"))
    inline = {t.name: t for g in top_graphs(light) for t in g.initializer}
    for name in detached_names(tm.light):
        saved = arrays[name] if name in arrays else onnx.numpy_helper.to_array(inline[name])
        np.testing.assert_array_equal(saved, tm.arrays[name])
    assert isinstance(lower(tm), LightModel)
    manifest = json.loads(export_step(tm, tmp_path / "bundle").read_text())
    assert manifest["loss"]
    onnx.checker.check_model(tm, full_check=True)  # the whole model's bytes, made and dropped
    onnx.save(tm, str(tmp_path / "whole.onnx"))
    saved = onnx.load(str(tmp_path / "whole.onnx"))
    assert not detached_names(saved) and len(saved.training_info) == 1
    assert losses(saved)[0] == losses(str(tmp_path / "train.onnx"))[0]
    with pytest.raises(TrainingSpecError, match="open the model by its path"):
        TrainingSession(onnx.load(str(tmp_path / "train.onnx")), progress=False)  # training_info's data not loaded


def test_using_a_field_makes_it_the_whole_model_and_changes_count():
    tm = make_training_model(big_mlp(), "cross_entropy", "adam")
    before, _ = losses(tm)
    w1 = next(t for t in tm.graph.initializer if t.name == "W1")  # a ModelProto field: now whole
    assert tm.is_whole and not detached_names(tm.proto())
    arr = onnx.numpy_helper.to_array(w1) * 0.5
    w1.CopyFrom(onnx.numpy_helper.from_array(arr, "W1"))
    after, state = losses(tm)
    assert after != before  # the session trains the changed whole model
    tm.doc_string = "set through the stand-in"
    assert tm.proto().doc_string == "set through the stand-in"


def test_a_light_model_is_refused_as_an_inference_model():
    from onnx_autodiff import TrainingBuilderError

    with pytest.raises(TrainingBuilderError, match="already has training_info"):
        make_training_model(make_training_model(mlp(weights())))


def test_a_gradient_the_step_returns_is_not_overwritten_by_the_next_step():
    """step() writes the gradients into one buffer per parameter that every step reuses; a gradient the
    algorithm also outputs is returned as a copy, so what a caller keeps from step k stays step k's."""
    tm = make_training_model(big_mlp(), "cross_entropy", "sgd", lr=0.5).proto()
    alg = tm.training_info[0].algorithm
    grad = next(o for n in alg.node if n.op_type == "Gradient" for o in n.output if "W1" in o)
    alg.output.append(onnx.helper.make_tensor_value_info(grad, onnx.TensorProto.FLOAT, None))
    s = TrainingSession(tm, progress=False)
    first = s.step(FEEDS)[grad]
    kept = first.copy()
    second = s.step(FEEDS)[grad]
    np.testing.assert_array_equal(first, kept)
    assert not np.array_equal(first, second)  # the weights moved, so the gradient did
    fresh = TrainingSession(tm, progress=False)
    np.testing.assert_array_equal(fresh.step(FEEDS)[grad], kept)


def test_outputs_keeps_only_what_the_caller_reads():
    """TrainingSession(outputs=[...]) computes and returns only those step outputs and the loss; the
    inference outputs left out are not outputs of onnxruntime's runs (freed when read); same training."""
    tm = make_training_model(big_mlp(), "cross_entropy", "adam")
    full = TrainingSession(tm, progress=False)
    assert "Z" in full.output_names
    lean = TrainingSession(tm, progress=False, outputs=[])
    assert lean.output_names == ["loss"] and all("Z" not in r.outputs for r in lean._runs)
    for _ in range(3):
        a, b = full.step(FEEDS), lean.step(FEEDS)
        assert set(b) == {"loss"} and float(a["loss"]) == float(b["loss"])
    with pytest.raises(TrainingSpecError, match="not outputs of the step"):
        TrainingSession(tm, progress=False, outputs=["nope"])
