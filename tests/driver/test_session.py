"""TrainingSession: state, resume bit for bit, NaN stop, atomic checkpoints, inference export."""
from __future__ import annotations

import os
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from onnx_autodiff import TrainingDivergedError, TrainingSession, make_training_model
from onnx_autodiff.model.io import save_model_atomic
from tests.driver.test_training_spec import PARAMS, mlp_training_model, mlp_weights, toy_data


def _snapshot(sess):
    return {k: sess.state[k].copy() for k in sess.state}


def test_state_lives_in_ortvalues_and_get_set():
    sess = TrainingSession(mlp_training_model())
    assert set(sess.state) >= set(PARAMS) | {"T"}
    assert isinstance(sess.get_ortvalue("W1"), ort.OrtValue)
    np.testing.assert_array_equal(sess.state["W1"], mlp_weights()["W1"])
    sess.state["B2"] = np.array([1.0, 2.0, 3.0], np.float32)
    np.testing.assert_array_equal(sess.get_state("B2"), [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="shape"):
        sess.set_state("B2", np.zeros(4, np.float32))
    with pytest.raises(KeyError, match="not a mutable tensor"):
        sess.state["X"]
    sess.step(toy_data(1)[0])
    assert int(sess.state["T"]) == 2
    assert not np.array_equal(sess.state["B2"], [1.0, 2.0, 3.0])


@pytest.mark.parametrize("k", [1, 7])
def test_save_and_resume_is_bit_exact(tmp_path, k):
    batches = toy_data(12)
    full = TrainingSession(mlp_training_model())
    full.reset()
    start = _snapshot(full)
    for b in batches:
        full.step(b)

    part = TrainingSession(mlp_training_model())
    for name, value in start.items():
        part.state[name] = value
    for b in batches[:k]:
        part.step(b)
    path = tmp_path / "ckpt.onnx"
    part.save(path)
    resumed = TrainingSession(str(path))
    assert resumed.steps == k
    assert len(onnx.load(str(path)).training_info) == 1
    for b in batches[k:]:
        resumed.step(b)
    end, want = _snapshot(resumed), _snapshot(full)
    assert set(end) == set(want)
    for name in want:
        assert end[name].tobytes() == want[name].tobytes(), name


def test_nan_stops_training_and_keeps_the_last_good_state():
    sess = TrainingSession(mlp_training_model())
    batches = toy_data(3)
    sess.step(batches[0])
    good = _snapshot(sess)
    bad = dict(batches[1])
    bad["X"] = bad["X"].copy()
    bad["X"][0, 0] = np.nan
    with pytest.raises(TrainingDivergedError, match=r"step 2: tensor 'loss' contains NaN or Inf") as err:
        sess.step(bad)
    assert err.value.step == 2 and err.value.tensor == "loss"
    assert sess.steps == 1
    for name, value in good.items():
        np.testing.assert_array_equal(sess.state[name], value)


def test_inf_in_an_updated_tensor_names_it():
    """A loss that stays finite while an update overflows: the error names the updated tensor."""
    sess = TrainingSession(mlp_training_model())
    sess.state["B1_V"] = np.full(8, np.inf, np.float32)  # momentum of B1 -> B1_new becomes Inf/NaN
    before = sess.state["W1"].copy()
    with pytest.raises(TrainingDivergedError,
                       match=r"step 1: tensor '(B1_new|B1_V_new)' \(the new value of 'B1(_V)?'\)"):
        sess.step(toy_data(1)[0])
    np.testing.assert_array_equal(sess.state["W1"], before)
    assert np.isinf(sess.state["B1_V"]).all()


def test_train_reports_progress_and_calls_back(capsys):
    sess = TrainingSession(mlp_training_model())
    seen = []
    losses = sess.train(toy_data(5), epochs=2, callback=lambda step, out: seen.append((step, float(out["loss"]))))
    assert len(losses) == 10 and [s for s, _ in seen] == list(range(1, 11))
    assert [loss for _, loss in seen] == pytest.approx(losses)
    err = capsys.readouterr().err  # not a terminal: plain lines, no carriage returns in a log
    assert "epoch 2/2: 5/5 steps, step loss " in err and "\r" not in err


def test_train_stops_when_callback_returns_false():
    sess = TrainingSession(mlp_training_model())
    losses = sess.train(toy_data(5), callback=lambda step, out: step < 3, progress=False)
    assert len(losses) == 3 and sess.steps == 3


def test_train_rejects_a_used_up_iterator():
    sess = TrainingSession(mlp_training_model())
    with pytest.raises(ValueError, match="iterator"):
        sess.train(iter(toy_data(2)), epochs=2, progress=False)


def test_export_inference_has_trained_weights(tmp_path):
    sess = TrainingSession(mlp_training_model())
    sess.train(toy_data(5), progress=False)
    path = tmp_path / "inf.onnx"
    sess.export_inference(path)
    model = onnx.load(str(path))
    assert len(model.training_info) == 0
    assert {o.domain for o in model.opset_import} <= {"", "ai.onnx"}
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for p in PARAMS:
        np.testing.assert_array_equal(inits[p], sess.state[p])
    x = toy_data(1)[0]["X"]
    y = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    w = sess.state
    want = np.maximum(x @ w["W1"] + w["B1"], 0) @ w["W2"] + w["B2"]
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_external_data_checkpoint_resumes(tmp_path):
    sess = TrainingSession(mlp_training_model(mlp_weights(hidden=300), hidden=300))
    sess.step(toy_data(1)[0])
    path = tmp_path / "big.onnx"
    sess.save(path, external_data_threshold=0)
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 2 and files[0] == "big.onnx"  # no temp files left behind
    assert re.fullmatch(r"big\.onnx\.[0-9a-f]{12}\.data", files[1])
    raw = onnx.load(str(path), load_external_data=False)
    moved = [t.name for t in raw.training_info[0].algorithm.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert "W1_V" in moved and "W1_H" in moved  # optimizer state goes out too, not only ModelProto.graph
    resumed = TrainingSession(str(path))
    for name in sess.state:
        assert resumed.state[name].tobytes() == sess.state[name].tobytes()


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "m.onnx"
    model = mlp_training_model()
    save_model_atomic(model, path)
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        save_model_atomic(onnx.ModelProto(), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.onnx"]


def test_cuda_requested_but_unavailable_falls_back_to_cpu():
    sess = TrainingSession(mlp_training_model(), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    if "CUDAExecutionProvider" in ort.get_available_providers():
        assert sess.device == "cuda"
    else:
        assert sess.device == "cpu" and sess.providers == ["CPUExecutionProvider"]
    sess.step(toy_data(1)[0])
    assert int(sess.state["T"]) == 2


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adagrad", "adam", "adamw"])
def test_in_place_update_is_bit_identical_to_two_buffers(optimizer):
    """The apply part writes each weight and optimizer state into its own buffer where every reader
    runs first; the result must be the very same bits as with a spare buffer per tensor."""
    from onnx_autodiff import make_training_model
    from tests.training.test_training_builder import batches, mlp, weights

    model = make_training_model(mlp(weights()), "cross_entropy", optimizer, lr=0.05)
    fast, plain = TrainingSession(model), TrainingSession(model, in_place=False)
    assert fast._buffers.inplace and not plain._buffers.inplace
    for x, t in batches(6):
        feeds = {"X": x, "labels": t}
        np.testing.assert_array_equal(fast.step(feeds)["loss"], plain.step(feeds)["loss"])
    for name in fast.state:
        assert fast.state[name].tobytes() == plain.state[name].tobytes(), name


def test_state_read_before_a_step_keeps_its_value():
    """state[name] is a copy: the step after updates the tensor's buffer in place."""
    sess = TrainingSession(mlp_training_model())
    for b in toy_data(3):
        before = sess.state["W1"]
        sess.step(b)
        assert not np.array_equal(before, sess.state["W1"])


def _linear_model():
    from onnx import TensorProto, helper

    rng = np.random.default_rng(3)
    w1 = numpy_helper.from_array(rng.standard_normal((64, 32)).astype(np.float32) * 0.3, "W1")
    w2 = numpy_helper.from_array(rng.standard_normal((32, 10)).astype(np.float32) * 0.3, "W2")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W1"], ["h"], name="mm1"),
         helper.make_node("Tanh", ["h"], ["t"], name="tanh"),
         helper.make_node("MatMul", ["t", "W2"], ["logits"], name="mm2")],
        "linear", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], [w1, w2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_modelproto_session_keeps_one_buffer_per_weight_and_resets():
    """From a ModelProto the session's arrays are copies only it holds (fresh optimizer state is made as
    zeros), so a tensor updated in place never gets a second buffer; reset() reads the model again."""
    from onnx_autodiff import make_training_model

    model = make_training_model(_linear_model(), "cross_entropy", "adam", lr=0.05)
    rng = np.random.default_rng(0)
    batches = [{"X": rng.standard_normal((8, 64)).astype(np.float32), "labels": rng.integers(0, 10, 8)}
               for _ in range(4)]
    sess = TrainingSession(model, progress=False)
    b = sess._buffers
    assert {"W1", "W2"} <= b.private and {"W1", "W2"} <= b.owned
    assert len(b.zeros) == 2  # Adam's two moments of W1 (W2's are small enough to stay inline)
    ours = b.inplace & b.owned
    assert {"W1", "W2"} <= ours
    where = {k: sess.get_ortvalue(k).data_ptr() for k in ours}
    first = [float(sess.step(f)["loss"]) for f in batches]
    assert all(b.spare.get(k) is None for k in ours)
    assert {k: sess.get_ortvalue(k).data_ptr() for k in ours} == where  # written where it lives
    assert not np.array_equal(sess.state["W1"], numpy_helper.to_array(model.graph.initializer[0]))
    sess.reset()
    np.testing.assert_array_equal(sess.state["W1"], numpy_helper.to_array(model.graph.initializer[0]))
    assert not sess.state[sorted(b.zeros)[0]].any()
    again = [float(sess.step(f)["loss"]) for f in batches]
    fresh = TrainingSession(model, progress=False, in_place=False)
    assert again == first == [float(fresh.step(f)["loss"]) for f in batches]


def test_gradients_names_every_parameter_also_where_two_gradients_are_one_expression():
    """y = x * a + x * b: dL/da and dL/db are the same expression, and the lowering's clean-up merged them, so
    gradients() had no entry for b. Each Gradient output keeps its name; the step updates both alike."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("Mul", ["x", "a"], ["xa"]), helper.make_node("Mul", ["x", "b"], ["xb"]),
             helper.make_node("Add", ["xa", "xb"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])],
                              [numpy_helper.from_array(np.ones(3, np.float32), "a"),
                               numpy_helper.from_array(np.full(3, 2.0, np.float32), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = TrainingSession(make_training_model(model, "mse", "sgd", lr=0.1))
    rng = np.random.default_rng(0)
    feeds = {"x": rng.random((4, 3), np.float32), "labels": rng.random((4, 3), np.float32)}
    values = sess.gradients(feeds)
    ga, gb = (np.asarray(values[f"train/{p}_grad"].numpy()) for p in "ab")
    np.testing.assert_array_equal(ga, gb)
    x, t = feeds["x"], feeds["labels"]
    expected = (2 * (x * 3 - t) * x / t.size).sum(0)  # mse: mean of squares; y = 3x at a = 1, b = 2
    np.testing.assert_allclose(ga, expected, rtol=1e-5)
    sess.apply_gradients(values, feeds)
    np.testing.assert_allclose(sess.get_state("a") - 1.0, sess.get_state("b") - 2.0, rtol=1e-6)
