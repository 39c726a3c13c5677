"""The LoRA rewrite on a small hand-built model: target matching, PEFT's initialization, adapters only in the
update, the frozen base untouched, the merge for each weight layout, dropout, and the errors."""
from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import TrainingBuilderError, TrainingSession
from onnx_autodiff.cli import main
from onnx_autodiff.errors import ModelFileError, OutsideFolderError
from onnx_autodiff.training import make_training_model
from onnx_autodiff.training.lora import lora_record

D = TensorProto.DOUBLE
LORA = {"rank": 2, "alpha": 4, "targets": ["fc1", "head", "mix"]}


def net(seed: int = 0, hidden: int = 8) -> onnx.ModelProto:
    """x [N, 4] -> Gemm fc1 (W [8, 4], transB=1) -> Relu -> MatMul Transpose(head.weight [5, 8]) -> MatMul mix
    ([5, 3], [in, out]) -> y [N, 3]: the three layouts a weight can have."""
    rng = np.random.default_rng(seed)
    w = {"fc1.weight": rng.normal(size=(hidden, 4)), "fc1.bias": rng.normal(size=hidden),
         "head.weight": rng.normal(size=(5, hidden)), "mix": rng.normal(size=(5, 3))}
    nodes = [helper.make_node("Gemm", ["x", "fc1.weight", "fc1.bias"], ["h"], name="/fc1/Gemm", transB=1),
             helper.make_node("Relu", ["h"], ["r"], name="/relu"),
             helper.make_node("Transpose", ["head.weight"], ["head_t"], name="/head/Transpose", perm=[1, 0]),
             helper.make_node("MatMul", ["r", "head_t"], ["z"], name="/head/MatMul"),
             helper.make_node("MatMul", ["z", "mix"], ["y"], name="/mix/MatMul")]
    graph = helper.make_graph(nodes, "net", [helper.make_tensor_value_info("x", D, ["N", 4])],
                              [helper.make_tensor_value_info("y", D, ["N", 3])],
                              [numpy_helper.from_array(v, k) for k, v in w.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _data(seed=1):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(6, 4)), "labels": rng.normal(size=(6, 3))}


