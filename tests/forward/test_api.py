"""jvp, hvp and jacobian as a user calls them: names, errors, the name rule of a jvp of a jvp, the fallback,
opset upgrades, paths, and that jvp_check catches a wrong JVP rule."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import onnx_autodiff as oa
from onnx_autodiff.engine.registry import override_rule, scratch_registry
from tests.models import model, vi
from tests.torch_export import session

D = TensorProto.DOUBLE
RNG = np.random.default_rng(0)
W0 = RNG.standard_normal((3, 4))


def mlp(dtype=D, opset=17):
    """y = tanh(x W) [N, 4], s = sum(y^2) (a scalar)."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Tanh", ["h"], ["y"]),
             helper.make_node("Mul", ["y", "y"], ["y2"]), helper.make_node("ReduceSum", ["y2"], ["s"], keepdims=0)]
    w = W0.astype(helper.tensor_dtype_to_np_dtype(dtype))
    return model(nodes, [vi("x", ["N", 3], dtype)], [vi("y", ["N", 4], dtype), vi("s", [], dtype)], {"W": w},
                 opset=opset)


def torch_f(x, w):
    y = torch.tanh(x @ w)
    return y, (y * y).sum()


X = RNG.standard_normal((2, 3))


def test_jvp_names_and_values():
    out = oa.jvp(mlp(), ["x", "W"])
    assert [i.name for i in out.graph.input] == ["x", "x.tangent", "W.tangent"]
    assert [o.name for o in out.graph.output] == ["y", "s", "y.tangent", "s.tangent"]
    vx, vw = RNG.standard_normal(X.shape), RNG.standard_normal(W0.shape)
    y, s, yt, st = session(out).run(None, {"x": X, "x.tangent": vx, "W.tangent": vw})
    (ry, rs), (ryt, rst) = torch.func.jvp(torch_f, (torch.tensor(X), torch.tensor(W0)),
                                          (torch.tensor(vx), torch.tensor(vw)))
    np.testing.assert_allclose(yt, ryt.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st, rst.numpy(), rtol=1e-12)


def test_jvp_with_named_tangents_and_an_output_that_does_not_depend_on_wrt():
    m = mlp()
    m.graph.node.append(helper.make_node("Identity", ["c"], ["c_out"]))
    m.graph.input.append(vi("c", [2], D))
    m.graph.output.append(vi("c_out", [2], D))
    out = oa.jvp(m, "x", tangents={"x": "dx"})
    assert [i.name for i in out.graph.input][-1] == "dx"
    res = dict(zip([o.name for o in out.graph.output],
                   session(out).run(None, {"x": X, "dx": np.ones_like(X), "c": np.ones(2)})))
    np.testing.assert_array_equal(res["c_out.tangent"], np.zeros(2))


def test_jvp_of_jvp_takes_the_next_suffix_and_gives_second_derivatives():
    """u(x) = sin(x): jvp twice along ones gives u' = cos and u'' = -sin, named .tangent then .tangent2."""
    m = model([helper.make_node("Sin", ["x"], ["u"])], [vi("x", [5], D)], [vi("u", [5], D)])
    twice = oa.jvp(oa.jvp(m, "x"), "x")
    assert [i.name for i in twice.graph.input] == ["x", "x.tangent", "x.tangent2"]
    assert [o.name for o in twice.graph.output] == ["u", "u.tangent", "u.tangent2", "u.tangent.tangent2"]
    x = np.linspace(-1, 1, 5)
    u, du, du2, d2u = session(twice).run(None, {"x": x, "x.tangent": np.ones(5), "x.tangent2": np.ones(5)})
    np.testing.assert_allclose(du, np.cos(x), rtol=1e-14)
    np.testing.assert_allclose(du2, np.cos(x), rtol=1e-14)
    np.testing.assert_allclose(d2u, -np.sin(x), rtol=1e-14, atol=1e-15)


