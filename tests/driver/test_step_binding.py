"""The step's IOBinding kept between runs (runs.py ``StepRuns.execute``): what a step returns is its own
memory, and what stayed bound (state updated in place, the gradient buffers) is not bound again."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
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
    logits): none of the parameters, moments, gradient buffers or check sums (a scalar of ours on the CPU)."""
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
    state_outputs = set(sess.update_binding.values()) | {run.check for run in sess._runs}
    assert not [n for n in calls if n in state_outputs or n.endswith("_grad")], calls
    assert any(not np.array_equal(before[k], sess.get_state(k)) for k in before)  # the step did update


def test_feeds_of_the_last_step_serve_again_and_what_is_written_into_them_is_read(monkeypatch):
    """On the CPU the step keeps the OrtValues of its feeds (runs.bind_feeds' cache): the same arrays fed
    again make no OrtValue and bind nothing again, and what the user wrote into them since is what the step
    reads; a new learning rate at every step is copied into a buffer of ours. Every loss and state tensor is
    bit for bit what a session without the cache computes from fresh copies."""
    cached, plain = TrainingSession(_training_model(), progress=False), TrainingSession(_training_model(),
                                                                                      progress=False)
    plain._plan.feed_cache = None
    feeds = _batch(0)
    for s in range(4):
        if s:
            made, bound = [], []
            monkeypatch.setattr(ort.OrtValue, "ortvalue_from_numpy", staticmethod(
                lambda *a, _f=ort.OrtValue.ortvalue_from_numpy, _m=made, **k: _m.append(a) or _f(*a, **k)))
            for run in cached._runs:
                run.io.bind_ortvalue_input = lambda name, value, _io=run.io, _b=bound: _b.append(name) or \
                    type(_io).bind_ortvalue_input(_io, name, value)
        new = _batch(s)
        for name, value in new.items():
            feeds[name][...] = value  # the same arrays, new contents
        lr = np.array(0.01 * (s + 1), np.float32)
        got = cached.step({**feeds, "learning_rate": lr})
        if s:
            monkeypatch.undo()
            fed = set(feeds) | {"learning_rate"} | set(cached.host_scalars)
            assert not made and not fed & set(bound), (made, bound)
        want = plain.step({**{k: v.copy() for k, v in feeds.items()}, "learning_rate": lr.copy()})
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v)
    for name in plain.state:
        np.testing.assert_array_equal(cached.get_state(name), plain.get_state(name))


def test_a_feed_of_another_shape_or_a_new_array_is_bound_anew():
    sess, plain = TrainingSession(_training_model(), progress=False), TrainingSession(_training_model(),
                                                                                    progress=False)
    plain._plan.feed_cache = None
    batches = [_batch(1), _batch(2), {k: v[:4].copy() for k, v in _batch(3).items()}]
    for b in batches:
        got, want = sess.step(b), plain.step({k: v.copy() for k, v in b.items()})
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v)
    assert sess.step(batches[2])["logits"].shape == (4, 3)
