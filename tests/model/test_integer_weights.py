"""Large integer initializers (MatMulNBits' codes, the int8 backward's columns) leave the protobuf like float ones
(``weights.detached_inline``): split from a ModelProto, memory-mapped from a file, written to the data file; small
ones (shapes, indices) and packed ones stay inline."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.driver.prefold import fold_weight_arithmetic
from onnx_autodiff.driver.session import TrainingSession
from onnx_autodiff.model.carrier import open_model
from onnx_autodiff.model.io import load_split, save_model_atomic
from onnx_autodiff.model.weights import MIN_INTEGER_BYTES, is_detached, split_model
from onnx_autodiff.training.lora.quantized import int8_backward_names
from tests.driver.test_prefold import unpack_model
from tests.models import model_of, vi
from tests.training.test_lora_int8_backward import _feeds, _training

RNG = np.random.default_rng(0)
DETACHED = {"codes", "wide"}


def int_model() -> onnx.ModelProto:
    codes = RNG.integers(0, 256, (256, MIN_INTEGER_BYTES // 256), dtype=np.uint8)  # exactly the threshold
    inits = [numpy_helper.from_array(codes, "codes"),
             numpy_helper.from_array(RNG.integers(-9, 9, MIN_INTEGER_BYTES // 8).astype(np.int64), "wide"),
             numpy_helper.from_array(RNG.integers(-128, 128, MIN_INTEGER_BYTES - 1).astype(np.int8), "under"),
             numpy_helper.from_array(np.arange(400, dtype=np.int64), "ids"),
             numpy_helper.from_array(np.ones(MIN_INTEGER_BYTES, bool), "mask"),  # not an integer type: inline
             helper.make_tensor("nibbles", TensorProto.INT4, [4 * MIN_INTEGER_BYTES],  # packed: inline
                                RNG.integers(-8, 8, 4 * MIN_INTEGER_BYTES).tolist())]
    nodes = [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)]
    return model_of(helper.make_graph(nodes, "g", [vi("x", [2])], [vi("y", [2])], inits))


def test_split_detaches_large_integers_only():
    m = int_model()
    light, arrays = split_model(m)
    assert set(arrays) == DETACHED
    assert {t.name for t in light.graph.initializer if is_detached(t)} == DETACHED
    for t in m.graph.initializer:
        if t.name in DETACHED:
            want = numpy_helper.to_array(t)
            assert arrays[t.name].dtype == want.dtype and np.array_equal(arrays[t.name], want), t.name
    kept = {t.name: t for t in light.graph.initializer if not is_detached(t)}
    assert set(kept) == {"under", "ids", "mask", "nibbles"}
    assert all(kept[t.name].raw_data == t.raw_data for t in m.graph.initializer if t.name in kept and t.raw_data)


def test_a_file_maps_the_integers_split_model_detaches(tmp_path):
    path = str(tmp_path / "m.onnx")
    onnx.save(int_model(), path)
    light, weights = load_split(path)
    want, arrays = split_model(onnx.load(path, load_external_data=False), base_dir=str(tmp_path))
    assert light.SerializeToString() == want.SerializeToString()
    assert set(weights) == set(arrays) == DETACHED
    assert all(isinstance(weights[n], np.memmap) and np.array_equal(weights[n], arrays[n]) for n in DETACHED)


def test_saving_writes_large_integers_to_the_data_file_and_they_read_back(tmp_path):
    m = int_model()
    path = str(tmp_path / "saved.onnx")
    save_model_atomic(m, path, external_data_threshold=0)
    stored = onnx.load(path, load_external_data=False)
    external = {t.name for t in stored.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert external == DETACHED
    back = onnx.load(path)
    for a, b in zip(m.graph.initializer, back.graph.initializer):
        assert a.name == b.name and np.array_equal(numpy_helper.to_array(a), numpy_helper.to_array(b)), a.name


def test_the_int8_backwards_columns_enter_a_session_detached():
    training = _training("int8", "cross_entropy", v=2048)  # the head's columns: 2048 x 96 bytes
    light = open_model(training)
    columns, scale = int8_backward_names("head.weight_Q4")
    inits = {t.name: t for t in light.proto.graph.initializer}
    assert is_detached(inits[columns]) and inits[columns].data_type == TensorProto.UINT8
    assert light.arrays[columns].shape == (2048, 96) and columns in light.private


def test_prefold_leaves_what_it_is_told_to_onnxruntime():
    model, arrays = unpack_model()
    before = [n.name for n in model.graph.node]
    assert fold_weight_arithmetic(model, arrays, leave={"packed"}) == {}
    assert [n.name for n in model.graph.node] == before
    assert fold_weight_arithmetic(model, arrays)  # and folds it when not told


def test_an_int8_backward_checkpoint_resumes_with_its_columns(tmp_path):
    """The columns, detached in the session, are written with the checkpoint and read back: the resumed session's
    steps are the ones the first would have taken."""
    feeds = _feeds("cross_entropy", 2048)
    sess = TrainingSession(_training("int8", "cross_entropy", v=2048), progress=False)
    sess.step(feeds)
    path = tmp_path / "ckpt.onnx"
    sess.save(path, external_data_threshold=0)
    columns, _ = int8_backward_names("head.weight_Q4")
    stored = {t.name: t for t in onnx.load(str(path), load_external_data=False).graph.initializer}
    assert stored[columns].data_location == TensorProto.EXTERNAL
    resumed = TrainingSession(str(path), progress=False)
    losses = [float(np.asarray(s.step(feeds)[s.loss_name]).reshape(-1)[0]) for s in (sess, resumed)]
    assert losses[0] == losses[1]
    for name in (n for n in sess.state if ".lora_" in n):
        np.testing.assert_array_equal(sess.get_state(name), resumed.get_state(name))
