"""Tensors of fewer than 8 bits an element (int4, uint4, float4e2m1, int2, uint2, float6: every packed type this onnx
has, onnx_autodiff/model/packed.py) are stored packed, in raw_data and in external data alike: our loader reads
ceil(n * bits / 8) bytes, not one a element, and every writer packs them again. Each type inline and external,
through our loader, a save, onnx's own reader and onnxruntime where it runs the type; an external length wrong for
the type is our error, not a misread of the neighbouring bytes."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import TrainingSession, make_training_model
from onnx_autodiff.errors import ModelFileError
from onnx_autodiff.model.carrier import hand_back, open_model
from onnx_autodiff.model.io import load_split, save_model_atomic
from onnx_autodiff.model.packed import BITS, stored_size

TYPES = {TensorProto.DataType.Name(t): t for t in BITS}
ORT_RUNS = {"INT4", "UINT4", "INT2", "UINT2"}  # onnxruntime 1.32's CPU Cast: float4e2m1 and float6 it has no kernel for
SHAPES = {"big": (63, 129), "small": (3, 5)}  # odd counts: a last byte half (or partly) filled


def _values(kind: str, shape, seed: int) -> np.ndarray:
    dtype = helper.tensor_dtype_to_np_dtype(TYPES[kind])
    rng = np.random.default_rng(seed)
    if kind.startswith("FLOAT"):  # values each of these types holds exactly
        return rng.choice(np.array([0.0, 0.5, 1.0, -1.5, 2.0, -3.0], np.float32), shape).astype(dtype)
    bits = BITS[TYPES[kind]]
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1)) if kind.startswith("INT") else (0, 2 ** bits)
    return rng.integers(low, high, shape).astype(dtype)


def _model(kind: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Each tensor Cast to float: the graph's outputs are its values."""
    values = {name: _values(kind, shape, i) for i, (name, shape) in enumerate(SHAPES.items())}
    nodes = [helper.make_node("Cast", [n], [f"{n}_f"], to=TensorProto.FLOAT) for n in values]
    outputs = [helper.make_tensor_value_info(f"{n}_f", TensorProto.FLOAT, list(v.shape)) for n, v in values.items()]
    g = helper.make_graph(nodes, "g", [], outputs, [numpy_helper.from_array(v, n) for n, v in values.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 25)], ir_version=13), values


def _same(array, expected) -> None:
    assert array.dtype == expected.dtype and array.shape == expected.shape
    np.testing.assert_array_equal(np.asarray(array).view(np.uint8), expected.view(np.uint8))


def _holds(path, values, kind) -> None:
    """onnx's reader, our loader and onnxruntime (where it runs the type) all read ``values`` from ``path``."""
    full = onnx.load(str(path))
    for t in full.graph.initializer:
        _same(numpy_helper.to_array(t), values[t.name])
    light, weights = load_split(str(path))
    for t in light.graph.initializer:
        _same(weights[t.name] if t.name in weights else numpy_helper.to_array(t), values[t.name])
    if kind in ORT_RUNS:
        ys = ort.InferenceSession(str(path)).run([f"{n}_f" for n in values], {})
        for y, v in zip(ys, values.values()):
            np.testing.assert_array_equal(y, v.astype(np.float32))


@pytest.mark.parametrize("kind", sorted(TYPES))
@pytest.mark.parametrize("stored", ["inline", "external"])
def test_packed_tensors_round_trip(tmp_path, kind, stored):
    model, values = _model(kind)
    src = tmp_path / "src" / "m.onnx"
    src.parent.mkdir()
    external = stored == "external"
    onnx.save(model, str(src), save_as_external_data=external, all_tensors_to_one_file=True, location="m.data",
              size_threshold=0)
    _holds(src, values, kind)
    light, weights = load_split(str(src))
    assert ("big" in weights) == external  # an external tensor is read into the store, unpacked
    out = tmp_path / "out" / "m.onnx"
    out.parent.mkdir()
    save_model_atomic(light, str(out), external_data_threshold=0, weights=weights)  # our writer packs again
    written = onnx.load(str(out), load_external_data=False).graph.initializer
    big = next(t for t in written if t.name == "big")
    length = stored_size(TYPES[kind], values["big"].size)
    if external:
        assert {e.key: e.value for e in big.external_data}["length"] == str(length)
    else:
        assert len(big.raw_data) == length
    _holds(out, values, kind)
    whole = hand_back(open_model(str(src)))  # what the API hands back: the tensors packed into raw_data
    for t in whole.graph.initializer:
        _same(numpy_helper.to_array(t), values[t.name])


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_an_external_length_wrong_for_the_type_is_our_error(tmp_path, kind):
    """The length one byte an element (the old misreading), the file long enough to hold it: refused."""
    model, values = _model(kind)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="m.data",
              size_threshold=0)
    m = onnx.load(str(path), load_external_data=False)
    big = next(t for t in m.graph.initializer if t.name == "big")
    for e in big.external_data:
        if e.key == "length":
            e.value = str(values["big"].size)
    with open(path, "wb") as f:
        f.write(m.SerializeToString())
    with open(tmp_path / "m.data", "ab") as f:
        f.write(b"\0" * values["big"].size)
    with pytest.raises(ModelFileError, match=f"initializer 'big': its external data is {values['big'].size} bytes "
                                             f"long, but 8127 element\\(s\\) of {kind} take"):
        load_split(str(path))


