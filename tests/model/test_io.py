"""Model files: light models, memory-mapped loading, model + data pairs replaced atomically, modes."""
from __future__ import annotations

import os
import stat

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.errors import ModelFileError
from onnx_autodiff.model.carrier import open_model
from onnx_autodiff.model.io import load_split, save_model_atomic
from onnx_autodiff.model.weights import attach_weights, checkable, is_detached, split_model
from tests.models import model_of


def model_with(w: np.ndarray) -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", w.shape[0]])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", w.shape[1]])],
                          [numpy_helper.from_array(w, "W")])
    return model_of(g, ir_version=8)


W = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)


def test_split_leaves_the_input_alone_and_attach_restores_it():
    model = model_with(W)
    light, weights = split_model(model)
    assert is_detached(light.graph.initializer[0]) and model.graph.initializer[0].raw_data
    assert light.ByteSize() < 1000 and np.array_equal(weights["W"], W)
    onnx.checker.check_model(checkable(light), full_check=True)
    attach_weights(light, weights)
    assert light.SerializeToString() == model.SerializeToString()


def test_pair_is_written_atomically_and_read_by_plain_onnx(tmp_path):
    path = tmp_path / "m.onnx"
    save_model_atomic(model_with(W), path, external_data_threshold=0)
    data = [n for n in os.listdir(tmp_path) if n != "m.onnx"]
    assert len(data) == 1 and data[0].startswith("m.onnx.") and data[0].endswith(".data")
    assert np.array_equal(numpy_helper.to_array(onnx.load(str(path)).graph.initializer[0]), W)  # plain onnx
    light, weights = load_split(path)
    assert isinstance(weights["W"], np.memmap) and np.array_equal(weights["W"], W)
    # a second save replaces the pair: one data file again, the new one, and nothing else left
    save_model_atomic(model_with(W + 1), path, external_data_threshold=0)
    after = [n for n in os.listdir(tmp_path) if n != "m.onnx"]
    assert len(after) == 1 and after != data
    assert np.array_equal(open_model(path).whole().graph.initializer[0].raw_data, (W + 1).tobytes())
    assert np.array_equal(weights["W"], W)  # the old mapping still reads the old values


def test_a_save_that_fails_keeps_the_old_pair_and_leaves_no_file(tmp_path, monkeypatch):
    path = tmp_path / "m.onnx"
    save_model_atomic(model_with(W), path, external_data_threshold=0)
    before = sorted(os.listdir(tmp_path))
    real_replace = os.replace

    def fail_on_the_model(src, dst):  # the data file is in place, the model's rename fails
        if str(dst) == str(path):
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_on_the_model)
    with pytest.raises(ModelFileError, match="no room left on the device"):
        save_model_atomic(model_with(W + 1), path, external_data_threshold=0)
    assert sorted(os.listdir(tmp_path)) == before
    monkeypatch.undo()
    assert np.array_equal(numpy_helper.to_array(onnx.load(str(path)).graph.initializer[0]), W)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_files_get_the_mode_the_umask_gives(tmp_path, umask):
    old = os.umask(umask)
    try:
        save_model_atomic(model_with(W), tmp_path / "m.onnx", external_data_threshold=0)
    finally:
        os.umask(old)
    for name in os.listdir(tmp_path):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o666 & ~umask, name


def test_a_missing_data_file_is_named(tmp_path):
    path = tmp_path / "m.onnx"
    save_model_atomic(model_with(W), path, external_data_threshold=0)
    for name in os.listdir(tmp_path):
        if name != "m.onnx":
            os.unlink(tmp_path / name)
    with pytest.raises(ModelFileError, match="external-data file .* is missing"):
        load_split(path)
