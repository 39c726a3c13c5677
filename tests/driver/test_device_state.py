"""The step keeps its state where its execution provider computes (driver/state.py, driver/devices.py): every
crossing between host memory and the device goes through ``to_device``/``to_host``, counted in ``TRANSFERS``. On
the CPU nothing is copied (an OrtValue views its array) but the same code runs and counts, so these tests see
what a step on a GPU copies: the batch and the hyper-parameters up, the loss and the two NaN checks down. Adam's
bias corrections are host scalars: computed in float64 from a host copy of the step counter, fed as inputs."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from onnx_autodiff import TrainingSession, build_step_model, lower
from onnx_autodiff.driver.state import TRANSFERS
from onnx_autodiff.driver.step_model import feed_host_scalars, host_scalar_value
from tests.runtime_models import training_case


@pytest.fixture
def crossings(monkeypatch):
    """Every OrtValue made from numpy and every OrtValue read into numpy, whoever does it; the other ways
    of crossing (a CPU array bound as is, an in-place update from numpy) fail."""
    seen = {"up": 0, "down": 0}
    made, read = ort.OrtValue.ortvalue_from_numpy, ort.OrtValue.numpy

    def counted_made(*args, **kwargs):
        seen["up"] += 1
        return made(*args, **kwargs)

    def counted_read(self):
        seen["down"] += 1
        return read(self)

    def refused(*args, **kwargs):
        raise AssertionError("a step crossed to or from the device around to_device/to_host")

    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_numpy", staticmethod(counted_made))
    monkeypatch.setattr(ort.OrtValue, "numpy", counted_read)
    monkeypatch.setattr(ort.OrtValue, "update_inplace", refused)
    monkeypatch.setattr(ort.IOBinding, "bind_cpu_input", refused)
    monkeypatch.setattr(ort.IOBinding, "copy_outputs_to_cpu", refused)
    return seen


@pytest.mark.parametrize("optimizer,scalars", [("adam", 2), ("sgd", 1)])
def test_a_step_copies_the_batch_and_the_hyper_parameters_up_and_the_loss_and_checks_down(optimizer, scalars,
                                                                                        crossings):
    training, batches = training_case("mlp", optimizer)
    sess = TrainingSession(training, progress=False, outputs=[])  # the loss only: the logits stay where they are
    assert sess.device == "cpu"
    sess._plan.feed_cache = None  # a device's path: the host's reuse of the feeds' OrtValues off (runs.bind_feeds)
    sess.step(batches[0])  # the first step allocates the gradient and spare buffers
    for k in (1, 2):
        TRANSFERS.reset()
        crossings.update(up=0, down=0)
        out = sess.step({**batches[k], "learning_rate": np.array(0.01, np.float32)})
        assert list(out) == [sess.loss_name]
        # up: x, labels, lr, the counter's next value (and Adam's correction); down: the loss, two NaN checks
        assert (TRANSFERS.up, TRANSFERS.down) == (3 + scalars, 3)
        assert (crossings["up"], crossings["down"]) == (TRANSFERS.up, TRANSFERS.down)
    TRANSFERS.reset()
    sess.step(batches[3])  # the learning rate's default was put where the step runs once, at the start
    assert TRANSFERS.up == 2 + scalars
    TRANSFERS.reset()
    outputs = TrainingSession(training, progress=False)  # every output: the logits come back too
    outputs._plan.feed_cache = None
    outputs.step(batches[0])
    TRANSFERS.reset()
    assert set(outputs.step(batches[1])) == {"logits", outputs.loss_name} and TRANSFERS.down == 4


def test_bias_corrections_follow_the_step_counter_as_the_state_sets_it():
    """The session keeps a host copy of the counter: a state set from outside (a checkpoint's) continues with the
    corrections of its own step, bit for bit as the session that took those steps."""
    training, batches = training_case("mlp", "adam")
    a = TrainingSession(training, progress=False)
    for b in batches[:3]:
        a.step(b)
    b_sess = TrainingSession(training, progress=False)
    for name in a.state:
        b_sess.set_state(name, a.get_state(name))
    assert int(b_sess.get_state("train/iteration")) == 3
    la, lb = a.step(batches[3])["loss"], b_sess.step(batches[3])["loss"]
    assert lb == la
    for name in a.state:
        np.testing.assert_array_equal(b_sess.get_state(name), a.get_state(name), err_msg=name)
    with pytest.raises(ValueError, match="computed by the session from the step count"):
        a.step({**batches[4], "train/adam/bias_correction": np.float32(1)})


def test_host_scalars_replace_the_device_pow_and_keep_the_public_step_contract():
    training, _ = training_case("mlp", "adam")
    step = build_step_model(lower(training))
    assert "Pow" in {n.op_type for n in step.graph.node}  # build_step_model alone: the step computes them
    specs = feed_host_scalars(step)
    assert list(specs) == ["train/adam/bias_correction", "train/iteration.new/host"]
    assert "Pow" not in {n.op_type for n in step.graph.node}
    assert not [n for n in step.graph.node if n.op_type == "Add" and "train/iteration" in n.input]  # no int64 Add
    assert "train/adam/bias_correction" in {i.name for i in step.graph.input}
    spec = specs["train/adam/bias_correction"]
    assert spec["counter"] == "train/iteration" and spec["offset"] == 1
    t = 5 + 1
    want = np.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)  # torch's corrections, the spec's Adam factor
    assert host_scalar_value(spec, 5) == np.float32(want)
    assert host_scalar_value(specs["train/iteration.new/host"], 5) == 6
    sgd = build_step_model(lower(training_case("mlp", "sgd")[0]))
    assert feed_host_scalars(sgd) == {"train/iteration.new/host": {"counter": "train/iteration", "offset": 1,
                                                                   "dtype": "int32"}}
