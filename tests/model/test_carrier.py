"""What make_training_model returns is an onnx.ModelProto the ONNX tools take (issue 27): whole up to
``INLINE_LIMIT`` bytes of tensors; past it lean (the weights of a model given by its path stay in its files as
external-data references, the optimizer's fresh state is sparse zeros); and one door
(``model/carrier.py: open_model``) takes every form back in. ``lean`` lowers the limit to 0 so the small
models here take the large models' form."""
from __future__ import annotations

import copy
import json
import os

import numpy as np
import onnx
import pytest

from onnx_autodiff import (
    TrainingSession,
    TrainingSpecError,
    export_step,
    gradcheck,
    lower,
    make_training_model,
    save_model,
)
from onnx_autodiff.errors import ModelFileError
from onnx_autodiff.model import carrier
from tests.training.test_training_builder import PARAMS, mlp, weights

X = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
FEEDS = {"X": X, "labels": np.arange(8, dtype=np.int64) % 3}


def big_mlp(n=64):
    """The builder tests' MLP with W1 and W2 large enough to leave protobuf (>= 1 KiB)."""
    rng = np.random.default_rng(1)
    w = {"W1": rng.normal(size=(4, n)).astype(np.float32) * 0.3, "B1": np.full(n, 0.01, np.float32),
         "W2": rng.normal(size=(n, 3)).astype(np.float32) * 0.3, "B2": np.full(3, 0.02, np.float32)}
    return mlp(w)


@pytest.fixture
def lean(monkeypatch):
    monkeypatch.setattr(carrier, "INLINE_LIMIT", 0)


def losses(model, steps=3):
    s = TrainingSession(model, progress=False)
    out = [float(s.step(FEEDS)["loss"]) for _ in range(steps)]
    return out, {k: s.get_state(k) for k in PARAMS}


@pytest.fixture(params=["path", "proto"])
def built(request, tmp_path):
    """make_training_model's result from a path and from a ModelProto, and the losses of 3 steps."""
    path = tmp_path / "mlp.onnx"
    onnx.save(big_mlp(), str(path))
    source = str(path) if request.param == "path" else big_mlp()
    return make_training_model(source, "cross_entropy", "adam"), tmp_path


def test_onnx_tools_take_it(built):
    """The calls of issue 27's table, each on what make_training_model returns."""
    tm, _ = built
    assert type(tm) is onnx.ModelProto
    inferred = onnx.shape_inference.infer_shapes(tm)
    assert len(inferred.training_info) == 1
    converted = onnx.version_converter.convert_version(tm, 18)  # onnx's converter drops training_info itself
    assert [o.version for o in converted.opset_import if o.domain == ""] == [18]
    copied = onnx.ModelProto()
    copied.CopyFrom(tm)
    deep = copy.deepcopy(tm)
    onnx.checker.check_model(tm, full_check=True)
    assert gradcheck(tm).ok
    base = losses(tm)[0]
    assert losses(copied)[0] == base and losses(deep)[0] == base and losses(lower(tm))[0] == base
    assert base[-1] < base[0]


def test_a_large_model_keeps_its_weights_where_they_are_and_onnx_tools_take_it_in_its_folder(
        tmp_path, lean, monkeypatch):
    path = tmp_path / "mlp.onnx"
    onnx.save(big_mlp(), str(path))
    tm = make_training_model(str(path), "cross_entropy", "adam")
    graphs = [tm.graph, tm.training_info[0].algorithm]
    inline = [t.name for g in graphs for t in g.initializer if len(t.raw_data) >= 1024]
    assert not inline  # no weight and no optimizer state of 1 KiB or more inside
    onnx.shape_inference.infer_shapes(tm)
    deep = copy.deepcopy(tm)
    monkeypatch.chdir(tmp_path)  # onnx resolves external data of a model in memory from the current folder
    onnx.checker.check_model(tm, full_check=True)
    onnx.save(tm, "train.onnx")  # beside the model its weights are in: onnx.load reads it whole
    assert losses(onnx.load("train.onnx"))[0] == losses(deep)[0] == losses(tm)[0]
    assert gradcheck(tm).ok


def test_gradcheck_takes_a_path(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(big_mlp(), str(path))
    assert gradcheck(str(path)).ok


def test_from_a_path_the_weights_stay_in_the_file(tmp_path, lean):
    path = tmp_path / "mlp.onnx"
    onnx.save(big_mlp(), str(path), save_as_external_data=True, location="mlp.onnx.data", size_threshold=0)
    tm = make_training_model(str(path), "cross_entropy", "adam")
    refs = {t.name: {e.key: e.value for e in t.external_data} for t in tm.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL}
    assert set(refs) >= {"W1", "W2"} and all(r["location"] == "mlp.onnx.data" for r in refs.values())
    from_path, _ = losses(tm)
    from_proto, _ = losses(make_training_model(big_mlp(), "cross_entropy", "adam"))
    assert from_path == from_proto


def test_an_inline_tensor_is_referenced_where_its_bytes_sit(tmp_path, lean):
    """A single-file model (as exporters write under 2 GB): the reference points into the .onnx itself;
    onnx.save beside it gives a file onnx.load reads whole."""
    path = tmp_path / "mlp.onnx"
    onnx.save(big_mlp(), str(path))
    tm = make_training_model(str(path), "cross_entropy", "sgd")
    w1 = next(t for t in tm.graph.initializer if t.name == "W1")
    assert {e.key: e.value for e in w1.external_data}["location"] == "mlp.onnx"
    onnx.save(tm, str(tmp_path / "train.onnx"))
    whole = onnx.load(str(tmp_path / "train.onnx"))
    want = next(t for t in big_mlp().graph.initializer if t.name == "W1")
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(next(t for t in whole.graph.initializer
                                                                  if t.name == "W1")),
                                  onnx.numpy_helper.to_array(want))
    assert losses(str(tmp_path / "train.onnx"))[0] == losses(tm)[0]


