"""One ``fit`` for every runtime: ``train --runtime R`` resumes, refuses another model's checkpoint, checks the
data and prints the same lines on onnxruntime, onnx.reference, OpenVINO and tract; a checkpoint one runtime wrote
resumes on another (onnxruntime-node too where it is installed). Tiny MLP (8 features, 16 hidden, 10 classes,
40 samples): a few seconds per runtime."""
from __future__ import annotations

import re
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnx_autodiff import TrainingSession
from onnx_autodiff.cli import main
from onnx_autodiff.errors import CheckpointError, DataError
from onnx_autodiff.runtimes.train import train_bundle
from tests.cli_models import digits_like, mlp_training_model

RUNTIMES = ["onnxruntime", "reference", "openvino", "tract"]
MODULES = {"onnxruntime": "onnxruntime", "reference": "onnx", "openvino": "openvino", "tract": "tract"}
PARAMS = ["W1", "b1", "W2", "b2"]


def needs(runtime):
    if runtime == "onnxruntime-node":
        from onnx_autodiff.runtimes.node import node_modules

        if shutil.which("node") is None or node_modules() is None:
            pytest.skip("onnxruntime-node is not installed (Node.js and npm install onnxruntime-node)")
        return
    pytest.importorskip(MODULES[runtime])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("fit")
    onnx.save(mlp_training_model(hidden=16, features=8, classes=10), d / "t.onnx")
    onnx.save(mlp_training_model(hidden=12, features=8, classes=10), d / "other.onnx")
    x, y = digits_like(n=40, features=8, classes=10)
    np.savez(d / "d.npz", X=x, y=y)
    return d


def checkpoint_state(path) -> dict[str, np.ndarray]:
    m = onnx.load(str(path))
    graphs = [m.graph] + [ti.algorithm for ti in m.training_info]
    return {t.name: numpy_helper.to_array(t) for g in graphs for t in g.initializer}


def train(files, ck, epochs, runtime, *extra) -> int:
    return main(["train", str(files / "t.onnx"), "--data", str(files / "d.npz"), "--epochs", str(epochs),
                 "--batch-size", "16", "--checkpoint", str(ck), "--runtime", runtime, "--quiet", *extra])


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("runtime", [*RUNTIMES, "onnxruntime-node"])
def test_resume_matches_an_uninterrupted_run(files, tmp_path, runtime, capsys):
    """1 epoch, then resume to 2: the state of a straight 2-epoch run on the same runtime, and the same lines."""
    needs(runtime)
    assert train(files, tmp_path / "straight", 2, runtime) == 0
    straight = capsys.readouterr().out
    assert train(files, tmp_path / "ck", 1, runtime) == 0
    capsys.readouterr()
    assert train(files, tmp_path / "ck", 2, runtime) == 0
    out = capsys.readouterr().out
    assert f"resuming from {tmp_path / 'ck' / 'checkpoint.onnx'}: 1 epoch(s), 3 steps done" in out, out
    assert "epoch 1/2" not in out and re.search(r"^epoch 2/2: loss \S+ \(mean loss \S+ over 3 steps, ", out, re.M)
    assert out.splitlines()[-1] == straight.replace("straight", "ck").splitlines()[-1]
    a, b = checkpoint_state(tmp_path / "ck" / "checkpoint.onnx"), checkpoint_state(tmp_path / "straight" /
                                                                                   "checkpoint.onnx")
    state = [n for n in b if n in PARAMS or n.startswith("train/W") or n == "train/iteration"]
    assert set(PARAMS) <= set(state) and len(state) > len(PARAMS)
    for n in state:
        assert a[n].dtype == b[n].dtype and rel(a[n], b[n]) <= 1e-6, (n, rel(a[n], b[n]))
    assert int(a["train/iteration"]) == 6
    assert not np.array_equal(a["W1"], checkpoint_state(files / "t.onnx")["W1"])
    # already done: said, exit 0, nothing trained
    assert train(files, tmp_path / "ck", 2, runtime) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_a_checkpoint_resumes_on_another_runtime(files, tmp_path, capsys):
    """onnxruntime -> OpenVINO -> onnxruntime matches three epochs on onnxruntime within the runtimes' own
    agreement (1e-5)."""
    needs("openvino")
    assert train(files, tmp_path / "straight", 3, "onnxruntime") == 0
    assert train(files, tmp_path / "ck", 1, "onnxruntime") == 0
    assert train(files, tmp_path / "ck", 2, "openvino") == 0
    assert "resuming from" in capsys.readouterr().out
    assert train(files, tmp_path / "ck", 3, "onnxruntime") == 0
    out = capsys.readouterr().out
    assert "2 epoch(s), 6 steps done" in out and "epoch 3/3" in out and "epoch 2/3" not in out, out
    a, b = checkpoint_state(tmp_path / "ck" / "checkpoint.onnx"), checkpoint_state(tmp_path / "straight" /
                                                                                   "checkpoint.onnx")
    for n in PARAMS + ["train/W1.exp_avg", "train/W1.exp_avg_sq"]:
        assert rel(a[n], b[n]) <= 1e-5, (n, rel(a[n], b[n]))
    assert int(a["train/iteration"]) == int(b["train/iteration"]) == 9
    # the checkpoint a runtime wrote exports as onnxruntime's does, and import-state reads it too
    assert main(["import-state", str(files / "t.onnx"), str(tmp_path / "ck" / "checkpoint.onnx"),
                 str(tmp_path / "inf.onnx")]) == 0
    exported = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "inf.onnx").graph.initializer}
    for n in PARAMS:
        np.testing.assert_array_equal(exported[n], a[n])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_another_models_checkpoint_is_refused(files, tmp_path, runtime, capsys):
    needs(runtime)
    ck = tmp_path / "ck"
    assert main(["train", str(files / "other.onnx"), "--data", str(files / "d.npz"), "--epochs", "1",
                 "--checkpoint", str(ck), "--quiet"]) == 0
    before = sorted(p.name for p in ck.iterdir())
    capsys.readouterr()
    assert train(files, ck, 2, runtime) == 2
    err = capsys.readouterr().err
    assert "holds a checkpoint of another training model" in err and "other.onnx" in err, err
    assert sorted(p.name for p in ck.iterdir()) == before  # refused before a bundle was written


