"""Lacks entries narrower than an op (passes/targets.py: ``meets``) pick which nodes the lowering for a target writes
in standard ops: OpenVINO converts NegativeLogLikelihoodLoss, but not with ignore_index, so only that node is
rewritten, and the rewrite computes what the op computes."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnx_autodiff import lower
from onnx_autodiff.runtimes.targets import RUN_TIME_AXES, Target, meets


def _nll(**attrs):
    f = helper.make_tensor_value_info
    node = helper.make_node("NegativeLogLikelihoodLoss", ["lp", "t"], ["loss"], name="nll", **attrs)
    graph = helper.make_graph([node], "g", [f("lp", TensorProto.FLOAT, [4, 5]), f("t", TensorProto.INT64, [4])],
                              [f("loss", TensorProto.FLOAT, [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_openvino_rewrites_nll_only_with_ignore_index():
    ops = lambda m: [n.op_type for n in m.graph.node]  # noqa: E731
    assert ops(lower(_nll(reduction="mean"), target="openvino")) == ["NegativeLogLikelihoodLoss"]
    with_ignore = lower(_nll(reduction="mean", ignore_index=2), target="openvino")
    assert "NegativeLogLikelihoodLoss" not in ops(with_ignore)
    rng = np.random.default_rng(0)
    feeds = {"lp": np.log(rng.dirichlet(np.ones(5), 4)).astype(np.float32), "t": np.array([0, 2, 4, 2])}
    run = lambda m: ort.InferenceSession(m.SerializeToString()).run(None, feeds)[0]  # noqa: E731
    assert np.allclose(run(with_ignore), run(_nll(reduction="mean", ignore_index=2)), rtol=1e-6)


@pytest.mark.parametrize("entry,attrs,opset,hit", [
    ("Loss[ignore_index]", {"ignore_index": 1}, 17, True),
    ("Loss[ignore_index]", {}, 17, False),
    ("Loss[layout=1]", {"layout": 1}, 17, True),
    ("Loss[layout=1]", {"layout": 0}, 17, False),
    ("Loss[mode=wrap]", {"mode": "wrap"}, 17, True),
    ("Loss[opset<13]", {}, 11, True),
    ("Loss[opset<13]", {}, 13, False),
])
def test_meets(entry, attrs, opset, hit):
    node = helper.make_node("Loss", ["x"], ["y"], **attrs)
    assert (meets({entry}, node, opset=opset) == entry) is hit
    assert meets({entry}, helper.make_node("Loss", ["x"], ["y"], domain="com.example", **attrs), opset=opset) is None


def test_axes_of_run_time_length():
    target = Target("t", "", frozenset({f"ReduceSum[{RUN_TIME_AXES}]"}))
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"])
    assert target.lacked(node, {"axes"}) == f"ReduceSum[{RUN_TIME_AXES}]"
    assert target.lacked(node, set()) is None and target.has_op("ReduceSum")


def _dq(x, scale, zp=None, opset=21, **attrs):
    f = helper.make_tensor_value_info
    inits = [helper.make_tensor("scale", TensorProto.FLOAT, scale.shape, scale.ravel())]
    if zp is not None:
        inits.append(helper.make_tensor("zp", TensorProto.UINT8, zp.shape, zp.ravel()))
    node = helper.make_node("DequantizeLinear", ["x", "scale"] + (["zp"] if zp is not None else []), ["y"],
                            name="dq", **attrs)
    graph = helper.make_graph([node], "g", [f("x", TensorProto.UINT8, list(x.shape))],
                              [f("y", TensorProto.FLOAT, list(x.shape))], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


@pytest.mark.parametrize("target,scale_shape,attrs", [
    ("tract", (), {}),
    ("tract", (5,), {"axis": 1}),
    ("openvino", (6,), {"axis": 0}),
    ("tract", (6, 2), {"axis": 1, "block_size": 3}),  # 5 columns in blocks of 3: the last block is short
    ("tract", (2, 5), {"axis": 0, "block_size": 4}),
])
@pytest.mark.parametrize("with_zp", [False, True])
def test_dequantize_linear_where_a_target_lacks_it(target, scale_shape, attrs, with_zp):
    """The gradient of MatMulNBits dequantizes with DequantizeLinear along axis 0 (tract lacks the op, OpenVINO
    the axis): the standard form computes what onnxruntime's kernel does, per tensor, axis and block."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (6, 5)).astype(np.uint8)
    scale = rng.uniform(0.1, 1.0, scale_shape).astype(np.float32)
    zp = rng.integers(0, 256, scale_shape).astype(np.uint8) if with_zp else None
    model = _dq(x, scale, zp, **attrs)
    lowered = lower(model, target=target)
    assert "DequantizeLinear" not in [n.op_type for n in lowered.graph.node]
    run = lambda m: ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})[0]  # noqa: E731
    np.testing.assert_allclose(run(lowered), run(model), rtol=1e-6)