@pytest.mark.parametrize("limit", [None, 0], ids=["whole", "lean"])
def test_save_model_writes_every_tensor_anywhere(built, tmp_path, monkeypatch, limit):
    if limit is not None:
        monkeypatch.setattr(carrier, "INLINE_LIMIT", limit)
    tm, _ = built
    other = tmp_path / "elsewhere"
    other.mkdir()
    save_model(tm, other / "train.onnx")
    assert losses(str(other / "train.onnx"))[0] == losses(tm)[0]
    manifest = json.loads(export_step(tm, tmp_path / "bundle").read_text())
    assert manifest["loss"]


def test_a_changed_weights_file_is_refused(tmp_path, lean):
    path = tmp_path / "mlp.onnx"
    onnx.save(big_mlp(), str(path))
    tm = make_training_model(str(path), "cross_entropy", "sgd")
    onnx.save(big_mlp(n=65), str(path))
    with pytest.raises(ModelFileError, match="changed or went away"):
        TrainingSession(tm, progress=False)


def test_external_data_of_a_model_in_memory_needs_its_folder(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(big_mlp(), str(path), save_as_external_data=True, location="w.data", size_threshold=0)
    unread = onnx.load(str(path), load_external_data=False)
    with pytest.raises(ModelFileError, match="does not say which folder"):
        make_training_model(unread)
    assert losses(make_training_model(onnx.load(str(path))))[0] == losses(make_training_model(str(path)))[0]


def test_the_optimizer_state_is_sparse_zeros_and_the_initialization_graph_writes_them(lean):
    tm = make_training_model(big_mlp(), "cross_entropy", "adam")
    ti = tm.training_info[0]
    zeros = {s.values.name for s in ti.algorithm.sparse_initializer}
    assert zeros and all(s.values.dims[0] == 0 for s in ti.algorithm.sparse_initializer)
    bound = {b.key for b in ti.initialization_binding}
    assert zeros <= bound
    sess = TrainingSession(tm, progress=False)
    assert all(not sess.get_state(n).any() for n in zeros)


def test_a_training_model_is_refused_as_an_inference_model():
    from onnx_autodiff import TrainingBuilderError

    with pytest.raises(TrainingBuilderError, match="already has training_info"):
        make_training_model(make_training_model(mlp(weights())))


def test_a_gradient_the_step_returns_is_not_overwritten_by_the_next_step():
    """step() writes the gradients into one buffer per parameter that every step reuses; a gradient the
    algorithm also outputs is returned as a copy, so what a caller keeps from step k stays step k's."""
    tm = make_training_model(big_mlp(), "cross_entropy", "sgd", lr=0.5)
    alg = tm.training_info[0].algorithm
    grad = next(o for n in alg.node if n.op_type == "Gradient" for o in n.output if "W1" in o)
    alg.output.append(onnx.helper.make_tensor_value_info(grad, onnx.TensorProto.FLOAT, None))
    s = TrainingSession(tm, progress=False)
    first = s.step(FEEDS)[grad]
    kept = first.copy()
    second = s.step(FEEDS)[grad]
    np.testing.assert_array_equal(first, kept)
    assert not np.array_equal(first, second)  # the weights moved, so the gradient did
    fresh = TrainingSession(tm, progress=False)
    np.testing.assert_array_equal(fresh.step(FEEDS)[grad], kept)


def test_outputs_keeps_only_what_the_caller_reads():
    """TrainingSession(outputs=[...]) computes and returns only those step outputs and the loss; the
    inference outputs left out are not outputs of onnxruntime's runs (freed when read); same training."""
    tm = make_training_model(big_mlp(), "cross_entropy", "adam")
    full = TrainingSession(tm, progress=False)
    assert "Z" in full.output_names
    lean = TrainingSession(tm, progress=False, outputs=[])
    assert lean.output_names == ["loss"]
    for _ in range(3):
        a, b = full.step(FEEDS), lean.step(FEEDS)
        assert set(b) == {"loss"} and float(a["loss"]) == float(b["loss"])
    with pytest.raises(TrainingSpecError, match="not outputs of the step"):
        TrainingSession(tm, progress=False, outputs=["nope"])


def test_the_source_file_is_the_base_of_a_lora_checkpoint(tmp_path, lean):
    """A session of make_training_model(path) knows the file its frozen weights are in (os.path.samefile)."""
    path = tmp_path / "mlp.onnx"
    onnx.save(big_mlp(), str(path))
    sess = TrainingSession(make_training_model(str(path), "cross_entropy", "sgd"), progress=False)
    assert sess.base_path is not None and os.path.samefile(sess.base_path, path)


@pytest.mark.parametrize("limit", [None, 0], ids=["whole", "lean"])
def test_the_docs_path_lowers_once(tmp_path, monkeypatch, limit):
    """make_training_model(path) -> TrainingSession -> steps: the lowering pipeline runs once."""
    from onnx_autodiff.passes import pipeline

    if limit is not None:
        monkeypatch.setattr(carrier, "INLINE_LIMIT", limit)
    runs = []
    first = pipeline.PIPELINE[0]

    def counted(model, ctx):
        runs.append(1)
        return first(model, ctx)

    monkeypatch.setattr(pipeline, "PIPELINE", (counted,) + tuple(pipeline.PIPELINE[1:]))
    path = tmp_path / "mlp.onnx"
    onnx.save(big_mlp(), str(path))
    tm = make_training_model(str(path), "cross_entropy", "adam")
    assert not runs
    sess = TrainingSession(tm, progress=False)
    for _ in range(2):
        sess.step(FEEDS)
    assert len(runs) == 1