def test_jvp_refuses_what_does_not_fit():
    with pytest.raises(oa.ForwardSpecError, match="'h', which is not a graph input or initializer"):
        oa.jvp(mlp(), ["h"])
    with pytest.raises(oa.ForwardSpecError, match=r"already used in the model.*tangents="):
        oa.jvp(mlp(), ["x"], tangents={"x": "y"})
    with pytest.raises(oa.ForwardSpecError, match="not in wrt"):
        oa.jvp(mlp(), ["x"], tangents={"W": "dW"})
    m = mlp()
    m.graph.input.append(vi("k", [1], TensorProto.INT64))
    with pytest.raises(oa.ForwardSpecError, match="not floating point"):
        oa.jvp(m, ["k"])


def test_hvp_matches_torch():
    out = oa.hvp(mlp(), ["W", "x"], of="s")
    assert [i.name for i in out.graph.input] == ["x", "W.tangent", "x.tangent"]
    assert [o.name for o in out.graph.output] == ["s", "W.grad", "x.grad", "W.hvp", "x.hvp"]
    vw, vx = RNG.standard_normal(W0.shape), RNG.standard_normal(X.shape)
    s, gw, gx, hw, hx = session(out).run(None, {"x": X, "W.tangent": vw, "x.tangent": vx})

    def f(w, x):
        return torch_f(x, w)[1]

    _, (rhw, rhx) = torch.autograd.functional.hvp(f, (torch.tensor(W0), torch.tensor(X)),
                                                  (torch.tensor(vw), torch.tensor(vx)))
    np.testing.assert_allclose(hw, rhw.numpy(), rtol=1e-10)
    np.testing.assert_allclose(hx, rhx.numpy(), rtol=1e-10)


def test_hvp_refuses_what_does_not_fit():
    with pytest.raises(oa.ForwardSpecError, match="2 outputs"):
        oa.hvp(mlp(), ["W"])
    with pytest.raises(oa.ForwardSpecError, match="not a scalar"):
        oa.hvp(mlp(), ["W"], of="y")
    m = mlp()
    m.graph.node.append(helper.make_node("Identity", ["s"], ["W.grad"]))
    with pytest.raises(oa.ForwardSpecError, match=r"\['W.grad'\].*rename"):
        oa.hvp(m, ["W"], of="s")


