"""The one step assembly (``driver/step.py``): what the session runs, the bundle writes and placement asks about
is one ``Step``, handed over as it was made (no metadata written to be read back)."""
from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest

from onnx_autodiff import TrainingSession, export_step
from onnx_autodiff.driver.accumulate import SplitStep
from onnx_autodiff.driver.bundle import bundle_step, write_bundle
from onnx_autodiff.driver.step import Step, assemble, open_step
from onnx_autodiff.errors import TrainingSpecError
from onnx_autodiff.model import metadata as md
from onnx_autodiff.model.carrier import open_model
from tests.cli_models import mlp_training_model

FEATURES, CLASSES = 8, 3


@pytest.fixture(scope="module")
def training():
    return mlp_training_model("adam", hidden=16, features=FEATURES, classes=CLASSES)


def batches(n=3):
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((6, FEATURES)).astype(np.float32), "labels": rng.integers(0, CLASSES, 6)}
            for _ in range(n)]


def test_a_step_made_first_trains_as_the_model_does(training):
    step = open_step(training)
    assert isinstance(step, Step) and not step.plain and step.loss == "loss"
    assert set(step.binding) <= set(step.state) and step.gradients["gradients"]
    made, direct = TrainingSession(step, progress=False), TrainingSession(training, progress=False)
    assert made.step_model is step.model and made.update_binding == direct.update_binding
    for feeds in batches():
        a, b = made.step(feeds), direct.step(feeds)
        assert float(a["loss"]) == float(b["loss"])
    for name, value in direct.state.items():
        np.testing.assert_array_equal(made.state[name], value)


def test_nothing_is_written_to_be_read_back(training):
    """The session's models do not carry the gradients' names; its checkpoint does, for a later session, which
    then still splits the step into its two halves."""
    sess = TrainingSession(training, progress=False)
    assert md.GRADIENTS not in md.read(sess.model) and md.GRADIENTS not in md.read(sess.step_model)
    checkpoint = sess.checkpoint()
    recorded = json.loads(md.read(checkpoint)[md.GRADIENTS])
    assert recorded == open_step(training).gradients
    resumed = TrainingSession(checkpoint, progress=False)
    assert resumed.averaged_outputs == sess.averaged_outputs
    assert set(resumed.update_inputs) == set(sess.update_inputs)


def test_a_step_refuses_the_options_that_make_one(training):
    step = open_step(training)
    with pytest.raises(TrainingSpecError, match=r"\['dims'\] make a step.*open_step"):
        TrainingSession(step, dims={"N": 6}, progress=False)
    with pytest.raises(TrainingSpecError, match="a bundle's"):
        TrainingSession(assemble(open_model(training), plain=True), progress=False)
    with pytest.raises(TrainingSpecError, match="assembled for target 'tract'.*runs target None"):
        TrainingSession(assemble(open_model(training), "tract"), progress=False)


def test_the_bundle_writes_its_plain_step(training, tmp_path):
    step = bundle_step(training, "portable")
    assert step.plain and "learning_rate" in step.hyper and set(step.binding) == set(step.state)
    assert not {t.name for t in step.model.graph.initializer} & {i.name for i in step.model.graph.input}
    written = json.loads(write_bundle(step, tmp_path / "a").read_text())
    exported = json.loads(export_step(training, tmp_path / "b", "portable").read_text())
    assert written == exported
    for name in ("step.onnx", "init.onnx"):
        a, b = onnx.load(str(tmp_path / "a" / name)), onnx.load(str(tmp_path / "b" / name))
        assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True), name


def test_split_step_reads_only_the_public_halves(training):
    sess = TrainingSession(training, progress=False)
    split = SplitStep(sess, ["x", "labels"], accumulate=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (split.steps, split.loss_name, split.feed_names) == (0, sess.loss_name, sess.feed_names)
        split.step(batches(1)[0])
    assert sess.steps == 1
    with pytest.warns(DeprecationWarning, match=r"SplitStep\.session\.output_names"):
        assert split.output_names == sess.output_names
