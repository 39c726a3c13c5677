"""The opt-in 8-bit backward through a frozen int4 base (``lora={..., "base_backward": "int8"}``): the default
graph has no MatMulInteger; the opt-in's graph passes the full checker and runs on onnxruntime, and its adapter
gradients agree with the float32 backward's within INT8_RTOL, a bound that a scale 5% off breaks."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.driver.session import TrainingSession
from onnx_autodiff.errors import TrainingBuilderError
from onnx_autodiff.passes.pipeline import lower
from onnx_autodiff.training.builder import make_training_model
from onnx_autodiff.training.lora.quantized import dequantize_nbits, int8_backward_names, int8_columns

K, H, V, ROWS = 64, 96, 80, 48
# relative Frobenius error of each adapter's gradient: measured 0.30% / 0.11% (MSE), 0.47% / 0.35% (cross-entropy),
# 0.54% / 0.47% (cross-entropy, near-uniform softmax over 2048 classes: 19-27% with the row scale set by the
# row's largest entry instead of taken apart), 5.0% with the weight's scale 1.05x, 2.2% (MSE) with u8 x s8 codes
# (onnxruntime's AVX2 kernel saturates; gradient_rules/quantized.py)
INT8_RTOL = 0.01


def _nbits(name: str, x: str, n: int, k: int, rng, out: str, size: float = 1.0):
    block = 16
    codes = rng.integers(0, 256, (n, k // block, block // 2), dtype=np.uint8)
    scales = ((rng.random(n * (k // block)) * 0.02 + 0.01) * size).astype(np.float32)
    node = helper.make_node("MatMulNBits", [x, f"{name}.weight_Q4", f"{name}.weight_scales"], [out], name=name,
                            domain="com.microsoft", K=k, N=n, bits=4, block_size=block)
    return node, [numpy_helper.from_array(codes, f"{name}.weight_Q4"),
                  numpy_helper.from_array(scales, f"{name}.weight_scales")]


def _model(v: int = V, head: float = 1.0) -> onnx.ModelProto:
    """x -> fc1 (int4) -> Relu -> head (int4, its scales times ``head``) -> y: LoRA on fc1; its gradient goes back
    through head's."""
    rng = np.random.default_rng(0)
    n1, i1 = _nbits("fc1", "x", H, K, rng, "h")
    n2, i2 = _nbits("head", "r", v, H, rng, "y", head)
    g = helper.make_graph([n1, helper.make_node("Relu", ["h"], ["r"], name="relu"), n2], "m",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, v])], i1 + i2)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


def _training(base_backward: str | None, loss: str = "mse", v: int = V, head: float = 1.0) -> onnx.ModelProto:
    lora = {"rank": 4, "targets": ["fc1"]} | ({"base_backward": base_backward} if base_backward else {})
    return make_training_model(_model(v, head), loss, "sgd", lr=1.0, lora=lora)


def _gradients(training: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """The adapters' gradients, lora_B set to non-zero values (at zero, A gets none)."""
    sess = TrainingSession(training, progress=False)
    rng = np.random.default_rng(1)
    for name in (n for n in sess.state if ".lora_" in n):
        sess.set_state(name, rng.standard_normal(sess.get_state(name).shape).astype(np.float32))
    return {k: v.numpy() for k, v in sess.gradients(feeds).items() if k.endswith("_grad")}


def _errors(a: dict, b: dict) -> list[float]:
    return [float(np.linalg.norm(b[k] - a[k]) / np.linalg.norm(a[k])) for k in a]


def _ops(model: onnx.ModelProto) -> set[str]:
    low = lower(model)  # check=True: onnx.checker.check_model(full_check=True)
    return {n.op_type for g in (low.graph, *(t.algorithm for t in low.training_info)) for n in g.node}


def _feeds(loss: str, v: int = V) -> dict:
    rng = np.random.default_rng(2)
    labels = rng.integers(0, v, ROWS) if loss == "cross_entropy" else rng.standard_normal((ROWS, v))
    return {"x": rng.standard_normal((ROWS, K)).astype(np.float32),
            "labels": labels.astype(np.int64 if loss == "cross_entropy" else np.float32)}


@pytest.fixture(scope="module")
def feeds():
    return _feeds("mse")


def test_default_emits_no_integer_product_and_the_opt_in_does():
    default, explicit, int8 = _training(None), _training("float32"), _training("int8")
    assert "MatMulInteger" not in _ops(default)
    assert default.SerializeToString() == explicit.SerializeToString()  # "float32" is the default, unchanged
    ops = _ops(int8)
    assert {"MatMulInteger", "QuantizeLinear"} <= ops
    names = int8_backward_names("head.weight_Q4")
    assert set(names) <= {t.name for t in int8.graph.initializer}
    assert not {n for n in int8_backward_names("fc1.weight_Q4")} & {t.name for t in int8.graph.initializer}


# cross-entropy over 2048 classes with the head's scales times 0.01: a near-uniform softmax (an LM head at its
# start), whose small entries a row scale set by the one-hot entry rounds to zero in every row alike
@pytest.mark.parametrize("loss, v, head", [("mse", V, 1.0), ("cross_entropy", V, 1.0), ("cross_entropy", 2048, 0.01)])
def test_int8_adapter_gradients_match_float32(loss, v, head):
    feeds = _feeds(loss, v)
    ref = _gradients(_training(None, loss, v, head), feeds)
    errors = _errors(ref, _gradients(_training("int8", loss, v, head), feeds))
    assert len(errors) == 2 and max(errors) < INT8_RTOL, errors
    assert min(errors) > 0  # the int8 product does run


def test_a_wrong_scale_fails_the_bound(feeds):
    ref = _gradients(_training(None), feeds)
    wrong = _training("int8")
    scale = next(t for t in wrong.graph.initializer if t.name == int8_backward_names("head.weight_Q4")[1])
    scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * np.float32(1.05), scale.name))
    assert max(_errors(ref, _gradients(wrong, feeds))) > INT8_RTOL


