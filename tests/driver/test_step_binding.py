"""The step's IOBinding kept between runs (runs.py ``StepRuns.execute``): what a step returns is its own
memory, and what stayed bound (state updated in place, the gradient buffers) is not bound again."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from onnx_autodiff import TrainingSession, make_training_model
from tests.models import model, vi


def _training_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = {"W1": rng.normal(size=(8, 4)).astype(np.float32), "B1": np.zeros(8, np.float32),
             "W2": rng.normal(size=(3, 8)).astype(np.float32), "B2": np.zeros(3, np.float32)}
    nodes = [helper.make_node("Gemm", ["x", "W1", "B1"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["a"]),
             helper.make_node("Gemm", ["a", "W2", "B2"], ["logits"], transB=1)]
    return make_training_model(model(nodes, [vi("x", ["N", 4])], [vi("logits", ["N", 3])], inits),
                               "cross_entropy", "adam")


def _batch(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(6, 4)).astype(np.float32), "labels": rng.integers(0, 3, 6).astype(np.int64)}


def test_outputs_of_a_step_are_not_overwritten_by_the_next():
    sess = TrainingSession(_training_model(), progress=False)
    first = sess.step(_batch(1))
    kept = {k: v.copy() for k, v in first.items()}
    second = sess.step(_batch(2))
    assert not np.allclose(second["logits"], kept["logits"])
    for k, v in kept.items():
        np.testing.assert_array_equal(first[k], v)


def test_gradients_of_two_calls_are_distinct():
    sess = TrainingSession(_training_model(), progress=False)
    a = sess.gradients(_batch(1))
    copies = {k: v.numpy().copy() for k, v in a.items()}
    b = sess.gradients(_batch(2))
    assert not np.allclose(b[sess.loss_name].numpy(), copies[sess.loss_name])
    for k, v in copies.items():
        np.testing.assert_array_equal(a[k].numpy(), v)


def test_state_bound_once_stays_bound():
    """After the first steps, a step binds again only the outputs that go to new memory (the loss, the
    check sums, ...): none of the parameters, moments or gradient buffers."""
    sess = TrainingSession(_training_model(), progress=False)
    for s in range(3):
        sess.step(_batch(s))
    calls = []
    for run in sess._runs:
        io = run.io
        io.bind_ortvalue_output = lambda name, value, _io=io: calls.append(name) or type(_io).bind_ortvalue_output(
            _io, name, value)
    before = {k: sess.get_state(k) for k in sess.state}
    sess.step(_batch(9))
    state_outputs = set(sess.update_binding.values())
    assert not [n for n in calls if n in state_outputs or n.endswith("_grad")], calls
    assert any(not np.array_equal(before[k], sess.get_state(k)) for k in before)  # the step did update
