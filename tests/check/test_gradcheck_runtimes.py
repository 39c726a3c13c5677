"""gradcheck with the backward on another runtime: lowered for its target record (standard forms, step fixes), run
there in float32, held against float64 central differences. It passes where the runtime computes the gradient
right, and catches a backward that is wrong on one runtime only: OpenVINO 2026.4 without the step fix of
passes/step_quirks.py (a constant weight read both ways), and a runtime that perturbs one output."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import gradcheck
from onnx_autodiff.errors import GradcheckError, RuntimeRefusedError
from onnx_autodiff.runtimes.loop import load_runner
from onnx_autodiff.runtimes.targets import RUNTIMES
from tests.js_runtime import node


def _square_weight_model() -> onnx.ModelProto:
    """y = tanh(x @ W) @ W with W a constant (not differentiated): its backward reads W both ways."""
    f32 = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
             helper.make_node("MatMul", ["t", "W"], ["y"])]
    graph = helper.make_graph(nodes, "g", [f32("x", [3, 4])], [f32("y", [3, 4])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _installed(runtime: str) -> None:
    if runtime == "onnxruntime-node":
        node()
    else:
        pytest.importorskip({"openvino": "openvino", "tract": "tract"}.get(runtime, "onnx"))


@pytest.mark.parametrize("runtime", ["openvino", "tract", "onnxruntime-node", "reference"])
def test_gradcheck_passes_on_each_runtime(runtime, tmp_path):
    _installed(runtime)
    path = tmp_path / "model.onnx"
    onnx.save(_square_weight_model(), path)
    target = RUNTIMES[runtime] if runtime == "reference" else runtime  # a Target: onnx.reference in float32
    report = gradcheck(str(path), wrt=["x"], runtime=target)
    assert report.ok and report.runtime.startswith(f"{runtime} (float32)"), str(report)
    assert report.checks[0].rel_err < 1e-4


def test_gradcheck_catches_openvinos_misoriented_weight_without_the_step_fix():
    """OpenVINO 2026.4 computes the backward's dY @ W^T as dY @ W when W is also the forward's x @ W: silently wrong.
    The openvino target's step fix writes it as (W @ dY^T)^T; the same record without it fails the check."""
    pytest.importorskip("openvino")
    model = _square_weight_model()
    assert gradcheck(model, wrt=["x"], runtime="openvino").ok
    bare = dataclasses.replace(RUNTIMES["openvino"], step_fixes=())
    with pytest.raises(GradcheckError, match="w.r.t. 'x'") as e:
        gradcheck(model, wrt=["x"], runtime=bare)
    assert e.value.report.worst.rel_err > 0.1


def test_gradcheck_catches_a_runtime_that_perturbs_one_gradient():
    ort_load = load_runner("onnxruntime")

    def off_by_a_bit(path):
        run = ort_load(path)

        def perturbed(feeds):
            out = run(feeds)
            return {k: (v * 1.01 if k == "W__gradcheck_grad" else v) for k, v in out.items()}
        return perturbed

    model = _square_weight_model()
    assert gradcheck(model, runtime=ort_load).ok
    with pytest.raises(GradcheckError, match="w.r.t. 'W'") as e:
        gradcheck(model, runtime=off_by_a_bit)
    assert {c.name: c.ok for c in e.value.report.checks} == {"x": True, "W": False}


def test_a_runtime_that_cannot_convert_the_backward_is_named():
    """LpPool: tract lacks it (its conformance table) and onnx-autodiff has no standard form of it."""
    pytest.importorskip("tract")
    assert not RUNTIMES["tract"].has_op("LpPool")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3, 3])
    graph = helper.make_graph([helper.make_node("LpPool", ["x"], ["y"], kernel_shape=[2, 2], p=2, name="pool")],
                              "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(RuntimeRefusedError, match="tract could not convert backward.onnx: LpPool") as e:
        gradcheck(model, runtime="tract")
    assert e.value.ops == ["LpPool"] and "no lowering of onnx-autodiff avoids LpPool" in e.value.hint


def test_unknown_runtime_is_refused_with_the_choices():
    with pytest.raises(GradcheckError, match="unknown runtime 'openvino2'.*tract"):
        gradcheck(_square_weight_model(), runtime="openvino2")
