"""The language-model files Optimum / transformers.js publish (tests/optimum_models.py: a tiny random Llama and
GPT-2 as plain, with-past, merged, int8, q4 and fp16 files): ``check`` passes on each, LoRA trains on each, the
quantized and float16 runs follow a float32 run from the same start, a merged decoder's export serves both
branches, and a left-padded batch gives transformers + PEFT's loss and adapter gradients."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_autodiff import LossSpec, TrainingSession, make_training_model
from onnx_autodiff.check.llm_files import dequantized
from onnx_autodiff.cli import main
from onnx_autodiff.training.lora import lora_record
from onnx_autodiff.training.precision import precision_record
from tests.optimum_models import ARCHS, ATTENTION, FORMS, feeds

pytest.importorskip("transformers")
SLOW = pytest.mark.slow
# the default run covers Llama's forms; GPT-2's run with -m slow (about 1-4 s each)
CASES = [pytest.param(a, f, marks=[SLOW] if a == "gpt2" else [], id=f"{a}-{f}") for a in ARCHS for f in FORMS]
LOSS = LossSpec("causal_lm", options={"mask": "attention_mask"})


def _ids(seed: int = 0, shape=(4, 12)) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 1000, shape)


def _train(model, arch: str, batch: dict, steps: int, optimizer: str = "adamw", targets=None):
    """(losses, adapters in the rewrite's order as float64, session) after ``steps`` LoRA steps on ``batch``."""
    training = make_training_model(model, LOSS, optimizer, lr=1e-2,
                                   lora={"rank": 4, "alpha": 8, "targets": targets or ATTENTION[arch]})
    sess = TrainingSession(training, outputs=["loss"], progress=False)
    losses = [float(sess.step(batch)["loss"]) for _ in range(steps)]
    masters = (precision_record(training) or {}).get("masters", {})
    names = [layer[k] for layer in lora_record(training)["layers"] for k in ("lora_A", "lora_B")]
    return losses, [sess.get_state(masters.get(n, n)).astype(np.float64) for n in names], sess


def test_the_fixture_writes_the_forms_it_names(optimum_models):
    """Each file holds the graph form its name says, on either route (optimum-cli, or TorchScript + our merge)."""
    for arch in ARCHS:
        ops = {f: {n.op_type for g in _graphs(onnx.load(str(optimum_models.get(arch, f)))) for n in g.node}
               for f in FORMS}
        merged = onnx.load(str(optimum_models.get(arch, "merged")))
        assert [n.op_type for n in merged.graph.node] == ["If"]
        assert merged.graph.node[0].input[0] == "use_cache_branch"
        assert {"IsNaN", "Softmax", "Where"} <= ops["plain"]  # the exporter's guard of fully masked rows
        assert {"DynamicQuantizeLinear", "MatMulInteger"} <= ops["int8"]
        assert ("MatMulNBits" in ops["q4"]) == (arch == "llama")  # MatMulNBitsQuantizer skips GPT-2's Gemm layers
        fp16 = onnx.load(str(optimum_models.get(arch, "fp16")))
        assert {t.data_type for t in fp16.graph.initializer if t.data_type in (1, 10)} == {10}
        past = onnx.load(str(optimum_models.get(arch, "past")))
        mask = next(i for i in past.graph.input if i.name == "attention_mask")
        assert mask.type.tensor_type.shape.dim[1].dim_param == "past_sequence_length + sequence_length"
    print(f"route: {optimum_models.route}")


def _graphs(model):
    from onnx_autodiff.graph import walk_graph

    return walk_graph(model.graph)


@pytest.mark.parametrize("arch, form", CASES)
def test_check_passes(optimum_models, arch, form, capsys):
    assert main(["check", str(optimum_models.get(arch, form))]) == 0
    out = capsys.readouterr().out
    assert "ok:" in out and "nan" not in out
    if form == "merged":
        assert "use_cache_branch=True" in out and "use_cache_branch=False" in out


def test_check_target_and_bundle_runtimes_take_the_with_past_file(optimum_models, tmp_path, capsys):
    """The with-past file (past_key_values.*, position_ids) on every --target: check --target's probe once fed
    random tensors with every symbolic dim 2 (onnxruntime: "Gather ... indices element out of data bounds"), and
    the bundle runtimes' trainer wanted the past and the positions in the data ("the data has no array for input
    'position_ids'") while check said it trains there. Both now make them as the driver does: check exits 0 and a
    bundle on onnx.reference trains from token data only, its loss the onnxruntime session's."""
    from onnx_autodiff.driver.bundle import export_step
    from onnx_autodiff.runtimes.check import check_target
    from onnx_autodiff.runtimes.loop import BundleTrainer

    path = optimum_models.get("llama", "past")
    assert main(["check", str(path), "--target", "onnxruntime"]) == 0
    assert capsys.readouterr().out.strip().endswith("ok: the model runs on onnxruntime")
    training = make_training_model(str(path), LOSS, "adamw", lr=1e-2,
                                   lora={"rank": 4, "alpha": 8, "targets": ATTENTION["llama"]})
    result = check_target(training, "reference")
    assert result.ok and result.lines[-1] == "ok: the model trains on reference", result.lines
    batch = {"input_ids": _ids(), "attention_mask": np.ones((4, 12), np.int64)}
    export_step(training, tmp_path / "bundle", target="reference")
    trainer = BundleTrainer(tmp_path / "bundle", "reference", model=training)
    assert trainer.feed_names == ["input_ids", "attention_mask"]
    losses = [trainer.step(batch) for _ in range(3)]
    session = TrainingSession(training, outputs=["loss"], progress=False)
    want = [float(session.step(batch)["loss"]) for _ in range(3)]
    np.testing.assert_allclose(losses, want, rtol=1e-4)
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("arch, form", CASES)
def test_lora_trains_five_steps(optimum_models, arch, form):
    path = optimum_models.get(arch, form)
    losses, adapters, _ = _train(str(path), arch, feeds(path, _ids()), 5)
    assert np.all(np.isfinite(losses)) and all(b < a for a, b in zip(losses, losses[1:])), losses
    assert all(np.all(np.isfinite(a)) for a in adapters)


def _float32(model: onnx.ModelProto) -> onnx.ModelProto:
    """A float16 model computing in float32 on the same (float16-rounded) weights."""
    from onnx import TensorProto, numpy_helper

    g = model.graph
    for t in g.initializer:
        if t.data_type == TensorProto.FLOAT16:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT16:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float32), a.t.name))
            elif a.type == onnx.AttributeProto.INT and a.name == "to" and a.i == TensorProto.FLOAT16:
                a.i = TensorProto.FLOAT
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT16:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT
    return model