def test_jacobian_layout_and_values():
    out = oa.jacobian(mlp(), ["y", "s"], "W")
    names = [o.name for o in out.graph.output]
    assert names == ["y", "s", "dy/dW", "ds/dW"]
    res = dict(zip(names, session(out).run(None, {"x": X})))
    ref = torch.autograd.functional.jacobian(lambda w: torch_f(torch.tensor(X), w), torch.tensor(W0))
    assert res["dy/dW"].shape == (2, 4, 3, 4) and res["ds/dW"].shape == (3, 4)
    np.testing.assert_allclose(res["dy/dW"], ref[0].numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(res["ds/dW"], ref[1].numpy(), rtol=1e-12)
    with pytest.raises(oa.ForwardSpecError, match="'h', which is not a graph output"):
        oa.jacobian(mlp(), "h", "W")


def test_jacobian_of_an_output_that_does_not_depend_on_wrt_is_zero():
    m = mlp()
    m.graph.node.append(helper.make_node("Identity", ["c"], ["c_out"]))
    m.graph.input.append(vi("c", [2], D))
    m.graph.output.append(vi("c_out", [2], D))
    out = oa.jacobian(m, ["c_out", "y"], "W")
    res = dict(zip([o.name for o in out.graph.output], session(out).run(None, {"x": X, "c": np.ones(2)})))
    np.testing.assert_array_equal(res["dc_out/dW"], np.zeros((2, 3, 4)))
    assert res["dy/dW"].shape == (2, 4, 3, 4)


def test_a_model_file_works_like_the_proto(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(mlp(), path)
    assert oa.jvp(str(path), "x").SerializeToString() == oa.jvp(mlp(), "x").SerializeToString()
    with pytest.raises(oa.OnnxAutodiffError, match="does not exist"):
        oa.jvp(str(tmp_path / "nope.onnx"), "x")


def test_a_users_gradient_rule_is_read_by_the_forward_mode_too():
    """A user's gradient rule for Tanh (here a wrong one, twice the derivative) wins over the built-in JVP
    rule: the fallback reads the JVP off it, so both modes agree with each other and not with calculus."""
    def doubled(g, node, dy):
        y = node.outputs[0]
        return [g.Mul(g.Mul(dy[0], g.Sub(g.const(1.0, like=y), g.Mul(y, y))), g.const(2.0, like=y))]

    m = model([helper.make_node("Tanh", ["x"], ["y"])], [vi("x", [3], D)], [vi("y", [3], D)])
    x = np.array([0.1, -0.5, 0.7])
    with override_rule("Tanh", doubled):
        yt = session(oa.jvp(m, "x")).run(["y.tangent"], {"x": x, "x.tangent": np.ones(3)})[0]
        assert oa.jvp_check(m, {"x": x}).ok
    np.testing.assert_allclose(yt, 2 * (1 - np.tanh(x) ** 2), rtol=1e-14)


def test_jvp_check_catches_a_wrong_jvp_rule():
    def wrong(g, node, dx):
        return [g.Mul(dx[0], g.Cos(node.inputs[0]))]  # the derivative of sin, not of tanh

    m = model([helper.make_node("Tanh", ["x"], ["y"])], [vi("x", [3], D)], [vi("y", [3], D)])
    with scratch_registry():
        oa.jvp_rule("Tanh")(wrong)
        with pytest.raises(oa.GradcheckError, match="forward mode"):
            oa.jvp_check(m, {"x": np.array([0.1, -0.5, 0.7])})


def test_an_op_without_a_jvp_rule_goes_through_its_gradient_rule():
    """A user op with only a gradient rule: its JVP is read off that rule (the fallback)."""
    def square_grad(g, node, dy):
        return [g.Mul(dy[0], g.Add(node.inputs[0], node.inputs[0]))]

    m = model([helper.make_node("Square", ["x"], ["y"], domain="my.ops")], [vi("x", [3], D)], [vi("y", [3], D)])
    m.opset_import.append(helper.make_opsetid("my.ops", 1))
    with scratch_registry():
        oa.gradient_rule("Square", domain="my.ops")(square_grad)
        out = oa.jvp(m, "x", tangents={"x": "v"})
    ops = [(n.domain, n.op_type) for n in out.graph.node]
    assert ("my.ops", "Square") in ops and ops.count(("my.ops", "Square")) == 1
    assert {op for d, op in ops if d == ""} <= {"Mul", "Add", "Identity"}, ops


def test_an_old_opset_is_upgraded_once_when_a_jvp_needs_it():
    m = mlp(opset=7)
    with pytest.warns(UserWarning):
        out = oa.jacobian(m, "y", "W")  # the Scan over the basis needs opset 9
    assert {o.version for o in out.opset_import if o.domain in ("", "ai.onnx")} == {9}


def test_float32_results_pass_the_full_checker():
    out = oa.hvp(mlp(TensorProto.FLOAT), "W", of="s")
    onnx.checker.check_model(out, full_check=True)
    assert not [n for n in out.graph.node if n.domain not in ("", "ai.onnx")]


def test_the_fallback_on_a_large_weight_reads_only_its_type():
    """LpNormalization has no JVP rule: its JVP is read off its gradient rule, whose nodes read the 32x32
    weight, an initializer large enough to be detached from the light model the passes see."""
    w = RNG.standard_normal((32, 32)).astype(np.float32)
    m = model([helper.make_node("LpNormalization", ["W"], ["y"], axis=-1, p=2)], [],
              [vi("y", [32, 32])], {"W": w})
    out = oa.jvp(m, "W")
    v = RNG.standard_normal(w.shape).astype(np.float32)
    got = session(out).run(["y.tangent"], {"W.tangent": v})[0]
    w64, v64 = w.astype(np.float64), v.astype(np.float64)
    n = np.linalg.norm(w64, axis=-1, keepdims=True)
    want = v64 / n - w64 * np.sum(w64 * v64, axis=-1, keepdims=True) / n ** 3
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
