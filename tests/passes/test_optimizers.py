"""Adagrad / Adam / Momentum lowered to standard ops, held against onnx's own backend cases and its
reference implementation."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper
from onnx.reference import ReferenceEvaluator

from onnx_autodiff import TrainingSpecError, lower
from onnx_autodiff.graph import TRAINING_DOMAINS

BACKEND_CASES = ["test_adagrad", "test_adagrad_multiple", "test_adam", "test_adam_multiple",
                 "test_momentum", "test_momentum_multiple", "test_nesterov_momentum"]
PREVIEW = "ai.onnx.preview.training"


def _backend_cases():
    """The node test cases onnx ships for the optimizer ops, generated from the installed package."""
    from onnx.backend.test.case import node as node_cases
    from onnx.backend.test.case.node import adagrad, adam, momentum

    found = {}
    original = node_cases.expect

    def capture(node, inputs, outputs, name, **kwargs):
        found[name] = (node, inputs, outputs, kwargs)

    for mod in (adagrad, adam, momentum):
        mod.expect = capture
    try:
        for cls in (adagrad.Adagrad, adam.Adam, momentum.Momentum):
            for attr in dir(cls):
                if attr.startswith("export"):
                    getattr(cls, attr)()
    finally:
        for mod in (adagrad, adam, momentum):
            mod.expect = original
    return found


CASES = _backend_cases()


def _model_of(node, inputs, outputs, opset_imports):
    ins = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.asarray(a).dtype), np.shape(a))
           for n, a in zip(node.input, inputs)]
    outs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.asarray(a).dtype), np.shape(a))
            for n, a in zip(node.output, outputs)]
    graph = helper.make_graph([node], "opt", ins, outs)
    return helper.make_model(graph, opset_imports=list(opset_imports))


def _run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def test_all_backend_cases_found():
    assert sorted(CASES) == sorted(BACKEND_CASES)


@pytest.mark.parametrize("name", BACKEND_CASES)
def test_onnx_backend_case(name):
    node, inputs, outputs, kwargs = CASES[name]
    model = _model_of(node, inputs, outputs, kwargs.get("opset_imports", [helper.make_opsetid(PREVIEW, 1)]))
    low = lower(model)
    assert all(n.domain not in TRAINING_DOMAINS for n in low.graph.node)
    assert all(o.domain != PREVIEW for o in low.opset_import)
    got = _run(low, dict(zip(node.input, inputs)))
    assert len(got) == len(outputs)
    for g, e, o in zip(got, outputs, node.output):
        # the tolerances onnx's backend test runner uses for these cases (TestCase defaults)
        np.testing.assert_allclose(g, np.asarray(e).astype(g.dtype), rtol=1e-3, atol=1e-7, err_msg=o)


def _optimizer_model(op, n, attrs, shapes, dtype=np.float32):
    per = {"Adagrad": ["X", "G", "H"], "Adam": ["X", "G", "V", "H"], "Momentum": ["X", "G", "V"]}[op]
    outs = {"Adagrad": ["X", "H"], "Adam": ["X", "V", "H"], "Momentum": ["X", "V"]}[op]
    ins = ["R", "T"] + [f"{p}{i}" for p in per for i in range(n)]
    out_names = [f"{p}{i}_new" for p in outs for i in range(n)]
    node = helper.make_node(op, ins, out_names, domain=PREVIEW, **attrs)
    tt = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    vis = [helper.make_tensor_value_info("R", tt, []), helper.make_tensor_value_info("T", onnx.TensorProto.INT64, [])]
    vis += [helper.make_tensor_value_info(f"{p}{i}", tt, shapes[i]) for p in per for i in range(n)]
    ovis = [helper.make_tensor_value_info(f"{p}{i}_new", tt, shapes[i]) for p in outs for i in range(n)]
    graph = helper.make_graph([node], "opt", vis, ovis)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(PREVIEW, 1)])


_ATTRS = {
    "Adagrad": st.fixed_dictionaries({
        "decay_factor": st.sampled_from([0.0, 0.1, 0.5]),
        "epsilon": st.sampled_from([1e-6, 1e-2]),
        "norm_coefficient": st.sampled_from([0.0, 0.001, 0.3])}),
    "Adam": st.fixed_dictionaries({
        "alpha": st.sampled_from([0.9, 0.5]),
        "beta": st.sampled_from([0.999, 0.7]),
        "epsilon": st.sampled_from([1e-6, 1e-2]),
        "norm_coefficient": st.sampled_from([0.0, 0.01]),
        "norm_coefficient_post": st.sampled_from([0.0, 0.05])}),
    "Momentum": st.fixed_dictionaries({
        "alpha": st.sampled_from([0.9, 0.5]),
        "beta": st.sampled_from([1.0, 0.3]),
        "mode": st.sampled_from(["standard", "nesterov"]),
        "norm_coefficient": st.sampled_from([0.0, 0.01])}),
}


@pytest.mark.parametrize("op", ["Adagrad", "Adam", "Momentum"])
@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_matches_reference_implementation(op, data):
    """Any attributes, T = 0 or later steps, several tensors: equal to onnx.reference."""
    attrs = data.draw(_ATTRS[op])
    n = data.draw(st.integers(1, 3))
    t = data.draw(st.sampled_from([0, 1, 2, 7, 50]))
    shapes = [data.draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)) for _ in range(n)]
    seed = data.draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    model = _optimizer_model(op, n, attrs, shapes)
    per = {"Adagrad": 3, "Adam": 4, "Momentum": 3}[op]
    feeds = {"R": np.array(rng.uniform(0.01, 0.5), np.float32), "T": np.array(t, np.int64)}
    names = [i.name for i in model.graph.input][2:]
    for k, name in enumerate(names):
        shape = shapes[k % n]
        val = np.asarray(rng.normal(size=shape), dtype=np.float32)
        if name[0] == "H":  # accumulated squares are non-negative
            val = np.abs(val)
        feeds[name] = np.asarray(val, dtype=np.float32)
    # the truth: onnx.reference in float64 on the same float32 values. float32 arithmetic (ours, or the
    # reference's own) is within a few ulps of the operands' magnitude, not of the result's: X - R*step can
    # cancel (0.0777 from operands near 1 was off by 1.6e-5 relative, 1.3e-6 absolute, in both float32 runs)
    exact = ReferenceEvaluator(_optimizer_model(op, n, attrs, shapes, np.float64)).run(
        None, {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()})
    got = _run(lower(model), feeds)
    assert len(got) == (per - 1) * n
    for k, (g, e) in enumerate(zip(got, exact)):
        i = k % n
        operands = [feeds[name] for name in names if int(name[1:]) == i] + [np.asarray(e)]
        scale = max(float(np.abs(v).max(initial=0.0)) for v in operands) + float(feeds["R"])
        np.testing.assert_allclose(g, e, rtol=0, atol=16 * np.finfo(np.float32).eps * max(scale, 1.0))


def test_float64_optimizer():
    model = _optimizer_model("Adam", 1, {"alpha": 0.9, "beta": 0.99}, [[3]], dtype=np.float64)
    feeds = {"R": np.array(0.1), "T": np.array(3, np.int64), "X0": np.array([1.0, -2.0, 3.0]),
             "G0": np.array([0.5, 0.1, -1.0]), "V0": np.array([0.1, 0.2, 0.3]), "H0": np.array([0.4, 0.5, 0.6])}
    expected = ReferenceEvaluator(model).run(None, feeds)
    got = _run(lower(model), feeds)
    for g, e in zip(got, expected):
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, e, rtol=1e-12)


def test_momentum_without_required_attribute_is_an_error():
    node = helper.make_node("Momentum", ["R", "T", "X", "G", "V"], ["Xn", "Vn"], domain=PREVIEW,
                            alpha=0.9, beta=0.1, norm_coefficient=0.0)
    model = _model_of(node, [np.float32(0.1), np.int64(0), np.zeros(2, np.float32), np.zeros(2, np.float32),
                             np.zeros(2, np.float32)], [np.zeros(2, np.float32)] * 2,
                      [helper.make_opsetid("", 17), helper.make_opsetid(PREVIEW, 1)])
    with pytest.raises(TrainingSpecError, match="mode"):
        lower(model)


def test_wrong_input_count_is_an_error():
    node = helper.make_node("Adam", ["R", "T", "X", "G", "V"], ["Xn"], domain=PREVIEW)
    model = _model_of(node, [np.float32(0.1), np.int64(0)] + [np.zeros(2, np.float32)] * 3,
                      [np.zeros(2, np.float32)], [helper.make_opsetid("", 17), helper.make_opsetid(PREVIEW, 1)])
    with pytest.raises(TrainingSpecError, match="inputs"):
        lower(model)


def test_lowered_optimizer_uses_only_standard_ops():
    node, inputs, outputs, kwargs = CASES["test_adam_multiple"]
    low = lower(_model_of(node, inputs, outputs, kwargs["opset_imports"]))
    assert {n.domain for n in low.graph.node} == {""}
    onnx.checker.check_model(low, full_check=True)
