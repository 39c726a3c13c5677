"""The float64 reference of ``check``: onnx.reference's float32 Erf replaced (onnx_autodiff/runtimes/reference_ops.py),
so GELU models check at float64 tolerances, and a gradient a thousandth off is still caught."""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_autodiff as oa
from onnx_autodiff.cli import main
from onnx_autodiff.engine.registry import override_rule
from onnx_autodiff.runtimes.reference_ops import Float64Evaluator


def _model(nodes, opset=17, inits=()):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])], list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _erf_model():
    w = numpy_helper.from_array(np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32), "w")
    return _model([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Erf", ["h"], ["y"])],
                  inits=[w])


def _gelu_mlp(opset: int):
    """x @ w1 + b1 -> GELU (BERT's Erf form at opset 17, the Gelu op at 20) -> @ w2."""
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in [("w1", (4, 8)), ("b1", (8,)), ("w2", (8, 3))]]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m"]), helper.make_node("Add", ["m", "b1"], ["h"])]
    if opset >= 20:
        nodes.append(helper.make_node("Gelu", ["h"], ["a"]))
    else:
        inits += [numpy_helper.from_array(np.array(v, np.float32), n)
                  for n, v in [("root2", math.sqrt(2.0)), ("one", 1.0), ("half", 0.5)]]
        nodes += [helper.make_node("Div", ["h", "root2"], ["s"]), helper.make_node("Erf", ["s"], ["e"]),
                  helper.make_node("Add", ["e", "one"], ["p"]), helper.make_node("Mul", ["h", "p"], ["q"]),
                  helper.make_node("Mul", ["q", "half"], ["a"])]
    nodes.append(helper.make_node("MatMul", ["a", "w2"], ["y"]))
    return _model(nodes, opset, inits)


def test_the_reference_erf_is_float64():
    g = helper.make_graph([helper.make_node("Erf", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [None])],
                          [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [None])])
    x = np.random.default_rng(0).standard_normal(2000) * 3
    y = Float64Evaluator(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])).run(None, {"x": x})[0]
    assert y.dtype == np.float64
    assert np.max(np.abs(y - np.array([math.erf(v) for v in x]))) < 1e-12


@pytest.mark.parametrize("model", [_erf_model, lambda: _gelu_mlp(17), lambda: _gelu_mlp(20)],
                         ids=["erf", "gelu-mlp-erf", "gelu-mlp-op"])
def test_gelu_models_pass_check(tmp_path, model, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(model(), str(path))
    assert main(["check", str(path)]) == 0
    assert "ok:" in capsys.readouterr().out
    assert main(["check", str(path), "--float32"]) == 0


def test_an_erf_gradient_a_thousandth_off_is_caught():
    def erf_grad(g, node, dy):  # 2/sqrt(pi) exp(-x^2), times 1.001
        x = node.inputs[0]
        d = g.Mul(g.const(1.001 * 2.0 / math.sqrt(math.pi), like=x), g.Exp(g.Neg(g.Mul(x, x))))
        return [g.Mul(dy[0], d)]

    model = _erf_model()
    assert oa.gradcheck(model).ok
    with override_rule("Erf", erf_grad), pytest.raises(oa.GradcheckError, match="disagrees") as err:
        oa.gradcheck(model)
    assert {c.name for c in err.value.report.checks if not c.ok} == {"x", "w"}


def test_a_transformers_bert_classifier_passes_check(tmp_path, capsys):
    """The export Optimum makes of a BERT text classifier. Before: "the gradient of 'logits' w.r.t. ... disagrees
    with finite differences (relative error 2.00e-02)"."""
    pytest.importorskip("transformers")
    from tests.optimum_models import bert_classifier

    path = bert_classifier(tmp_path / "bert" / "model.onnx")
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ok: 21 tensor(s) agree" in out