def test_a_cut_short_packed_file_is_our_error(tmp_path):
    model, _ = _model("INT4")
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="m.data",
              size_threshold=0)
    data = (tmp_path / "m.data").read_bytes()
    (tmp_path / "m.data").write_bytes(data[:100])
    with pytest.raises(ModelFileError, match="holds 100 bytes, the tensor needs"):
        load_split(str(path))


def _qdq_int4() -> onnx.ModelProto:
    """y = x @ DequantizeLinear(int4 weight, per-column scales) + bias: the QDQ form of a 4-bit weight."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.integers(-8, 8, (64, 64)).astype(helper.tensor_dtype_to_np_dtype(
        TensorProto.INT4)), "w_q")
    scale = numpy_helper.from_array((rng.random(64) * 0.1 + 0.01).astype(np.float32), "w_scale")
    bias = numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "bias")
    nodes = [helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"], axis=1),
             helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "bias"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64])], [w, scale, bias])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def test_a_qdq_int4_model_with_external_data_trains_as_inline(tmp_path):
    """Before: "initializer 'w_q': ... holds 2560 bytes, the tensor needs 4096 at offset 0"."""
    model = _qdq_int4()
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((4, 64)).astype(np.float32),
             "labels": rng.standard_normal((4, 64)).astype(np.float32)}
    losses = {}
    for stored in ("inline", "external"):
        path = tmp_path / stored / "m.onnx"
        path.parent.mkdir()
        onnx.save(model, str(path), save_as_external_data=stored == "external", all_tensors_to_one_file=True,
                  location="m.data", size_threshold=0)
        sess = TrainingSession(make_training_model(str(path), "mse", "sgd", lr=1e-2))
        losses[stored] = [float(sess.step(feeds)["loss"]) for _ in range(3)]
        sess.save(str(tmp_path / stored / "ckpt.onnx"), external_data_threshold=0)
        again = TrainingSession(str(tmp_path / stored / "ckpt.onnx"))
        losses[stored].append(float(again.step(feeds)["loss"]))
    assert losses["external"] == losses["inline"]
    assert losses["inline"][-1] < losses["inline"][0]


def test_a_training_model_with_int4_external_data_trains(tmp_path):
    """A training model whose int4 weight is in external data: the step's session gets it packed (onnxruntime makes
    no OrtValue of int4 from numpy: "Creation of OrtValues is currently only supported from non-string numpy
    arrays"), and the forward check's plain run too."""
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((4, 64)).astype(np.float32),
             "labels": rng.standard_normal((4, 64)).astype(np.float32)}
    path = tmp_path / "train.onnx"
    onnx.save(make_training_model(_qdq_int4(), "mse", "sgd", lr=1e-2), str(path), save_as_external_data=True,
              all_tensors_to_one_file=True, location="train.data", size_threshold=0)
    assert load_split(str(path))[1]["w_q"].dtype == helper.tensor_dtype_to_np_dtype(TensorProto.INT4)
    sess = TrainingSession(str(path))  # its forward check holds the step to a plain onnxruntime run
    losses = [float(sess.step(feeds)["loss"]) for _ in range(3)]
    assert losses[-1] < losses[0]


def test_the_builders_int4_embedding_in_external_data_trains_and_checks(builder_models, capsys):
    """The model builder's int4 Llama with a quantized embedding (``op_types_to_quantize=MatMul/Gather``: an int4
    GatherBlockQuantized table in model.onnx.data). Before: "raw_data size (64000 bytes) does not match expected
    size from shape and data type (32000 bytes)" when the session was made."""
    from onnx_autodiff.cli import main
    from tests.integration.test_genai_builder import _batch, base_loss

    path = builder_models.get("llama", "int4", op_types_to_quantize="MatMul/Gather")
    m = onnx.load(str(path), load_external_data=False)
    table = next(t for t in m.graph.initializer if t.name == "model.embed_tokens.weight_Q4")
    assert table.data_type == TensorProto.INT4 and table.data_location == TensorProto.EXTERNAL
    feeds = _batch()
    sess = TrainingSession(make_training_model(str(path), "causal_lm", "adamw", lr=1e-2,
                                               lora={"rank": 4, "targets": ["mlp"]}))
    losses = [float(sess.step(feeds)["loss"]) for _ in range(4)]
    assert losses[0] == pytest.approx(base_loss(path, feeds), rel=1e-6)  # the table read as onnxruntime reads it
    assert losses[-1] < losses[0] - 0.5, losses
    saved = path.parent.parent / "gather-training" / "train.onnx"  # the training model, its table external too
    saved.parent.mkdir(exist_ok=True)
    model = make_training_model(str(path), "causal_lm", "adamw", lr=1e-2, lora={"rank": 4, "targets": ["mlp"]})
    onnx.save(model, str(saved), save_as_external_data=True, all_tensors_to_one_file=True, location="train.data",
              size_threshold=0)
    again = TrainingSession(str(saved))  # the table a constant of the step's session, packed in memory
    assert float(again.step(feeds)["loss"]) == pytest.approx(losses[0], rel=1e-6)
    assert main(["check", str(path)]) == 0
    assert "ok:" in capsys.readouterr().out
