"""The Gradient operator's semantics, one test per point of the spec (and ONNX's own backend cases)."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnx_autodiff as oa
from onnx_autodiff.check.gradcheck import gradcheck
from tests.models import model_of

TRAIN = "ai.onnx.preview.training"
F = TensorProto.FLOAT


def model(nodes, inputs, outputs, opset=17, inits=(), domain=TRAIN):
    m = model_of(helper.make_graph(nodes, "m", inputs, outputs, initializer=list(inits)), opset=opset)
    m.opset_import.append(helper.make_opsetid(domain, 1))
    return m


def vi(name, shape, dt=F):
    return helper.make_tensor_value_info(name, dt, shape)


def grad(inputs, outputs, xs, y, zs=(), name="grad", domain=TRAIN):
    extra = {"zs": list(zs)} if zs else {}
    return helper.make_node("Gradient", inputs, outputs, name=name, domain=domain, xs=list(xs), y=y, **extra)


def run(m, feeds):
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in m.graph.output], sess.run(None, feeds)))


def plain(m):
    domains = {n.domain for n in m.graph.node}
    assert not domains & {TRAIN, "ai.onnx.training"}
    assert all(o.domain in ("", "ai.onnx") for o in m.opset_import)
    onnx.checker.check_model(m, full_check=True)
    return m


def _onnx_backend_cases():
    import onnx.backend.test.case.model as case_model
    from onnx.backend.test.case.model.gradient import Gradient

    before = len(case_model._SimpleModelTestCases)
    Gradient.export_gradient_scalar_add()
    Gradient.export_gradient_scalar_add_and_mul()
    cases = case_model._SimpleModelTestCases[before:]
    del case_model._SimpleModelTestCases[before:]
    return cases


@pytest.mark.parametrize("case", _onnx_backend_cases(), ids=lambda c: c.name)
def test_onnx_backend_gradient_cases(case):
    assert case.name in ("test_gradient_of_add", "test_gradient_of_add_and_mul")
    lowered = plain(oa.lower(case.model))
    (inputs, expected), = case.data_sets
    feeds = {i.name: v for i, v in zip(lowered.graph.input, inputs)}
    got = run(lowered, feeds)
    for out, want in zip(lowered.graph.output, expected):
        np.testing.assert_allclose(got[out.name], want, rtol=case.rtol, atol=case.atol)


def _mlp(grad_node, extra_outputs=()):
    # y = sum(relu(x @ W + b) * z)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h0"], name="mm"),
        helper.make_node("Add", ["h0", "b"], ["h"], name="add"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Mul", ["r", "z"], ["p"], name="mul"),
        helper.make_node("ReduceSum", ["p"], ["y"], name="sum", keepdims=0),
        grad_node,
    ]
    inputs = [vi("x", [2, 3]), vi("W", [3, 4]), vi("b", [4]), vi("z", [2, 4])]
    outs = [vi("y", [])] + [vi(n, s) for n, s in extra_outputs]
    return model(nodes, inputs, outs)


def _feeds(seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in
            [("x", (2, 3)), ("W", (3, 4)), ("b", (4,)), ("z", (2, 4))]}


def _numpy_grads(f):
    h = f["x"] @ f["W"] + f["b"]
    dh = (h > 0) * f["z"]
    return {"x": dh @ f["W"].T, "W": f["x"].T @ dh, "b": dh.sum(0), "h": dh, "z": np.maximum(h, 0)}


def test_forward_outputs_unchanged_and_gradients_right():
    m = _mlp(grad(["W", "b", "z"], ["dW", "db"], xs=["W", "b"], zs=["z"], y="y"),
             [("dW", [3, 4]), ("db", [4])])
    f = _feeds()
    lowered = plain(oa.lower(m))
    assert [i.name for i in lowered.graph.input] == [i.name for i in m.graph.input]
    assert [o.name for o in lowered.graph.output] == [o.name for o in m.graph.output]
    got = run(lowered, f)
    want = _numpy_grads(f)
    np.testing.assert_allclose(got["dW"], want["W"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["db"], want["b"], rtol=1e-5, atol=1e-6)
    h = f["x"] @ f["W"] + f["b"]
    np.testing.assert_allclose(got["y"], (np.maximum(h, 0) * f["z"]).sum(), rtol=1e-5)


def test_empty_output_name_skips_that_gradient_and_its_work():
    full = oa.lower(_mlp(grad(["W", "b"], ["dW", "db"], xs=["W", "b"], y="y"), [("dW", [3, 4]), ("db", [4])]))
    only_b = plain(oa.lower(_mlp(grad(["W", "b"], ["", "db"], xs=["W", "b"], y="y"), [("db", [4])])))
    got = run(only_b, _feeds())
    np.testing.assert_allclose(got["db"], _numpy_grads(_feeds())["b"], rtol=1e-5, atol=1e-6)
    # dW needs x^T @ dh: no MatMul may remain for it beyond the forward one
    assert sum(n.op_type == "MatMul" for n in only_b.graph.node) == 1
    assert len(only_b.graph.node) < len(full.graph.node)


def test_intermediate_tensor_in_xs_cuts_the_graph():
    m = _mlp(grad(["h", "W"], ["dh", "dW"], xs=["h", "W"], y="y"), [("dh", [2, 4]), ("dW", [3, 4])])
    f = _feeds()
    got = run(plain(oa.lower(m)), f)
    want = _numpy_grads(f)
    np.testing.assert_allclose(got["dh"], want["h"], rtol=1e-5, atol=1e-6)
    # with h cut out as an independent variable, y no longer depends on W
    np.testing.assert_array_equal(got["dW"], np.zeros((3, 4), np.float32))


def test_gradient_at_other_values_differentiates_a_copy():
    # The doc's H_1 example: the Gradient's input is another tensor than the one named in xs.
    m = _mlp(grad(["h1"], ["dh"], xs=["h"], y="y"), [("dh", [2, 4])])
    m.graph.input.append(vi("h1", [2, 4]))
    f = _feeds()
    f["h1"] = -_feeds(1)["z"]
    lowered = plain(oa.lower(m))
    got = run(lowered, f)
    np.testing.assert_allclose(got["dh"], (f["h1"] > 0) * f["z"], rtol=1e-6)
    h = f["x"] @ f["W"] + f["b"]
    np.testing.assert_allclose(got["y"], (np.maximum(h, 0) * f["z"]).sum(), rtol=1e-5)


def test_non_scalar_y_is_differentiated_as_its_sum():
    nodes = [helper.make_node("Mul", ["a", "a"], ["y"], name="sq"), grad(["a"], ["da"], xs=["a"], y="y")]
    m = model(nodes, [vi("a", [3])], [vi("y", [3]), vi("da", [3])])
    a = np.array([1.0, -2.0, 3.0], np.float32)
    np.testing.assert_allclose(run(plain(oa.lower(m)), {"a": a})["da"], 2 * a)


def test_y_independent_of_x_gives_zeros_of_x_shape_and_type():
    nodes = [helper.make_node("Exp", ["a"], ["y"], name="e"),
             grad(["a", "c"], ["da", "dc"], xs=["a", "c"], y="y")]
    m = model(nodes, [vi("a", [2]), vi("c", ["N", 5])], [vi("y", [2]), vi("da", [2]), vi("dc", ["N", 5])])
    got = run(plain(oa.lower(m)), {"a": np.ones(2, np.float32), "c": np.ones((3, 5), np.float32)})
    assert got["dc"].shape == (3, 5) and got["dc"].dtype == np.float32 and not got["dc"].any()
    np.testing.assert_allclose(got["da"], np.exp(np.ones(2)), rtol=1e-6)


def test_several_gradient_nodes_and_second_order():
    # O = sum((X @ W) * L); first dO/dW, then d(sum dO/dW)/dX (the doc's d2O/dW2 example shape)
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["Y"], name="mm"),
        helper.make_node("Mul", ["Y", "Y"], ["Y2"], name="sq"),
        helper.make_node("Mul", ["Y2", "L"], ["P"], name="mul"),
        helper.make_node("ReduceSum", ["P"], ["O"], name="sum", keepdims=0),
        grad(["X", "W", "L"], ["dX", "dW"], xs=["X", "W"], zs=["L"], y="O", name="g1"),
        grad(["X", "W", "L"], ["ddX", "ddW"], xs=["X", "W"], zs=["L"], y="dW", name="g2"),
    ]
    m = model(nodes, [vi("X", [2, 3]), vi("W", [3, 2]), vi("L", [2, 2])],
              [vi("O", []), vi("dW", [3, 2]), vi("ddX", [2, 3]), vi("ddW", [3, 2])])
    rng = np.random.default_rng(0)
    f = {"X": rng.standard_normal((2, 3)), "W": rng.standard_normal((3, 2)), "L": rng.standard_normal((2, 2))}
    got = run(plain(oa.lower(m)), {k: v.astype(np.float32) for k, v in f.items()})
    # O = sum(L * (XW)^2): dO/dW = X^T (2 L XW); sum(dO/dW) w.r.t. W: X^T (2 L * (X 1 1^T))...
    X, W, L = f["X"], f["W"], f["L"]
    np.testing.assert_allclose(got["dW"], X.T @ (2 * L * (X @ W)), rtol=1e-4)
    ones = np.ones((3, 2))
    np.testing.assert_allclose(got["ddW"], X.T @ (2 * L * (X @ ones)), rtol=1e-4, atol=1e-5)
    # and the whole second-order graph agrees with finite differences in float64
    gradcheck(m, f, wrt=["X", "W"], of=["ddX", "ddW"])


def test_proposal_domain_is_accepted():
    nodes = [helper.make_node("Mul", ["a", "a"], ["y"], name="sq"),
             grad(["a"], ["da"], xs=["a"], y="y", domain="ai.onnx.training")]
    m = model(nodes, [vi("a", [3])], [vi("y", [3]), vi("da", [3])], domain="ai.onnx.training")
    a = np.array([1.0, 2.0, 3.0], np.float32)
    np.testing.assert_allclose(run(plain(oa.lower(m)), {"a": a})["da"], 2 * a)


def test_symbolic_batch_dimension_survives():
    nodes = [helper.make_node("Mul", ["x", "w"], ["p"], name="mul"),
             helper.make_node("ReduceSum", ["p"], ["y"], name="sum", keepdims=0),
             grad(["x", "w"], ["dx", "dw"], xs=["x", "w"], y="y")]
    m = model(nodes, [vi("x", ["N", 3]), vi("w", ["M", 1])], [vi("y", []), vi("dx", ["N", 3]), vi("dw", ["M", 1])])
    lowered = plain(oa.lower(m))
    assert lowered.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
    for n in (1, 4):
        x = np.arange(3 * n, dtype=np.float32).reshape(n, 3)
        w = np.full((n, 1), 2.0, np.float32)
        got = run(lowered, {"x": x, "w": w})
        np.testing.assert_allclose(got["dx"], np.broadcast_to(w, (n, 3)))
        np.testing.assert_allclose(got["dw"], x.sum(1, keepdims=True))


def test_unsupported_operator_lists_every_missing_op_and_returns_nothing():
    nodes = [helper.make_node("Mul", ["a", "a"], ["m"], name="sq"),
             helper.make_node("FancyOp", ["m"], ["f"], name="fancy", domain="my.ops"),
             helper.make_node("OtherOp", ["f"], ["y"], name="other", domain="my.ops"),
             grad(["a"], ["da"], xs=["a"], y="y")]
    m = model(nodes, [vi("a", [3])], [vi("y", [3]), vi("da", [3])])
    m.opset_import.append(helper.make_opsetid("my.ops", 1))
    before = m.SerializeToString()
    with pytest.raises(oa.UnsupportedOperatorError) as err:
        oa.lower(m)
    msg = str(err.value)
    assert "'fancy'" in msg and "FancyOp" in msg and "my.ops" in msg and "opset 1" in msg
    assert "OtherOp" in msg
    assert {e[1] for e in err.value.missing} == {"FancyOp", "OtherOp"}
    assert m.SerializeToString() == before


@pytest.mark.parametrize("attrs, inputs, outputs, match", [
    ({"xs": ["a"]}, ["a"], ["da"], "'y'"),
    ({"y": "y"}, ["a"], ["da"], "'xs'"),
    ({"xs": ["a"], "y": "y"}, ["a", "a"], ["da"], "inputs"),
    ({"xs": ["a"], "y": "y"}, ["a"], ["da", "db"], "outputs"),
    ({"xs": ["nope"], "y": "y"}, ["a"], ["da"], "'nope'"),
    ({"xs": ["a"], "y": "missing"}, ["a"], ["da"], "'missing'"),
])
def test_malformed_gradient_nodes_get_clear_errors(attrs, inputs, outputs, match):
    node = helper.make_node("Gradient", inputs, outputs, name="bad", domain=TRAIN, **attrs)
    m = model([helper.make_node("Mul", ["a", "a"], ["y"], name="sq"), node], [vi("a", [3])],
              [vi("y", [3])] + [vi(o, [3]) for o in outputs])
    with pytest.raises(oa.GradientSpecError, match=match) as err:
        oa.lower(m)
    assert "'bad'" in str(err.value)
