"""A model file can make us read no file outside its own folder (issue 29): every reader of ours refuses a
location that resolves outside the folder of the file naming it (``..``, an absolute path, a symlink out),
with our error naming the tensor or field, through the API, the CLI and the runners; nothing is written."""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import TrainingSession, export_step, make_training_model
from onnx_autodiff.errors import OutsideFolderError
from onnx_autodiff.runtimes import BundleTrainer
from tests.cli_models import mlp_training_model
from tests.integration.test_cli import assert_one_line_error, run

SECRET = np.arange(64, dtype=np.float32).reshape(4, 16) + 1000  # what a stranger's model must not carry out


def _stranger_model(folder, location: str) -> str:
    """An MLP whose W initializer keeps its bytes at ``location`` (relative to ``folder``) as external data."""
    w = numpy_helper.from_array(np.zeros((4, 16), np.float32), "W")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", str(SECRET.nbytes))):
        w.external_data.add(key=k, value=v)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    path = os.path.join(folder, "model.onnx")
    with open(path, "wb") as f:
        f.write(m.SerializeToString())  # onnx.save would refuse to write it: a stranger's file is made by hand
    return path


@pytest.fixture
def outside(tmp_path):
    """A secret file beside the model's folder, and the folder."""
    (tmp_path / "secret.bin").write_bytes(SECRET.tobytes())
    folder = tmp_path / "models"
    folder.mkdir()
    return tmp_path, folder


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_external_data_outside_the_folder_is_refused(outside, how):
    root, folder = outside
    location = {"dotdot": "../secret.bin", "absolute": str(root / "secret.bin"), "symlink": "link.bin"}[how]
    if how == "symlink":
        os.symlink(root / "secret.bin", folder / "link.bin")
    path = _stranger_model(str(folder), location)
    for call in (lambda: make_training_model(path, "mse"), lambda: TrainingSession(path),
                 lambda: export_step(path, str(root / "bundle"))):
        with pytest.raises(OutsideFolderError, match="initializer 'W'"):
            call()
    assert not (root / "bundle").exists()
    before = sorted(os.listdir(folder))
    p = run("make-training", path, folder / "train.onnx", "--loss", "mse", cwd=root, code=2)
    assert_one_line_error(p, "initializer 'W'")
    assert sorted(os.listdir(folder)) == before  # nothing written


def test_a_file_inside_the_folder_is_read(outside):
    _, folder = outside
    (folder / "w.bin").write_bytes(SECRET.tobytes())
    tm = make_training_model(_stranger_model(str(folder), "w.bin"), "mse")
    w = next(t for t in tm.graph.initializer if t.name == "W")
    np.testing.assert_array_equal(numpy_helper.to_array(w), SECRET)


def test_a_bundle_names_files_in_its_folder_only(tmp_path):
    bundle = tmp_path / "bundle"
    export_step(mlp_training_model("sgd", hidden=8, features=4, classes=3), bundle)
    BundleTrainer(bundle, "onnxruntime")  # as written: fine
    manifest = json.loads((bundle / "bundle.json").read_text())
    for step in ("../elsewhere/step.onnx", str(bundle / "step.onnx")):
        (bundle / "bundle.json").write_text(json.dumps({**manifest, "step": step}))
        with pytest.raises(OutsideFolderError, match="bundle.json 'step'"):
            BundleTrainer(bundle, "onnxruntime")
    (bundle / "bundle.json").write_text(json.dumps(manifest))
    step = onnx.load(str(bundle / "step.onnx"))
    t = step.graph.initializer[0]  # a step model whose tensor points out of the bundle
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    del t.external_data[:]
    t.external_data.add(key="location", value="../secret.bin")
    with open(bundle / "step.onnx", "wb") as f:
        f.write(step.SerializeToString())
    with pytest.raises(OutsideFolderError, match=t.name):
        BundleTrainer(bundle, "onnxruntime")


def test_a_checkpoint_reads_its_base_outside_its_folder_only_when_named(tmp_path):
    """A LoRA checkpoint in a subfolder references its frozen weights in the training model one folder up:
    read when the caller names that model (base_path= / --base), refused otherwise."""
    from onnx_autodiff.model import carrier
    from tests.training.test_lora_rewrite import LORA, _data, net

    inference = str(tmp_path / "net.onnx")
    onnx.save(net(hidden=64), inference)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(carrier, "INLINE_LIMIT", 0)  # the lean form: frozen weights stay in net.onnx
        sess = TrainingSession(make_training_model(inference, "mse", "adam", lr=0.05, lora=LORA))
    sess.step(_data())
    (tmp_path / "ckpt").mkdir()
    ckpt = str(tmp_path / "ckpt" / "checkpoint.onnx")
    sess.save(ckpt)
    with pytest.raises(OutsideFolderError, match="outside its folder"):
        TrainingSession(ckpt)
    again = TrainingSession(ckpt, base_path=inference)
    assert float(again.step(_data(9))["loss"]) == float(sess.step(_data(9))["loss"])
    out = str(tmp_path / "merged.onnx")
    p = run("export", ckpt, out, cwd=tmp_path, code=2)
    assert_one_line_error(p, "--base MODEL")
    assert not os.path.exists(out)
    run("export", ckpt, out, "--base", inference, cwd=tmp_path)
    assert os.path.exists(out)


def test_a_version_1_bundle_still_trains(tmp_path):
    """Bundles written before host scalars (format /1) load and train; an unknown format is refused."""
    from onnx_autodiff.errors import BundleError
    from tests.integration.test_js_driver import frozen_bundle

    frozen_bundle(tmp_path / "v1")
    manifest = json.loads((tmp_path / "v1" / "bundle.json").read_text())
    assert manifest["format"] == "onnx-autodiff-step/1"
    manifest["feeds"] = [{"name": "x", "dtype": "float32", "shape": ["N", 2]}]  # version 1's feed records
    (tmp_path / "v1" / "bundle.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="ignores the fed state"):  # the frozen step's own check, so it ran
        trainer = BundleTrainer(tmp_path / "v1", "onnxruntime")
        for _ in range(2):
            trainer.step({"x": np.ones((3, 2), np.float32)})
    (tmp_path / "v1" / "bundle.json").write_text(json.dumps({**manifest, "format": "onnx-autodiff-step/3"}))
    with pytest.raises(BundleError, match="onnx-autodiff-step/2"):
        BundleTrainer(tmp_path / "v1", "onnxruntime")
