"""The forms removed before the option groups (e0f1553) work one more release: each gives the model its new form
gives, and warns with a DeprecationWarning that names the new form and points at the caller's line."""
from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import pytest

from onnx_autodiff import (
    LossSpec,
    MemoryBudget,
    OptimizerSpec,
    TrainingBuilderError,
    build_step_model,
    lower,
    make_training_model,
    save_model,
)
from onnx_autodiff.model.io import load_split
from tests.training.test_training_builder import mlp


def _same(a: onnx.ModelProto, b: onnx.ModelProto) -> None:
    assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


def _only_deprecation(record, *words) -> None:
    """Exactly one warning: a DeprecationWarning naming every word, attributed to this file (stacklevel)."""
    assert len(record) == 1, [str(w.message) for w in record]
    w = record[0]
    assert w.category is DeprecationWarning
    for word in words:
        assert word in str(w.message), (word, str(w.message))
    assert os.path.samefile(w.filename, __file__), w.filename


def _new_quietly(*args, **kwargs) -> onnx.ModelProto:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new form never warns
        return make_training_model(*args, **kwargs)


CASES = [  # old keywords, the same model in the new form, the words the warning must say
    ({"label": "target"}, ("mse", "sgd"), {"loss": LossSpec("mse", label="target")}, ("label=", "LossSpec")),
    ({"outputs": "H"}, ("mse", "sgd"), {"loss": LossSpec("mse", outputs="H")}, ("outputs=", "LossSpec")),
    ({"label_shape": ["N", 3]}, ("mse", "sgd"), {"loss": LossSpec("mse", label_shape=["N", 3])},
     ("label_shape=", "LossSpec")),
    ({"loss_options": {"axis": -1}}, ("cross_entropy", "sgd"),
     {"loss": LossSpec("cross_entropy", options={"axis": -1})}, ("loss_options=", "LossSpec(loss, options=")),
    ({"loss_weights": {"Z": 2.0}}, ({"Z": "mse"}, "sgd"), {"loss": LossSpec({"Z": "mse"}, weights={"Z": 2.0})},
     ("loss_weights=", "LossSpec(loss, weights=")),
    ({"optimizer_options": {"weight_decay": 0.1}}, ("mse", "adamw"),
     {"optimizer": OptimizerSpec("adamw", {"weight_decay": 0.1})}, ("optimizer_options=", "OptimizerSpec")),
]


@pytest.mark.parametrize("old, positional, new, words", CASES, ids=[next(iter(c[0])) for c in CASES])
def test_old_keyword_gives_the_new_forms_model(old, positional, new, words):
    loss, optimizer = positional
    expected = _new_quietly(mlp(), **{"loss": loss, "optimizer": optimizer, **new})
    with pytest.warns(DeprecationWarning) as record:
        got = make_training_model(mlp(), loss, optimizer, **old)
    _only_deprecation(record, *words)
    _same(got, expected)


def test_memory_budget_dims_gives_the_new_forms_model():
    pytest.importorskip("networkx")
    expected = _new_quietly(mlp(), "mse", "sgd", memory_budget=MemoryBudget("1GiB", {"N": 16}))
    with pytest.warns(DeprecationWarning) as record:
        got = make_training_model(mlp(), "mse", "sgd", memory_budget="1GiB", memory_budget_dims={"N": 16})
    _only_deprecation(record, "memory_budget_dims=", "MemoryBudget(size, dims)")
    _same(got, expected)


def test_several_old_keywords_warn_once_each_and_combine():
    expected = _new_quietly(mlp(), LossSpec("mse", label="t", label_shape=["N", 3]), OptimizerSpec("sgd", {}))
    with pytest.warns(DeprecationWarning) as record:
        got = make_training_model(mlp(), "mse", "sgd", label="t", label_shape=["N", 3])
    assert sorted(str(w.message).split("(")[1].split("=")[0] for w in record) == ["label", "label_shape"]
    _same(got, expected)


def test_weights_of_a_split_model_gives_the_paths_model(tmp_path):
    path = str(tmp_path / "mlp.onnx")
    onnx.save(mlp(), path)
    expected = _new_quietly(path, "mse", "sgd")
    light, arrays = load_split(path)
    with pytest.warns(DeprecationWarning) as record:
        got = make_training_model(light, "mse", "sgd", weights=arrays)
    _only_deprecation(record, "weights=", "path")
    for a, b in zip(expected.graph.initializer, got.graph.initializer, strict=True):
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b))
    assert [n.op_type for n in got.training_info[0].algorithm.node] == \
           [n.op_type for n in expected.training_info[0].algorithm.node]


def test_old_keyword_that_contradicts_its_group_is_our_error():
    with pytest.warns(DeprecationWarning), pytest.raises(TrainingBuilderError, match="label= and LossSpec.label"):
        make_training_model(mlp(), LossSpec("mse", label="a"), "sgd", label="b")


def test_an_unknown_keyword_is_still_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'lable'"):
        make_training_model(mlp(), "mse", "sgd", lable="t")


def test_build_step_model_of_an_unlowered_model_lowers_it_and_warns():
    train = _new_quietly(mlp(), "mse", "sgd")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        expected = build_step_model(lower(train, check=False))
    with pytest.warns(DeprecationWarning) as record:
        got = build_step_model(train)
    _only_deprecation(record, "onnx_autodiff.lower(model)", "cheaper")
    _same(got, expected)


def test_save_model_is_the_public_replacement_of_save(tmp_path):
    import onnx_autodiff

    assert "save_model" in onnx_autodiff.__all__
    train = _new_quietly(mlp(), "mse", "sgd")
    save_model(train, tmp_path / "train.onnx")
    _same(onnx.load(str(tmp_path / "train.onnx")), train)