def test_the_rule_looks_for_the_names_the_rewrite_writes():
    from onnx_autodiff.engine.registry import load_rules

    load_rules()
    import gradient_rules.quantized as rules

    assert rules._int8_names("w.weight_Q4") == int8_backward_names("w.weight_Q4")


def test_int8_columns_requantize_the_dequantized_weight():
    model = _model()
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    node = model.graph.node[2]
    w = dequantize_nbits(node, inits.get)
    codes, scale = int8_columns(node, inits.get)
    assert codes.dtype == np.int8 and codes.shape == w.shape and scale.shape == (w.shape[1],)
    np.testing.assert_allclose(np.abs(w).max(0) / 127, scale, rtol=1e-6)
    assert np.abs(codes * scale - w).max() <= scale.max() / 2 * (1 + 1e-5)


def test_a_large_contraction_is_split_so_int32_sums_cannot_overflow():
    """N * 127 * 127 past 2^31 - 1 (a vocabulary over 133,143): two MatMulInteger over halves of N."""
    low = lower(_training("int8", v=133_200))
    ops = [n.op_type for t in low.training_info for n in t.algorithm.node]
    assert ops.count("MatMulInteger") == 2


def test_base_backward_is_checked():
    with pytest.raises(TrainingBuilderError, match="base_backward must be one of float32, int8"):
        _training("int4")
    plain = _model()
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((K, H)).astype(np.float32), "fc1.weight")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "fc1.weight"], ["y"], name="fc1")], "m",
                          [plain.graph.input[0]], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, H])],
                          [w])
    float_model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    with pytest.raises(TrainingBuilderError, match="no float32 MatMulNBits"):
        make_training_model(float_model, "mse", "sgd", lora={"rank": 4, "targets": ["fc1"], "base_backward": "int8"})


@pytest.mark.parametrize("adapters", ["merged", "inputs"])
def test_the_inference_export_leaves_the_int8_weights_out(feeds, adapters):
    import onnxruntime as ort

    sess = TrainingSession(_training("int8"), progress=False)
    sess.step(feeds)
    model = sess.inference_model(adapters=adapters)
    names = {t.name for t in model.graph.initializer}
    assert not any(n.endswith((".int8_backward", ".int8_backward_scale")) for n in names)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["y"], {"x": feeds["x"]})[0]
    assert y.shape == (ROWS, V) and np.isfinite(y).all()


def test_cli_lora_base_backward(tmp_path, capsys):
    from onnx_autodiff.cli import main

    onnx.save(_model(), str(tmp_path / "m.onnx"))
    out = str(tmp_path / "train.onnx")
    base = ["make-training", str(tmp_path / "m.onnx"), out, "--loss", "mse"]
    assert main(base + ["--lora-rank", "4", "--lora-targets", "fc1", "--lora-base-backward", "int8"]) == 0
    assert set(int8_backward_names("head.weight_Q4")) <= {t.name for t in onnx.load(out).graph.initializer}
    assert main(base + ["--lora-base-backward", "int8"]) != 0
    assert "need --lora-rank" in capsys.readouterr().err