def _logits_gap(quantized, reference, batch) -> float:
    a = ort.InferenceSession(quantized.SerializeToString()).run(["logits"], batch)[0]
    b = ort.InferenceSession(reference.SerializeToString()).run(["logits"], batch)[0]
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("arch", [pytest.param("llama"), pytest.param("gpt2", marks=SLOW)])
@pytest.mark.parametrize("form", ["int8", "q4", "fp16"])
def test_quantized_and_float16_adapters_follow_float32(optimum_models, arch, form):
    """5 SGD steps (lr 1e-2, rank 4 on the attention) from the same adapters against float32 on the very same base
    values (the dequantized int8 / q4 weights, the float16 weights in float32): SGD keeps the adapters linear in
    the gradients, so their difference is the gradients' (AdamW's first steps move each entry by +-lr whatever its
    gradient, turning noise on near-zero gradients into full steps).

    * q4: MatMulNBits (accuracy level 0) multiplies by its dequantized weight in float32: the same arithmetic,
      equal to float32 rounding (measured: bitwise equal): 1e-5.
    * fp16: the forward and backward round to float16 (unit roundoff 4.9e-4) around every op: measured at most
      1.9e-3 per adapter (relative, Frobenius): 5e-3.
    * int8: the forward rounds every projection's input to 8 bits at run time, so the quantized model itself
      computes other logits than its dequantized form (measured: 5% on Llama, 2% on GPT-2, relative), and its
      gradients are the float product's taken at that forward (the straight-through estimate): the adapters
      follow within 3x the forward's own gap (measured: 2.5x Llama, 1.8x GPT-2). A wrong sign or a lost path
      would be off by 100%."""
    path = optimum_models.get(arch, form)
    model = onnx.load(str(path))
    batch = feeds(path, _ids())
    reference = _float32(onnx.load(str(path))) if form == "fp16" else dequantized(model)
    ref_batch = {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in batch.items()}
    targets = [f"*{t}*" for t in ATTENTION[arch]]  # the dequantized layers keep the module in their node names
    _, ours, _ = _train(str(path), arch, batch, 5, "sgd", targets)
    _, theirs, _ = _train(reference, arch, ref_batch, 5, "sgd", targets)
    assert len(ours) == len(theirs) == 4 * (1 if arch == "gpt2" else 2)
    worst = max(np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(ours, theirs))
    tolerance = {"q4": 1e-5, "fp16": 5e-3}.get(form) or 3 * _logits_gap(model, reference, batch)
    assert worst < tolerance, (worst, tolerance)


