"""A bundle's trainer stops on a NaN or Inf loss as a ``TrainingSession`` does: ``TrainingDivergedError`` naming
the step and the loss, the state and step count left at the last good step."""
from __future__ import annotations

import numpy as np
import pytest

from onnx_autodiff import TrainingDivergedError, TrainingSession
from onnx_autodiff.driver.bundle import export_step
from onnx_autodiff.runtimes.loop import BundleTrainer
from tests.cli_models import digits_like, mlp_training_model


@pytest.mark.parametrize("runtime", ["onnxruntime", "reference"])
def test_a_nan_loss_stops_the_bundle_and_keeps_the_last_good_state(tmp_path, runtime):
    model = mlp_training_model("adam", lr=0.01, hidden=8, features=8, classes=3)
    export_step(model, tmp_path)
    x, y = digits_like(8, features=8, classes=3)
    trainer = BundleTrainer(tmp_path, runtime)
    trainer.step({"x": x, "labels": y})
    good = {k: v.copy() for k, v in trainer.state.items()}
    bad = x.copy()
    bad[0, 0] = np.nan
    with pytest.raises(TrainingDivergedError, match=r"step 2: tensor 'loss' contains NaN or Inf") as err:
        trainer.step({"x": bad, "labels": y})
    assert err.value.step == 2 and err.value.state_kept
    assert trainer.steps == 1
    for name, value in good.items():
        np.testing.assert_array_equal(trainer.state[name], value)
    sess = TrainingSession(model, progress=False)  # the session says the same of the same batch
    sess.step({"x": x, "labels": y})
    with pytest.raises(TrainingDivergedError, match=r"step 2: tensor 'loss' contains NaN or Inf"):
        sess.step({"x": bad, "labels": y})
    assert trainer.step({"x": x, "labels": y}) == pytest.approx(float(sess.step({"x": x, "labels": y})["loss"]),
                                                                 rel=1e-5)  # it trains on from the good state


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # onnx.reference's numpy overflows on the way to NaN
def test_train_on_another_runtime_stops_with_the_one_line_divergence_error(tmp_path, capsys):
    import onnx

    from onnx_autodiff.cli import main
    onnx.save(mlp_training_model("sgd", lr=0.01, hidden=8, features=8, classes=3), tmp_path / "t.onnx")
    x, y = digits_like(16, features=8, classes=3)
    np.savez(tmp_path / "data.npz", x=x * np.float32(1e18), labels=y)
    code = main(["train", str(tmp_path / "t.onnx"), "--data", str(tmp_path / "data.npz"), "--runtime", "reference",
                 "--checkpoint", str(tmp_path / "c"), "--lr", "1e30", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and "NaN or Inf" in err and "lower --lr" in err, err
