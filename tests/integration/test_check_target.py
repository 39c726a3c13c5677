"""``check --target`` says whether a model trains on a runtime, and is right: it lowers the step for the target,
names what is missing, warns where the conformance table does, and where the runtime is installed runs one step on
it against onnxruntime. A runtime's refusal is one line of ours; a failed ``train --runtime`` leaves nothing."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import save_model
from onnx_autodiff.cli import main
from onnx_autodiff.runtimes.check import check_target
from onnx_autodiff.training import LossSpec, make_training_model

V, D = 12, 8


def tiny_lm() -> onnx.ModelProto:
    """Token ids [B, S] -> embedding -> logits [B, S, V]."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((V, D)).astype(np.float32) * 0.3, "embed"),
             numpy_helper.from_array(rng.standard_normal((D, V)).astype(np.float32) * 0.3, "head")]
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["h"], name="embed_lookup"),
             helper.make_node("Tanh", ["h"], ["t"], name="act"), helper.make_node("MatMul", ["t", "head"], ["logits"],
                                                                                 name="lm_head")]
    graph = helper.make_graph(nodes, "lm", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["B", "S"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "S", V])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def lp_pool_classifier() -> onnx.ModelProto:
    """LpPool (which tract lacks, with no standard form) on the path of every gradient."""
    w = numpy_helper.from_array(np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32), "W")
    nodes = [helper.make_node("LpPool", ["x"], ["p"], kernel_shape=[2, 2], strides=[2, 2], p=2, name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"), helper.make_node("MatMul", ["f", "W"], ["y"])]
    graph = helper.make_graph(nodes, "lp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


@pytest.mark.parametrize("target", ["openvino", "tract", "reference"])
def test_causal_lm_check_runs_the_step_on_the_runtime(target):
    """causal_lm's loss has ignore_index, which OpenVINO's NegativeLogLikelihoodLoss converter refuses: the openvino
    lowering writes it in standard ops, and the step runs there as on onnxruntime."""
    pytest.importorskip({"openvino": "openvino", "tract": "tract", "reference": "onnx"}[target])
    tm = make_training_model(tiny_lm(), LossSpec("causal_lm"), "adam")
    result = check_target(tm, target)
    assert result.ok, "\n".join(result.lines)
    ran = [line for line in result.lines if line.startswith(f"{target} ") and "agree with onnxruntime" in line]
    assert ran, result.lines
    assert result.lines[-1] == f"ok: the model trains on {target}"


def test_check_names_an_op_without_a_standard_form_before_anything_runs(tmp_path, capsys):
    tm = make_training_model(lp_pool_classifier(), "cross_entropy", "sgd")
    path = tmp_path / "train.onnx"
    save_model(tm, path)
    assert main(["check", str(path), "--target", "tract"]) == 1
    out = capsys.readouterr().out
    assert "tract lacks LpPool: needed by node 'pool' (MISSING: no standard form)" in out
    assert main(["check", str(path), "--target", "onnxruntime"]) == 0


def test_a_refusal_is_one_line_and_leaves_no_bundle(tmp_path, capsys):
    pytest.importorskip("tract")
    tm = make_training_model(lp_pool_classifier(), "cross_entropy", "sgd")
    path, data, ck = tmp_path / "train.onnx", tmp_path / "data.npz", tmp_path / "ck"
    save_model(tm, path)
    rng = np.random.default_rng(0)
    np.savez(data, x=rng.standard_normal((8, 1, 4, 4)).astype(np.float32), labels=rng.integers(0, 3, 8))
    assert main(["train", str(path), "--data", str(data), "--checkpoint", str(ck), "--runtime", "tract",
                 "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bug in onnx-autodiff" not in err[0], err
    assert "tract could not convert step.onnx: LpPool (node 'pool')" in err[0]
    assert "hint: no lowering of onnx-autodiff avoids LpPool on tract" in err[0]
    assert not ck.exists()  # the run made the folder and took it away again


def test_a_data_error_writes_nothing(tmp_path, capsys):
    tm = make_training_model(lp_pool_classifier(), "cross_entropy", "sgd")
    path, data, ck = tmp_path / "train.onnx", tmp_path / "data.npz", tmp_path / "ck"
    save_model(tm, path)
    np.savez(data, x=np.zeros((8, 1, 4, 4), np.float32))  # no labels
    assert main(["train", str(path), "--data", str(data), "--checkpoint", str(ck), "--runtime", "reference"]) == 2
    assert "the data has no array for input 'labels'" in capsys.readouterr().err
    assert not ck.exists()
    np.savez(data, x=np.full((8, 1, 4, 4), np.nan, np.float32), labels=np.zeros(8, np.int64))
    assert main(["train", str(path), "--data", str(data), "--checkpoint", str(ck), "--runtime", "reference"]) == 2
    assert "holds 128 NaN value(s)" in capsys.readouterr().err and not ck.exists()


def skip_norm_classifier() -> onnx.ModelProto:
    """com.microsoft SkipSimplifiedLayerNormalization (onnxruntime's contrib op) on the path of every gradient."""
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W"),
             numpy_helper.from_array(np.ones(4, np.float32), "gamma")]
    nodes = [helper.make_node("SkipSimplifiedLayerNormalization", ["x", "x", "gamma"], ["n"], name="skip_norm",
                              domain="com.microsoft", epsilon=1e-5),
             helper.make_node("MatMul", ["n", "W"], ["y"], name="head")]
    graph = helper.make_graph(nodes, "sn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9)


@pytest.mark.parametrize("target", ["tract", "reference"])
def test_a_contrib_op_is_named_as_lacked_where_the_runtime_has_none(target, tmp_path, capsys):
    """tract and onnx's reference evaluator have no com.microsoft kernels: check's op list named none of them
    ("tract lacks none of the model's ops") and only the probe's conversion refused the node. The list names it."""
    tm = make_training_model(skip_norm_classifier(), "cross_entropy", "sgd")
    path = tmp_path / "train.onnx"
    save_model(tm, path)
    assert main(["check", str(path), "--target", target]) == 1
    out = capsys.readouterr().out
    assert (f"{target} lacks com.microsoft.SkipSimplifiedLayerNormalization: needed by node 'skip_norm' "
            "(MISSING: no standard form)") in out, out
    assert "lacks none" not in out
    assert main(["check", str(path), "--target", "onnxruntime"]) == 0