def _presents(sess_path, batch):
    s = ort.InferenceSession(str(sess_path))
    names = [o.name for o in s.get_outputs()]
    return dict(zip(names, s.run(None, batch)))


@pytest.mark.parametrize("arch", [pytest.param("llama"), pytest.param("gpt2", marks=SLOW)])
def test_merged_decoder_trains_and_serves_both_branches(optimum_models, arch, tmp_path):
    """LoRA reaches into both branches of the If (one adapter pair per weight, a branch at each site); training
    feeds use_cache_branch=False; it trains as the with-past file does (same losses); the merged export and the
    adapters-as-inputs export give the with-past file's adapted logits on both branches."""
    merged, past = optimum_models.get(arch, "merged"), optimum_models.get(arch, "past")
    ids = _ids()
    l_merged, a_merged, s_merged = _train(str(merged), arch, feeds(merged, ids), 3)
    l_past, a_past, s_past = _train(str(past), arch, feeds(past, ids), 3)
    assert np.allclose(l_merged, l_past, rtol=1e-5)
    assert all(np.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(a_merged, a_past))
    s_merged.export_inference(tmp_path / "merged.onnx")
    s_merged.export_inference(tmp_path / "merged_inputs.onnx", adapters="inputs")
    s_past.export_inference(tmp_path / "past.onnx")
    record = lora_record(s_merged.model)
    assert all(len(layer["also"]) == 1 for layer in record["layers"])  # a site in each branch

    first = feeds(past, ids)
    ref = _presents(tmp_path / "past.onnx", first)
    got = _presents(tmp_path / "merged.onnx", {**first, "use_cache_branch": np.array([False])})
    assert np.allclose(got["logits"], ref["logits"], atol=1e-4)
    # one more token with the cache, on the with-cache branch
    nxt = np.random.default_rng(1).integers(3, 1000, (4, 1))
    step = {"input_ids": nxt, "attention_mask": np.ones((4, 13), np.int64), "position_ids": np.full((4, 1), 12)}
    step.update({k.replace("present", "past_key_values"): v for k, v in ref.items() if k.startswith("present")})
    ref2 = _presents(tmp_path / "past.onnx", step)
    got2 = _presents(tmp_path / "merged.onnx", {**step, "use_cache_branch": np.array([True])})
    assert np.allclose(got2["logits"], ref2["logits"], atol=1e-4)
    trained = {layer[k]: s_merged.get_state(layer[k]) for layer in record["layers"] for k in ("lora_A", "lora_B")}
    inputs = _presents(tmp_path / "merged_inputs.onnx", {**step, "use_cache_branch": np.array([True]), **trained})
    assert np.allclose(inputs["logits"], ref2["logits"], atol=1e-4)


def _float_layers(model: onnx.ModelProto, outputs: set[str]) -> onnx.ModelProto:
    """``model`` with the dynamic int8 products that write ``outputs`` computed as a float MatMul of their
    dequantized weight (the others stay int8)."""
    from onnx import helper, numpy_helper

    from onnx_autodiff.training.lora.quantized import dequantize_int8, dynamic_product

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    producers = {o: n for n in g.node for o in n.output}
    replaced = {}
    for n in g.node:
        product = dynamic_product(n, inits, producers) if n.output[0] in outputs else None
        if product is None:
            continue
        w = dequantize_int8(product, lambda name: numpy_helper.to_array(inits[name]))
        g.initializer.append(numpy_helper.from_array(w, f"{n.name}/float"))
        replaced[n.name] = helper.make_node("MatMul", [product["quantize"].input[0], f"{n.name}/float"],
                                            [n.output[0]], name=f"{n.name}/float")
    nodes = [replaced.get(n.name, n) for n in g.node]
    del g.node[:]
    g.node.extend(nodes)
    return model


