"""Loading a model file without copying its weights (model/wire.py): the same light model and arrays as parsing
it whole and splitting, with every detached inline weight a memory map of the file."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.errors import ModelFileError
from onnx_autodiff.model import wire
from onnx_autodiff.model.io import load_checked, load_split
from onnx_autodiff.model.weights import is_detached, split_model
from tests.models import model_of, vi

RNG = np.random.default_rng(0)


def mixed_model() -> onnx.ModelProto:
    """Initializers of every kind split_model treats apart, in the graph and in a training graph."""
    w = numpy_helper.from_array(RNG.standard_normal((64, 32)).astype(np.float32), "W")
    b = numpy_helper.from_array(np.ones(32, np.float32), "b")  # under MIN_BYTES: inline
    ids = numpy_helper.from_array(np.arange(400, dtype=np.int64), "ids")  # not a float: inline
    listed = helper.make_tensor("listed", TensorProto.FLOAT, [300], RNG.standard_normal(300).tolist())  # float_data
    half = numpy_helper.from_array(RNG.standard_normal((40, 20)).astype(np.float16), "half")
    bf = helper.make_tensor("bf", TensorProto.BFLOAT16, [600], np.zeros(600, np.float32).tolist())  # stays inline
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    g = helper.make_graph(nodes, "g", [vi("x", ["N", 64])], [vi("y", ["N", 32])], [w, b, ids, listed, half, bf])
    m = model_of(g, training=True)
    moment = numpy_helper.from_array(RNG.standard_normal((64, 32)).astype(np.float32), "W.moment")
    alg = helper.make_graph([helper.make_node("Add", ["W", "W.moment"], ["W.new"])], "alg", [],
                            [vi("W.new", [64, 32])], [moment])
    m.training_info.append(helper.make_training_info(alg, [("W", "W.new")], None, []))
    return m


def test_the_file_loads_as_a_whole_parse_and_split_gives_with_weights_mapped(tmp_path):
    m = mixed_model()
    path = str(tmp_path / "m.onnx")
    onnx.save(m, path)
    light, weights = load_split(path)
    want, arrays = split_model(onnx.load(path, load_external_data=False), base_dir=str(tmp_path))
    assert light.SerializeToString() == want.SerializeToString()
    assert sorted(weights) == sorted(arrays) == ["W", "W.moment", "half", "listed"]
    for name, arr in arrays.items():
        assert weights[name].dtype == arr.dtype and np.array_equal(weights[name], arr), name
    # the inline bytes of the file, mapped; a tensor written as float_data has no bytes to map
    assert {n for n, a in weights.items() if isinstance(a, np.memmap)} == {"W", "W.moment", "half"}
    kept = {t.name: t for t in light.graph.initializer}
    assert not any(is_detached(kept[n]) for n in ("b", "ids", "bf"))
    assert kept["ids"].raw_data == m.graph.initializer[2].raw_data


def test_strip_raw_data_leaves_out_only_the_large_raw_bytes():
    m = mixed_model()
    data = m.SerializeToString()
    stripped, cut = wire.strip_raw_data(data, 1024)
    assert len(stripped) < len(data) - 64 * 32 * 4 * 2
    assert {key: [e[0] for e in entries] for key, entries in cut.items()} == {("graph",): [0, 2, 4], (0, 2): [0]}
    ordinal, offset, size = cut[("graph",)][0]
    assert data[offset:offset + size] == m.graph.initializer[0].raw_data
    light = onnx.ModelProto.FromString(stripped)
    assert [t.name for t in light.graph.initializer] == [t.name for t in m.graph.initializer]
    assert not light.graph.initializer[0].raw_data and light.graph.initializer[1].raw_data
    light.graph.initializer[0].raw_data = m.graph.initializer[0].raw_data
    light.graph.initializer[2].raw_data = m.graph.initializer[2].raw_data
    light.graph.initializer[4].raw_data = m.graph.initializer[4].raw_data
    light.training_info[0].algorithm.initializer[0].raw_data = m.training_info[0].algorithm.initializer[0].raw_data
    assert light == m


def test_bytes_that_are_not_a_model_get_the_same_error(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(b"\x0f\xff\xff not a model")
    with pytest.raises(wire.WireError):
        wire.strip_raw_data(path.read_bytes(), 1024)
    with pytest.raises(ModelFileError, match="is not an ONNX model"):
        load_checked(path)


def test_a_text_format_file_is_parsed_by_onnx(tmp_path):
    m = mixed_model()
    path = str(tmp_path / "m.textproto")
    onnx.save(m, path, format="textproto")
    light, weights = load_split(path)
    assert np.array_equal(weights["W"], numpy_helper.to_array(m.graph.initializer[0]))


def test_a_session_from_the_path_steps_as_one_from_the_whole_model(tmp_path):
    """The weights mapped from the file (never parsed into the message) train as the parsed ones do."""
    from onnx_autodiff import TrainingSession, make_training_model

    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "W")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g", [vi("x", ["N", 16])],
                          [vi("y", ["N", 8])], [w])
    path = str(tmp_path / "m.onnx")
    onnx.save(model_of(g), path)
    feeds = {"x": rng.standard_normal((4, 16)).astype(np.float32), "labels": rng.integers(0, 8, 4)}
    runs = []
    for source in (path, onnx.load(path)):
        sess = TrainingSession(make_training_model(source, "cross_entropy", "adam"), progress=False)
        runs.append([float(sess.step(feeds)["loss"]) for _ in range(3)] + [sess.get_state("W")])
    assert runs[0][:3] == runs[1][:3]
    np.testing.assert_array_equal(runs[0][3], runs[1][3])
