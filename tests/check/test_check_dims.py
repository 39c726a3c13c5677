"""``check`` sizes symbolic input dims as the model's own shapes allow (onnx_autodiff/check/input_dims.py): an image
model's channels from its patch Conv, its height and width from the sizes the Conv's kernel and stride ladder gives
that the rest of the model runs on; ``--dim NAME=N`` without ``--target`` sets one."""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_autodiff as oa
from onnx_autodiff.check.input_dims import conv_dims, fitted_dims
from onnx_autodiff.cli import main

_IMAGE = ["batch_size", "num_channels", "height", "width"]


def _vit_shaped(hidden: int = 16, patch: int = 8, patches: int = 4, labels: int = 5) -> onnx.ModelProto:
    """ViT's layout with every input dim symbolic: 8x8 patches by a Conv, a class token, position embeddings of
    1 + 4 tokens (so 16x16 images only), GELU through Erf, the tokens' mean, a classifier."""
    rng = np.random.default_rng(0)

    def init(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.5).astype(np.float32), name)

    inits = [init("patch_w", hidden, 3, patch, patch), init("patch_b", hidden), init("cls", 1, 1, hidden),
             init("pos", 1, patches + 1, hidden), init("head_w", hidden, labels), init("head_b", labels),
             numpy_helper.from_array(np.array([0, hidden, -1], np.int64), "flat"),
             numpy_helper.from_array(np.array([1, hidden], np.int64), "one_token"),
             numpy_helper.from_array(np.array(math.sqrt(2.0), np.float32), "root2"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(0.5, np.float32), "half")]
    n = helper.make_node
    nodes = [n("Conv", ["pixel_values", "patch_w", "patch_b"], ["c"], kernel_shape=[patch, patch],
               strides=[patch, patch]),
             n("Reshape", ["c", "flat"], ["r"]), n("Transpose", ["r"], ["tokens"], perm=[0, 2, 1]),
             n("Shape", ["pixel_values"], ["s"], end=1), n("Concat", ["s", "one_token"], ["cls_shape"], axis=0),
             n("Expand", ["cls", "cls_shape"], ["cls_b"]), n("Concat", ["cls_b", "tokens"], ["all"], axis=1),
             n("Add", ["all", "pos"], ["h"]), n("Div", ["h", "root2"], ["hs"]), n("Erf", ["hs"], ["e"]),
             n("Add", ["e", "one"], ["e1"]), n("Mul", ["h", "e1"], ["g2"]), n("Mul", ["g2", "half"], ["g"]),
             n("ReduceMean", ["g"], ["m"], axes=[1], keepdims=0), n("MatMul", ["m", "head_w"], ["z"]),
             n("Add", ["z", "head_b"], ["logits"])]
    g = helper.make_graph(nodes, "vit", [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, _IMAGE)],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", labels])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_the_graph_gives_channels_and_a_ladder_of_sizes():
    model = _vit_shaped()
    assert conv_dims(model) == ({"num_channels": 3}, {"height": (8, 8), "width": (8, 8)})
    assert fitted_dims(model) == {"num_channels": 3, "height": 16, "width": 16}  # the position embeddings' size
    assert fitted_dims(model, {"batch_size": 1, "height": 16}) == {"num_channels": 3, "batch_size": 1,
                                                                    "height": 16, "width": 16}


def test_a_vit_shaped_model_passes_check(tmp_path, capsys):
    """Before: "Shape inconsistencies, X.shape=(2, 2, 2, 2), W.shape=(16, 3, 8, 8)"."""
    path = tmp_path / "vit.onnx"
    onnx.save(_vit_shaped(), str(path))
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "sized from the graph: height=16, num_channels=3, width=16" in out and "ok: 6 tensor(s)" in out
    assert oa.gradcheck(_vit_shaped()).ok  # the API sizes them the same way


def test_dims_given_without_target(tmp_path, capsys):
    path = tmp_path / "vit.onnx"
    onnx.save(_vit_shaped(), str(path))
    assert main(["check", str(path), "--dim", "batch_size=1", "--dim", "height=16", "--dim", "width=16"]) == 0
    assert "sized from the graph: num_channels=3 (" in capsys.readouterr().out
    assert main(["check", str(path), "--dim", "hieght=16"]) == 2
    assert "--dim names 'hieght', not a symbolic dim" in capsys.readouterr().err
    assert main(["check", str(path), "--dim", "height=24"]) == 2  # a size the model does not take: our error
    err = capsys.readouterr().err
    assert "the model could not run on the check's inputs (pixel_values (2, 3, 24, 8))" in err and "bug" not in err


def test_a_transformers_vit_classifier_passes_check(tmp_path, capsys):
    """The export Optimum makes of a ViT image classifier (every pixel_values dim symbolic)."""
    pytest.importorskip("transformers")
    from tests.optimum_models import vit_classifier

    path = vit_classifier(tmp_path / "vit" / "model.onnx")
    assert main(["check", str(path)]) == 0
    assert "sized from the graph: height=16, num_channels=3, width=16" in capsys.readouterr().out