@pytest.mark.parametrize("arch", [pytest.param("llama"), pytest.param("gpt2", marks=SLOW)])
def test_int8_adapters_merge_into_a_float_layer(optimum_models, arch, tmp_path):
    """The merged export turns each adapted int8 product into a float MatMul of dequant(W) + delta (the others stay
    int8): the adapted model (adapters as inputs) with those layers in float gives its logits (float32 rounding of
    x (W + BA) against x W + (x A^T) B^T: 1e-4). The products left int8 are compared in float on both sides: their
    DynamicQuantizeLinear rounds each activation to one of 256 levels, so that float32 rounding upstream moves an
    element across a level now and then (one element of 48 x 64 at GPT-2's first such layer, then, the per-tensor
    scale moving with it, thousands downstream: 1.3% of the logits) and the logits would compare the levels, not the
    merge."""
    path = optimum_models.get(arch, "int8")
    batch = feeds(path, _ids())
    _, _, sess = _train(str(path), arch, batch, 3)
    sess.export_inference(tmp_path / "merged.onnx")
    sess.export_inference(tmp_path / "inputs.onnx", adapters="inputs")
    record = lora_record(sess.model)
    merged = onnx.load(str(tmp_path / "merged.onnx"))
    products = sum(n.op_type == "MatMulInteger" for n in onnx.load(str(path)).graph.node)
    assert sum(n.op_type == "MatMulInteger" for n in merged.graph.node) == products - len(record["layers"])
    trained = {layer[k]: sess.get_state(layer[k]) for layer in record["layers"] for k in ("lora_A", "lora_B")}
    def in_float(model):  # every dynamic int8 product of the model as a float MatMul of its dequantized weight
        return _float_layers(model, {o for n in model.graph.node for o in n.output})

    a = ort.InferenceSession(in_float(merged).SerializeToString()).run(["logits"], batch)[0]
    expected = in_float(onnx.load(str(tmp_path / "inputs.onnx")))
    b = ort.InferenceSession(expected.SerializeToString()).run(["logits"], {**batch, **trained})[0]
    assert np.abs(a - b).max() < 1e-4 * np.abs(b).max()


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padded_batch_matches_transformers_and_peft(optimum_models, arch, tmp_path):
    """float64: the sdpa export (Where(IsNaN) around a Softmax that fully masked rows make NaN), LoRA on the
    attention, a left-padded batch (two rows padded, one not), position ids from the mask as transformers derives
    them: the loss and every adapter gradient equal transformers + PEFT's with labels -100 at the padding (1e-5;
    transformers computes the loss from float32 logits, which leaves ~1e-7)."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from onnx_autodiff.driver.session import gradient_names
    from onnx_autodiff.training.lora.adapters import peft_names
    from tests.optimum_models import torch_export

    hf = AutoModelForCausalLM.from_pretrained(optimum_models.hf(arch), attn_implementation="sdpa").eval()
    hf = hf.to(torch.float64)
    path = torch_export(arch, hf, tmp_path / "model.onnx", past_in=False, present_out=False, dtype=torch.float64)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=ATTENTION[arch],
                             fan_in_fan_out=arch == "gpt2")
    adapted = peft.get_peft_model(hf, config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)
    training = make_training_model(str(path), LOSS, "sgd", lr=0.0,
                                   lora={"rank": 4, "alpha": 8, "targets": ATTENTION[arch]})
    sess = TrainingSession(training, progress=False)
    names = peft_names(lora_record(training), adapter="default")
    params = dict(adapted.named_parameters())
    for ours, theirs in names.items():
        sess.state[ours] = params[theirs].detach().numpy()
    ids = _ids(0, (3, 8))
    mask = np.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :5] = 0
    positions = np.where(mask == 0, 1, np.cumsum(mask, 1) - 1)
    values = sess.gradients({"input_ids": ids, "attention_mask": mask, "position_ids": positions})
    adapted.zero_grad()
    out = adapted(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                  position_ids=torch.tensor(positions), labels=torch.tensor(np.where(mask == 0, -100, ids)))
    out.loss.backward()
    assert abs(float(values[sess.loss_name].numpy()) - out.loss.item()) < 1e-5 * out.loss.item()
    grads = gradient_names(training, 0)
    for param, grad in zip(grads["parameters"], grads["gradients"]):
        ours, theirs = values[grad].numpy(), params[names[param]].grad.numpy()
        assert np.all(np.isfinite(ours)) and np.abs(theirs).max() > 0
        assert np.abs(ours - theirs).max() < 1e-5 * np.abs(theirs).max(), param