def _bad(files, tmp_path, what):
    x, y = digits_like(n=40, features=8, classes=10)
    if what == "label":
        y[3], y[7], y[9], y[20], y[30] = 12, 10, 11, 12, 15
        return {"X": x, "labels": y}
    if what == "nan":
        x[5, 2] = np.nan
        return {"x": x, "y": y}
    if what == "shape":
        return {"X": x[:, :6], "y": y}
    return {"X": x}


DATA_ERRORS = {
    "label": "labels 'labels' hold 5 value(s) outside 0..9, e.g. 12 in sample 3",
    "nan": "data array 'x' holds 1 NaN value(s), the first in sample 5",
    "shape": "data array 'X' (input 'x') has shape [40, 6], the input needs [N, 8]",
    "missing": "the data has no array for input 'labels' (or 'y'); it has ['X']",
}


@pytest.mark.parametrize("what", list(DATA_ERRORS))
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_data_errors_are_the_same_on_every_runtime(files, tmp_path, runtime, what, capsys):
    needs(runtime)
    np.savez(tmp_path / "bad.npz", **_bad(files, tmp_path, what))
    code = main(["train", str(files / "t.onnx"), "--data", str(tmp_path / "bad.npz"), "--checkpoint",
                 str(tmp_path / "ck"), "--runtime", runtime, "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"onnx-autodiff train: error: {DATA_ERRORS[what]}; hint: "), err
    assert not (tmp_path / "ck").exists()  # nothing written


def test_the_epoch_lines_are_the_same_on_every_runtime(files, tmp_path, capsys):
    seen = {}
    for runtime in RUNTIMES:
        needs(runtime)
        assert train(files, tmp_path / runtime, 2, runtime) == 0
        out = capsys.readouterr().out.replace(str(tmp_path / runtime), "DIR")
        seen[runtime] = re.sub(r"\d+\.\d+", "F", out)
        old = [float(v) for _, _, v in re.findall(r"epoch (\d+)/(\d+): loss (\S+)", out)]
        assert len(old) == 2 and old == [float(v) for v in re.findall(r"mean loss (\S+)", out)]
    assert len(set(seen.values())) == 1, seen
    assert seen["onnxruntime"].splitlines()[-1] == "export the inference model with: onnx-autodiff export " \
                                                   "DIR/checkpoint.onnx OUT.onnx"


def test_python_api_resumes_a_bundle_run(files, tmp_path):
    """``train_bundle`` (and so ``fit`` over a ``BundleTrainer``) resumes from its own checkpoint."""
    needs("reference")
    x, y = digits_like(n=40, features=8, classes=10)
    data = {"X": x, "y": y}
    lines = []
    straight = train_bundle(str(files / "t.onnx"), data, runtime="reference", checkpoint=tmp_path / "a",
                            batch_size=16, epochs=2, progress=False, log=lines.append)
    train_bundle(str(files / "t.onnx"), data, runtime="reference", checkpoint=tmp_path / "b", batch_size=16,
                 epochs=1, progress=False, log=lines.append)
    again = train_bundle(str(files / "t.onnx"), data, runtime="reference", checkpoint=tmp_path / "b", batch_size=16,
                         epochs=2, progress=False, log=lines.append)
    assert any(line.startswith("resuming from") for line in lines) and again.steps == straight.steps == 6
    for n, v in straight.state.items():
        assert rel(again.state[n], v) <= 1e-6, n
    with pytest.raises(DataError, match="hold 1 value"):
        bad = dict(data, y=np.where(np.arange(40) == 4, 10, y))
        train_bundle(str(files / "t.onnx"), bad, runtime="reference", checkpoint=tmp_path / "c", batch_size=16,
                     epochs=1, progress=False, log=lines.append)
    bundle = sorted((p.name, p.read_bytes()) for p in (tmp_path / "b" / "bundle").iterdir())
    with pytest.raises(CheckpointError, match="another"):
        train_bundle(str(files / "other.onnx"), data, runtime="reference", checkpoint=tmp_path / "b",
                     batch_size=16, epochs=3, progress=False, log=lines.append)
    assert sorted((p.name, p.read_bytes()) for p in (tmp_path / "b" / "bundle").iterdir()) == bundle


def test_nan_in_the_first_batch_is_a_data_error_naming_the_feed():
    """Not a forward mismatch ("differs by up to nan ... wrong base"): the data's fault, said so."""
    sess = TrainingSession(mlp_training_model(hidden=16, features=8, classes=10), progress=False)
    x, y = digits_like(n=8, features=8, classes=10)
    x[2, 5] = np.inf
    x[6, 1] = np.nan
    with pytest.raises(DataError) as e:
        sess.step({"x": x, "labels": y})
    assert str(e.value) == "the feed 'x' holds 2 NaN and Inf value(s), the first in sample 2"
    assert e.value.exit_code == 2 and sess.steps == 0


def test_a_lora_checkpoint_of_a_bundle_run_references_its_base(tmp_path, capsys):
    """As on onnxruntime: a LoRA run's checkpoint holds the adapters and their optimizer state, the frozen weight
    is a reference into the training model's file; it resumes, and export reads it."""
    from onnx_autodiff import make_training_model
    from onnx_autodiff.model.io import BASE_LOCATION
    from tests.driver.test_forward_check import linear

    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 2048)).astype(np.float32)  # large enough to be mapped from the file, not copied
    big = linear()
    big.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, "W"))
    big.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 2048
    onnx.save(make_training_model(big, "mse", "adam", lr=0.05, lora={"rank": 2, "targets": ["mm"]}),
              tmp_path / "t.onnx")
    x = rng.normal(size=(8, 3)).astype(np.float32)
    np.savez(tmp_path / "d.npz", X=x, y=rng.normal(size=(8, 2048)).astype(np.float32))
    common = [str(tmp_path / "t.onnx"), "--data", str(tmp_path / "d.npz"), "--batch-size", "4", "--runtime",
              "reference", "--quiet"]
    assert main(["train", *common, "--epochs", "2", "--checkpoint", str(tmp_path / "straight")]) == 0
    assert main(["train", *common, "--epochs", "1", "--checkpoint", str(tmp_path / "ck")]) == 0
    saved = onnx.load(str(tmp_path / "ck" / "checkpoint.onnx"), load_external_data=False)
    frozen = next(t for t in saved.graph.initializer if t.name == "W")
    assert [e.value for e in frozen.external_data if e.key == "location"] == [BASE_LOCATION]
    assert main(["train", *common, "--epochs", "2", "--checkpoint", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "resuming from" in out and f"OUT.onnx --base {tmp_path / 't.onnx'}" in out, out
    base = ["--base", str(tmp_path / "t.onnx")]
    assert main(["export", str(tmp_path / "ck" / "checkpoint.onnx"), str(tmp_path / "a.onnx"), *base]) == 0
    assert main(["export", str(tmp_path / "straight" / "checkpoint.onnx"), str(tmp_path / "b.onnx"), *base]) == 0
    a, b = (next(numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / f)).graph.initializer
                 if t.name == "W") for f in ("a.onnx", "b.onnx"))
    assert rel(a, b) <= 1e-6 and not np.array_equal(a, w)  # merged adapters moved the weight
    assert main(["train", *common[:-3], "--quiet", "--epochs", "3", "--checkpoint", str(tmp_path / "ck")]) == 0
    assert "resuming from" in capsys.readouterr().out  # and onnxruntime takes it on
