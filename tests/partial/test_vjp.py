"""build_vjp: the forward/backward split, its saved tensors, and its gradients against torch autograd."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.errors import GradientSpecError
from onnx_autodiff.graph import MAX_IR_VERSION
from onnx_autodiff.partial.vjp import build_vjp
from tests.models import model_of

F, D = TensorProto.FLOAT, TensorProto.DOUBLE


def vi(name, shape, dt=D):
    return helper.make_tensor_value_info(name, dt, shape)


def make(nodes, inputs, outputs, inits=(), opset=17):
    g = helper.make_graph(nodes, "m", inputs, outputs, initializer=[numpy_helper.from_array(v, k) for k, v in inits])
    return model_of(g, opset=opset)


def session(m):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


def run_vjp(v, feeds, grads):
    """Forward then backward, feeding the backward by name as the contract says."""
    fwd_names = [o.name for o in v.forward.graph.output]
    fwd = dict(zip(fwd_names, session(v.forward).run(None, feeds)))
    bfeeds = {s: feeds[s] for s in v.saved_inputs}
    bfeeds.update({s: fwd[s] for s in v.saved_outputs})
    bfeeds.update({f"{o}_grad": grads[o] for o in v.outputs})
    assert set(bfeeds) == {i.name for i in v.backward.graph.input}
    out = session(v.backward).run(None, bfeeds)
    return fwd, dict(zip(v.wrt, out))


def node_ops(m):
    return [n.op_type for n in m.graph.node]


W = np.array([[0.5, -1.5, 2.0]])
B = np.array([0.1, 0.2, -0.3])


def exp_mul_relu_model():
    """y = Relu(Exp(x) * w) + b; x: [N, 3]."""
    nodes = [
        helper.make_node("Exp", ["x"], ["a"]),
        helper.make_node("Mul", ["a", "w"], ["m"]),
        helper.make_node("Relu", ["m"], ["r"]),
        helper.make_node("Add", ["r", "b"], ["y"]),
    ]
    return make(nodes, [vi("x", ["N", 3])], [vi("y", ["N", 3])], [("w", W), ("b", B)])


def torch_grads(fn, feeds, grads, wrt):
    ts = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in feeds.items()}
    outs = fn(ts)
    torch.autograd.backward([outs[o] for o in grads], [torch.tensor(g) for g in grads.values()])
    return {k: ts[k].grad.numpy() for k in wrt}, {k: v.detach().numpy() for k, v in outs.items()}


def test_single_output_matches_torch_autograd():
    rng = np.random.default_rng(0)
    v = build_vjp(exp_mul_relu_model())
    assert v.wrt == ["x", "w", "b"] and v.outputs == ["y"]
    x = rng.standard_normal((4, 3))
    dy = rng.standard_normal((4, 3))
    fwd, got = run_vjp(v, {"x": x, "w": W, "b": B}, {"y": dy})
    want, outs = torch_grads(lambda t: {"y": torch.relu(torch.exp(t["x"]) * t["w"]) + t["b"]},
                             {"x": x, "w": W, "b": B}, {"y": dy}, ["x", "w", "b"])
    np.testing.assert_allclose(fwd["y"], outs["y"], rtol=1e-12)
    for k in want:
        assert got[k].shape == want[k].shape
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-12)


def test_saved_tensors_are_exactly_what_the_rules_read():
    v = build_vjp(exp_mul_relu_model())
    # Exp's rule reads its output a, Mul's rule reads a and w, Relu's rule reads its input m;
    # x (only Exp's input) and r (only Add's input) are not saved.
    assert set(v.saved) == {"a", "w", "m"}
    assert v.saved_inputs == ["w"] and set(v.saved_outputs) == {"a", "m"}
    assert [o.name for o in v.forward.graph.output] == ["y"] + v.saved_outputs
    assert [i.name for i in v.backward.graph.input] == v.saved + ["y_grad"]
    assert [o.name for o in v.backward.graph.output] == ["x_grad", "w_grad", "b_grad"]


def test_backward_recomputes_no_forward_node():
    v = build_vjp(exp_mul_relu_model())
    forward_outputs = {o for n in v.forward.graph.node for o in n.output}
    assert "Exp" not in node_ops(v.backward) and "Relu" not in node_ops(v.backward)
    assert not forward_outputs & {o for n in v.backward.graph.node for o in n.output}


def test_models_are_plain_checked_onnx_the_runtime_loads():
    v = build_vjp(exp_mul_relu_model())
    for m in v:
        onnx.checker.check_model(m, full_check=True)
        assert m.ir_version <= MAX_IR_VERSION
        assert all(o.domain in ("", "ai.onnx") for o in m.opset_import)
        session(m)


def test_wrt_subset_and_unchosen_initializers_stay_constants():
    v = build_vjp(exp_mul_relu_model(), wrt=["x"])
    assert [o.name for o in v.backward.graph.output] == ["x_grad"]
    # w is not trained: the backward holds it as an initializer, the forward keeps it as one.
    assert "w" in {t.name for t in v.backward.graph.initializer}
    assert "w" not in {i.name for i in v.backward.graph.input}
    assert "w" not in {i.name for i in v.forward.graph.input}
    assert v.saved_inputs == []
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    _, got = run_vjp(v, {"x": x}, {"y": dy})
    want, _ = torch_grads(lambda t: {"y": torch.relu(torch.exp(t["x"]) * t["w"]) + t["b"]},
                          {"x": x, "w": W, "b": B}, {"y": dy}, ["x"])
    np.testing.assert_allclose(got["x"], want["x"], rtol=1e-12)


def test_trained_initializers_are_forward_inputs_with_their_values_as_defaults():
    v = build_vjp(exp_mul_relu_model(), wrt=["w", "b"])
    assert {"w", "b"} <= {i.name for i in v.forward.graph.input}
    x = np.ones((2, 3))
    default = session(v.forward).run(["y"], {"x": x})[0]
    fed = session(v.forward).run(["y"], {"x": x, "w": 2 * W, "b": B})[0]
    np.testing.assert_allclose(default, np.maximum(np.exp(x) * W, 0) + B)
    np.testing.assert_allclose(fed, np.maximum(np.exp(x) * 2 * W, 0) + B)


def test_the_backward_keeps_the_defaults_of_trained_initializers_it_reads():
    v = build_vjp(exp_mul_relu_model(), wrt=["x", "w"])
    # x's gradient reads w: a caller that relied on the forward's default can rely on the backward's
    assert v.saved_inputs == ["w"] and "w" in {t.name for t in v.backward.graph.initializer}
    x = np.ones((2, 3))
    saved = dict(zip([o.name for o in v.forward.graph.output], session(v.forward).run(None, {"x": x})))
    bfeeds = {s: saved[s] for s in v.saved_outputs}
    dx = session(v.backward).run(["x_grad"], {**bfeeds, "y_grad": np.ones((2, 3))})[0]
    np.testing.assert_allclose(dx, np.exp(x) * W * (np.exp(x) * W > 0))


def test_without_defaults_trained_initializers_are_plain_inputs():
    v = build_vjp(exp_mul_relu_model(), wrt=["w", "b"], defaults=False)
    assert {t.name for t in v.forward.graph.initializer} == set()
    assert {t.name for t in v.backward.graph.initializer} == set()
    assert [i.name for i in v.forward.graph.input] == ["x", "w", "b"]
    x = np.ones((2, 3))
    fed = session(v.forward).run(["y"], {"x": x, "w": 2 * W, "b": B})[0]
    np.testing.assert_allclose(fed, np.maximum(np.exp(x) * 2 * W, 0) + B)


def test_several_outputs_sum_their_contributions():
    # A shared trunk t = Exp(x) * w with two heads: y1 = Relu(t), y2 = ReduceSum(t * t, axis 1).
    nodes = [
        helper.make_node("Exp", ["x"], ["e"]),
        helper.make_node("Mul", ["e", "w"], ["t"]),
        helper.make_node("Relu", ["t"], ["y1"]),
        helper.make_node("Mul", ["t", "t"], ["tt"]),
        helper.make_node("ReduceSum", ["tt", "axes"], ["y2"], keepdims=0),
    ]
    m = make(nodes, [vi("x", ["N", 3])], [vi("y1", ["N", 3]), vi("y2", ["N"])],
             [("w", W), ("axes", np.array([1], dtype=np.int64))])
    v = build_vjp(m)
    assert v.outputs == ["y1", "y2"] and v.wrt == ["x", "w"]
    rng = np.random.default_rng(2)
    x, d1, d2 = rng.standard_normal((5, 3)), rng.standard_normal((5, 3)), rng.standard_normal(5)

    def f(t):
        tr = torch.exp(t["x"]) * t["w"]
        return {"y1": torch.relu(tr), "y2": (tr * tr).sum(1)}

    fwd, got = run_vjp(v, {"x": x, "w": W}, {"y1": d1, "y2": d2})
    want, outs = torch_grads(f, {"x": x, "w": W}, {"y1": d1, "y2": d2}, ["x", "w"])
    np.testing.assert_allclose(fwd["y2"], outs["y2"], rtol=1e-12)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-12)
    # one reverse sweep from both heads: the trunk's backward (Exp, then Mul by w) is emitted once
    bwd_ops = [n.op_type for n in v.backward.graph.node]
    assert bwd_ops.count("Exp") == 0 and sum(1 for n in v.backward.graph.node
                                             if n.op_type == "Mul" and "w" in n.input) == 1


def test_outputs_option_selects_what_is_differentiated():
    nodes = [helper.make_node("Exp", ["x"], ["y1"]), helper.make_node("Neg", ["x"], ["y2"])]
    m = make(nodes, [vi("x", [3])], [vi("y1", [3]), vi("y2", [3])])
    v = build_vjp(m, outputs=["y2"])
    assert [o.name for o in v.forward.graph.output] == ["y2"]
    assert [i.name for i in v.backward.graph.input] == ["y2_grad"]
    _, got = run_vjp(v, {"x": np.ones(3)}, {"y2": np.arange(3.0)})
    np.testing.assert_allclose(got["x"], -np.arange(3.0))


def test_x_the_outputs_do_not_depend_on_gets_a_zero_gradient():
    nodes = [helper.make_node("Exp", ["x"], ["y"])]
    m = make(nodes, [vi("x", ["N"]), vi("z", ["N", 2])], [vi("y", ["N"])])
    v = build_vjp(m)
    _, got = run_vjp(v, {"x": np.ones(4), "z": np.ones((4, 2))}, {"y": np.ones(4)})
    np.testing.assert_array_equal(got["z"], np.zeros((4, 2)))
    # only z's shape crosses over, not z itself
    assert "z" not in v.saved


def test_default_wrt_skips_integer_inputs_and_initializers():
    nodes = [helper.make_node("Cast", ["k"], ["kf"], to=D), helper.make_node("Mul", ["x", "kf"], ["y"])]
    m = make(nodes, [vi("x", [2]), vi("k", [2], TensorProto.INT64)], [vi("y", [2])])
    v = build_vjp(m)
    assert v.wrt == ["x"]
    _, got = run_vjp(v, {"x": np.ones(2), "k": np.array([3, 4])}, {"y": np.ones(2)})
    np.testing.assert_allclose(got["x"], [3.0, 4.0])


def test_float32_model():
    nodes = [helper.make_node("Mul", ["x", "x"], ["y"])]
    m = make(nodes, [vi("x", [2, 2], F)], [vi("y", [2, 2], F)])
    v = build_vjp(m)
    x = np.array([[1, 2], [3, 4]], dtype=np.float32)
    _, got = run_vjp(v, {"x": x}, {"y": np.ones((2, 2), np.float32)})
    assert got["x"].dtype == np.float32
    np.testing.assert_allclose(got["x"], 2 * x)


@pytest.mark.parametrize("kwargs, message", [
    ({"wrt": ["nope"]}, "not a floating-point graph input"),
    ({"wrt": ["x", "x"]}, "more than once"),
    ({"outputs": ["a"]}, "not a graph output"),
])
def test_bad_requests_raise_spec_errors(kwargs, message):
    with pytest.raises(GradientSpecError, match=message):
        build_vjp(exp_mul_relu_model(), **kwargs)


def test_gradient_name_clash_is_reported():
    nodes = [helper.make_node("Exp", ["x"], ["x_grad"]), helper.make_node("Neg", ["x_grad"], ["y"])]
    m = make(nodes, [vi("x", [2])], [vi("y", [2])])
    with pytest.raises(GradientSpecError, match="x_grad"):
        build_vjp(m)


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_dot_product_identity_under_broadcasting(data):
    """<J u, v> = <u, J^T v> for y = Exp(a) * b + a with broadcast shapes, by central differences."""
    rank = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank)))
    b_shape = tuple(d if data.draw(st.booleans()) else 1 for d in shape)[data.draw(st.integers(0, rank)):]
    nodes = [helper.make_node("Exp", ["a"], ["e"]), helper.make_node("Mul", ["e", "b"], ["p"]),
             helper.make_node("Add", ["p", "a"], ["y"])]
    m = make(nodes, [vi("a", list(shape)), vi("b", list(b_shape))], [vi("y", list(shape))])
    v = build_vjp(m)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    feeds = {"a": np.asarray(rng.standard_normal(shape)), "b": np.asarray(rng.standard_normal(b_shape))}
    dy = rng.standard_normal(shape)
    _, jtv = run_vjp(v, feeds, {"y": dy})
    fwd = session(v.forward)
    eps = 1e-6
    for name in ("a", "b"):
        u = rng.standard_normal(feeds[name].shape)
        plus = fwd.run(["y"], {**feeds, name: np.asarray(feeds[name] + eps * u)})[0]
        minus = fwd.run(["y"], {**feeds, name: np.asarray(feeds[name] - eps * u)})[0]
        numeric = float(np.sum((plus - minus) / (2 * eps) * dy))
        analytic = float(np.sum(jtv[name] * u))
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(numeric))


def test_dropout_masks_are_prepared_like_in_lower():
    # Dropout in training mode: its gradient reuses the forward mask, which build_vjp must add.
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"]),
        helper.make_node("Dropout", ["h", "ratio", "train"], ["y"]),
    ]
    m = make(nodes, [vi("x", [2, 3])], [vi("y", [2, 3])],
             [("w", W), ("ratio", np.array(0.0)), ("train", np.array(True))])
    v = build_vjp(m, wrt=["x"])
    x, dy = np.ones((2, 3)), np.full((2, 3), 2.0)
    fwd, got = run_vjp(v, {"x": x}, {"y": dy})
    np.testing.assert_allclose(got["x"], np.broadcast_to(2.0 * W, (2, 3)), rtol=1e-12)
