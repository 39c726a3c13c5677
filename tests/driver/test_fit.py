"""TrainingSession.fit: resumable epochs over arrays, from Python (the CLI's train is the same code)."""
from __future__ import annotations

import numpy as np
import pytest

from onnx_autodiff import TrainingSession
from onnx_autodiff.errors import CheckpointError, DataError, TrainingSpecError
from tests.cli_models import digits_like, mlp_training_model

PARAMS = ["W1", "b1", "W2", "b2"]


def model():
    return mlp_training_model(hidden=16, features=8)


def data(seed=1):
    x, y = digits_like(n=40, features=8, seed=seed)
    return {"X": x, "y": y}


def weights(sess):
    return {n: sess.state[n] for n in PARAMS}


def test_a_killed_run_resumes_to_the_weights_of_an_uninterrupted_one(tmp_path):
    straight = TrainingSession(model(), progress=False)
    whole = straight.fit(data(), batch_size=16, epochs=3, progress=False)
    assert whole.epochs_done == 3 and whole.steps == 9 and len(whole.losses) == 3

    first = TrainingSession(model(), progress=False)
    part = first.fit(data(), batch_size=16, epochs=2, checkpoint=tmp_path / "ck", progress=False)
    assert part.epochs_done == 2 and (tmp_path / "ck" / "checkpoint.onnx").exists()
    del first  # as if the process had been killed after epoch 2

    lines = []
    again = TrainingSession(model(), progress=False)  # from the training model, not the checkpoint
    done = again.fit(data(), batch_size=16, epochs=3, checkpoint=tmp_path / "ck", progress=False, log=lines.append)
    assert any(line.startswith("resuming from") for line in lines), lines
    assert done.losses[:2] == part.losses and done.steps == 9 and again.steps == 9
    for n, w in weights(straight).items():
        np.testing.assert_array_equal(weights(again)[n], w)

    from_checkpoint = TrainingSession(tmp_path / "ck" / "checkpoint.onnx", progress=False)
    lines.clear()
    assert from_checkpoint.fit(data(), batch_size=16, epochs=3, checkpoint=tmp_path / "ck", progress=False,
                               log=lines.append).epochs_done == 3
    assert "nothing to do" in lines[-1]


def test_resume_refuses_other_data_or_another_order(tmp_path):
    TrainingSession(model(), progress=False).fit(data(), batch_size=16, epochs=1, checkpoint=tmp_path, progress=False)
    with pytest.raises(CheckpointError, match="trained on other data"):
        TrainingSession(model(), progress=False).fit(data(seed=2), batch_size=16, epochs=2, checkpoint=tmp_path,
                                                     progress=False)
    with pytest.raises(CheckpointError, match="trained with --batch-size 16") as e:
        TrainingSession(model(), progress=False).fit(data(), batch_size=8, epochs=2, checkpoint=tmp_path,
                                                     progress=False)
    assert e.value.exit_code == 2 and "pass the same --batch-size" in e.value.hint


def test_learning_rate_schedule_and_callbacks():
    sess = TrainingSession(model(), progress=False)
    before = weights(sess)
    seen, epochs = [], []
    sess.fit(data(), batch_size=16, epochs=2, lr=lambda steps: 0.0, progress=False,
             on_epoch=lambda s: epochs.append(s.epochs_done),
             callback=lambda step, out: seen.append(step))
    assert seen == [1, 2, 3, 4, 5, 6] and epochs == [1, 2]
    for n, w in before.items():  # Adam with a zero rate moves nothing
        np.testing.assert_array_equal(weights(sess)[n], w)
    sess.fit(data(), batch_size=16, epochs=1, lr=lambda steps: 0.01, progress=False)
    assert not np.array_equal(weights(sess)["W1"], before["W1"])


def test_bad_data_is_named_before_the_first_step(tmp_path):
    sess = TrainingSession(model(), progress=False)
    bad = data()
    bad["X"][3, 1] = np.nan
    with pytest.raises(DataError, match="NaN") as e:
        sess.fit(bad, checkpoint=tmp_path / "ck", progress=False)
    assert sess.steps == 0 and not (tmp_path / "ck").exists() and "isfinite" in e.value.hint


def test_a_model_without_learning_rate_input_refuses_lr():
    from tests.driver.test_training_spec import mlp_training_model as spec_model

    sess = TrainingSession(spec_model(), progress=False)
    with pytest.raises(TrainingSpecError, match="no learning-rate input"):
        sess.fit({"X": np.zeros((4, 4), np.float32), "labels": np.zeros(4, np.int64)}, lr=0.1, progress=False)