def test_targets_layouts_and_peft_init():
    training = make_training_model(net(), "mse", "adam", lora=LORA)
    rec = lora_record(training)
    layers = {layer["module"]: layer for layer in rec["layers"]}
    assert {m: (lay["weight"], lay["layout"], lay["n_in"], lay["n_out"]) for m, lay in layers.items()} == {
        "fc1": ("fc1.weight", "out_in", 4, 8), "head": ("head.weight", "out_in", 8, 5), "mix": ("mix", "in_out", 5, 3)}
    inits = {t.name: numpy_helper.to_array(t) for t in training.graph.initializer}
    for lay in layers.values():
        a, b = inits[lay["lora_A"]], inits[lay["lora_B"]]
        assert a.shape == (2, lay["n_in"]) and b.shape == (lay["n_out"], 2)
        assert np.abs(a).max() <= 1 / np.sqrt(lay["n_in"]) and np.abs(a).max() > 0 and not b.any()
    keys = {b.key for b in training.training_info[0].update_binding}
    adapters = {lay[k] for lay in layers.values() for k in ("lora_A", "lora_B")}
    assert adapters <= keys and not keys & {"fc1.weight", "fc1.bias", "head.weight", "mix"}
    plain = ort.InferenceSession(net().SerializeToString()).run(None, {"x": _data()["x"]})[0]
    sess = TrainingSession(training)
    np.testing.assert_array_equal(sess.inference_model(adapters="inputs").graph.output[0].name, "y")
    lora_out = ort.InferenceSession(sess.inference_model(adapters="inputs").SerializeToString()).run(
        None, {"x": _data()["x"], **{k: sess.state[k] for k in adapters}})[0]
    np.testing.assert_array_equal(lora_out, plain)  # B = 0: the rewritten model computes what the original did


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_training_moves_only_adapters_and_the_merge_is_exact(dropout):
    base = net()
    training = make_training_model(base, "mse", "adam", lr=0.05, lora={**LORA, "dropout": dropout})
    assert sum(n.op_type == "Dropout" for n in training.graph.node) == (3 if dropout else 0)
    sess = TrainingSession(training)
    losses = [float(sess.step(_data())["loss"]) for _ in range(15)]
    assert losses[-1] < losses[0]
    merged = sess.inference_model()
    assert not any(n.op_type == "Dropout" or "lora" in n.name for n in merged.graph.node)
    assert len(merged.graph.node) == len(base.graph.node)
    for t in base.graph.initializer:  # the base in the training session: bit for bit
        if t.name != "fc1.bias":
            np.testing.assert_array_equal(numpy_helper.to_array(t), sess._buffers.tensor(t.name))
    unmerged = sess.inference_model(adapters="inputs")
    adapters = {i.name: sess.state[i.name] for i in unmerged.graph.input if "lora" in i.name}
    x = _data(5)["x"]
    want = ort.InferenceSession(unmerged.SerializeToString()).run(None, {"x": x, **adapters})[0]
    got = ort.InferenceSession(merged.SerializeToString()).run(None, {"x": x})[0]
    base_out = ort.InferenceSession(base.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert np.abs(got - base_out).max() > 1e-3


def test_globs_and_weight_names_and_counts(caplog):
    caplog.set_level("INFO", logger="onnx_autodiff")
    training = make_training_model(net(), "mse", "adam", lora={"rank": 1, "targets": ["*.weight"]})
    assert {lay["weight"] for lay in lora_record(training)["layers"]} == {"fc1.weight", "head.weight"}
    assert "LoRA rank 1 on 2 weights" in caplog.text


@pytest.mark.parametrize("lora, words", [
    ({"rank": 2, "targets": ["q_proj"]}, "match no MatMul/Gemm.*fc1, head, mix"),
    ({"rank": 0, "targets": ["fc1"]}, "rank must be a positive int"),
    ({"rank": 2, "targets": []}, "targets"),
    ({"rank": 2, "targets": ["fc1"], "dropout": 1.0}, "dropout"),
    ({"rank": 2, "targets": ["fc1"], "bias": True}, "unknown keys"),
])
def test_lora_errors(lora, words):
    with pytest.raises(TrainingBuilderError, match=words):
        make_training_model(net(), "mse", "adam", lora=lora)


def test_lora_and_trainable_together_are_refused():
    with pytest.raises(TrainingBuilderError, match="only the adapters train"):
        make_training_model(net(), "mse", "adam", trainable=["mix"], lora=LORA)


def test_cli_lora(tmp_path, capsys):
    onnx.save(net(), str(tmp_path / "net.onnx"))
    out = str(tmp_path / "train.onnx")
    assert main(["make-training", str(tmp_path / "net.onnx"), out, "--loss", "mse", "--lora-rank", "2",
                 "--lora-alpha", "4", "--lora-targets", "fc1,mix"]) == 0
    assert "trainable: 0 of the model's 4 float initializers and 4 LoRA adapter tensors" in capsys.readouterr().out
    assert len(lora_record(onnx.load(out))["layers"]) == 2
    assert main(["make-training", str(tmp_path / "net.onnx"), out, "--loss", "mse", "--lora-rank", "2",
                 "--lora-targets", "nothing"]) != 0
    err = capsys.readouterr().err
    assert "match no MatMul/Gemm" in err and "fc1" in err and err.count("\n") == 1
    assert main(["export-adapter", str(tmp_path / "net.onnx"), str(tmp_path / "ad")]) != 0
    assert "no LoRA adapters" in capsys.readouterr().err


def test_checkpoint_holds_the_adapters_and_references_the_base(tmp_path):
    """A LoRA session opened from a file saves only the adapters and their optimizer state; the frozen weights
    are read from that file again on resume, export and export-adapter (named: it is outside the checkpoint's
    folder)."""
    base = str(tmp_path / "train.onnx")
    onnx.save(make_training_model(net(hidden=64), "mse", "adam", lr=0.05, lora=LORA), base)
    sess = TrainingSession(base)
    for _ in range(3):
        sess.step(_data())
    (tmp_path / "ckpt").mkdir()
    ckpt = str(tmp_path / "ckpt" / "checkpoint.onnx")
    sess.save(ckpt)
    stored = {t.name: t for t in onnx.load(ckpt, load_external_data=False).graph.initializer}
    refs = {n for n, t in stored.items() if any(e.value == "onnx-autodiff:base" for e in t.external_data)}
    assert refs == {"fc1.weight", "head.weight"}  # the two large frozen weights (the small ones stay inline)
    assert stored["fc1.weight.lora_A"].raw_data  # the adapters are in the checkpoint
    assert not stored["fc1.weight"].raw_data and os.listdir(tmp_path / "ckpt") == ["checkpoint.onnx"]
    with pytest.raises(OutsideFolderError, match="outside its folder"):
        TrainingSession(ckpt)
    again = TrainingSession(ckpt, base_path=base)
    assert again.steps == 3
    for name in sess.state:
        np.testing.assert_array_equal(again.state[name], sess.state[name])
    assert float(again.step(_data(9))["loss"]) == float(sess.step(_data(9))["loss"])
    assert main(["export", ckpt, str(tmp_path / "merged.onnx"), "--base", base]) == 0
    x = _data(4)["x"]
    want = ort.InferenceSession(sess.inference_model().SerializeToString()).run(None, {"x": x})[0]
    with pytest.raises(AssertionError):  # the session stepped once more than the checkpoint
        np.testing.assert_array_equal(ort.InferenceSession(str(tmp_path / "merged.onnx")).run(None, {"x": x})[0],
                                      want)
    np.testing.assert_array_equal(ort.InferenceSession(again.inference_model().SerializeToString()).run(
        None, {"x": x})[0], want)
    os.rename(base, base + ".moved")
    with pytest.raises(ModelFileError, match="frozen weights are in"):
        TrainingSession(ckpt, base_path=base)


def test_a_session_of_make_training_model_on_a_path_references_that_file(tmp_path):
    """make_training_model(path) keeps the base weights memory-mapped from the inference file; a session of
    its result checkpoints only the adapters and references the frozen weights in that file."""
    from onnx_autodiff.model import carrier

    inference = str(tmp_path / "net.onnx")
    onnx.save(net(hidden=64), inference)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(carrier, "INLINE_LIMIT", 0)  # the lean form of a large model
        training = make_training_model(inference, "mse", "adam", lr=0.05, lora=LORA)
    locations = {e.value for t in training.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"net.onnx"}  # the frozen weights are references into the inference file
    sess = TrainingSession(training)
    for _ in range(2):
        sess.step(_data())
    ckpt = str(tmp_path / "checkpoint.onnx")
    sess.save(ckpt)
    stored = {t.name: t for t in onnx.load(ckpt, load_external_data=False).graph.initializer}
    refs = {n for n, t in stored.items() if any(e.value == "onnx-autodiff:base" for e in t.external_data)}
    assert refs == {"fc1.weight", "head.weight"} and stored["fc1.weight.lora_A"].raw_data
    again = TrainingSession(ckpt)
    assert float(again.step(_data(9))["loss"]) == float(sess.step(_data(9))["loss"])


def test_cli_train_checkpoints_only_the_adapters(tmp_path, capsys):
    onnx.save(net(hidden=64), str(tmp_path / "net.onnx"))
    train = str(tmp_path / "train.onnx")
    assert main(["make-training", str(tmp_path / "net.onnx"), train, "--loss", "mse", "--lora-rank", "2",
                 "--lora-targets", "fc1,head"]) == 0
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", x=rng.normal(size=(12, 4)), labels=rng.normal(size=(12, 3)))
    args = ["train", train, "--data", str(tmp_path / "data.npz"), "--epochs", "2", "--batch-size", "4",
            "--checkpoint", str(tmp_path / "ck"), "--quiet"]
    assert main(args) == 0
    ckpt = str(tmp_path / "ck" / "checkpoint.onnx")
    stored = onnx.load(ckpt, load_external_data=False)
    assert any(p.key == "onnx_autodiff.base" for p in stored.metadata_props)
    assert main(args[:5] + ["3"] + args[6:]) == 0  # resumes from the adapter checkpoint for a third epoch
    assert TrainingSession(ckpt, base_path=train).steps == 9
    assert main(["export-adapter", ckpt, str(tmp_path / "peft"), "--base", train]) == 0
    assert sorted(os.listdir(tmp_path / "peft")) == ["adapter_config.json", "adapter_model.safetensors"]


def test_safetensors_written_without_the_library_reads_back(tmp_path):
    safetensors = pytest.importorskip("safetensors.numpy")
    from onnx_autodiff.training.lora.adapters import safetensors_bytes

    rng = np.random.default_rng(0)
    tensors = {"b.lora_B.weight": rng.normal(size=(5, 2)),
               "a.lora_A.weight": rng.normal(size=(2, 3)).astype(np.float32)}
    back = safetensors.load(safetensors_bytes(tensors))
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype
        np.testing.assert_array_equal(back[k], v)


def test_peft_names_and_prefix():
    from onnx_autodiff.training.lora.adapters import peft_config, peft_names

    record = {"rank": 2, "alpha": 4.0, "dropout": 0.0, "layers": [
        {"module": "m.model.layers.0.self_attn.q_proj", "lora_A": "val_7.lora_A", "lora_B": "val_7.lora_B"}]}
    assert peft_names(record, prefix="m.") == {
        "val_7.lora_A": "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "val_7.lora_B": "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"}
    assert peft_names(record, adapter="default")["val_7.lora_A"].endswith("q_proj.lora_A.default.weight")
    config = peft_config(record, prefix="m.")
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (2, 4.0, ["q_proj"])
    from onnx_autodiff.errors import AdapterError
    from onnx_autodiff.training.lora.adapters import export_peft

    with pytest.raises(AdapterError, match=r"export_adapter\(prefix='x.'\): the module path .* does not start with it"):
        export_peft(record, {}, "unused", prefix="x.")


def _named(weights: list[str]) -> onnx.ModelProto:
    """A chain of [4, 4] MatMuls whose weights carry ``weights``' names."""
    nodes, inits, x = [], [], "x"
    for k, w in enumerate(weights):
        nodes.append(helper.make_node("MatMul", [x, w], [f"h{k}"], name=f"/n{k}/MatMul"))
        inits.append(numpy_helper.from_array(np.eye(4, dtype=np.float32), w))
        x = f"h{k}"
    graph = helper.make_graph(nodes, "named", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [2, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("preset,adapted", [
    ("attention", ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "model.layers.0.attn.qkv_proj"]),
    ("mlp", ["transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj", "model.layers.0.mlp.down_proj"]),
    ("all", ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
             "transformer.h.0.mlp.c_proj", "model.layers.0.attn.qkv_proj", "model.layers.0.mlp.down_proj"]),
])
def test_presets_across_families(preset, adapted):
    """GPT-2's Conv1D names (attn.c_proj in attention, mlp.c_proj in the MLP) and the model builder's
    ``<module>.MatMul.weight`` names; the output layer stays out of every preset."""
    model = _named(["transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight",
                    "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight",
                    "model.layers.0.attn.qkv_proj.MatMul.weight", "model.layers.0.mlp.down_proj.MatMul.weight",
                    "lm_head.MatMul.weight"])
    trained = make_training_model(model, "mse", lora={"rank": 2, "targets": [preset]}, check=False)
    assert sorted(t["module"] for t in lora_record(trained)["layers"]) == sorted(adapted)
