"""Builder Gemma2 and Gemma3 (onnxruntime-genai 0.18's model builder, ``-e cpu``, int4 and fp32) train, check and
serve, with the builder's default options and with ``--extra_options windowed_kv_cache=false``. Sequences of 16
tokens over a window of 4.

Their GroupQueryAttention nodes carry softcap (Gemma2's 50.0) and local_window_size (the sliding-window layers),
which the gradient models (before: "the GroupQueryAttention gradient handles softcap=0.0 only" / "local_window_size=-1
only"). The builder's default gives the local layers ``sliding_window_cache=1``, a KV cache of the window's size:
before, the gradient refused it ("handles sliding_window_cache=0 only") and onnxruntime refused the driver's empty
past ("KV cache capacity (0) must be at least local_window_size"). Now the driver feeds that past at the window's
capacity with none of its rows valid, where the op's output is the local-window attention; the losses equal the
full-length cache's to the last digit. onnxruntime runs it on whole rows only: a padded batch is our DataError
naming the node. ``onnx-autodiff check`` exits 0 on every one; the fine-tune of the default build serves (the merged
export decodes token by token as it reads whole prompts, and onnxruntime-genai with the exported adapter gives the
merged export's logits)."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_autodiff import LossSpec, TrainingSession, make_training_model
from onnx_autodiff.cli import main
from onnx_autodiff.errors import DataError
from tests.genai_models import GEMMA_FAMILIES, gemma_build

pytest.importorskip("onnxruntime_genai")

WINDOW = 4
CACHES = {"default": {}, "full-cache": {"windowed_kv_cache": "false"}}


@pytest.fixture(scope="module")
def gemma_root(tmp_path_factory):
    return tmp_path_factory.mktemp("gemma")


def _attention(path) -> list[dict]:
    return [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            for n in onnx.load(str(path), load_external_data=False).graph.node if n.op_type == "GroupQueryAttention"]


def _session(path) -> TrainingSession:
    training = make_training_model(str(path), LossSpec("causal_lm", options={"mask": "attention_mask"}), "adamw",
                                   lr=1e-2, lora={"rank": 4, "alpha": 8, "targets": ["all"]})
    return TrainingSession(training, outputs=["loss"], progress=False)


def _tokens():
    ids = np.random.default_rng(0).integers(3, 1000, (4, 16))
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("precision", ["int4", "fp32"])
@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_lora_trains_with_softcap_and_local_windows(gemma_root, family, precision, cache):
    path = gemma_build(family, precision, gemma_root, **CACHES[cache])
    attrs = _attention(path)
    local = [a for a in attrs if a.get("local_window_size", -1) == WINDOW]
    assert local and len(local) < len(attrs)  # local and global layers: the cases the gradient refused
    softcap = 50.0 if family == "gemma2" else 0.0
    assert all(a.get("softcap", 0.0) == softcap for a in attrs)
    assert all(a.get("sliding_window_cache", 0) == (cache == "default") for a in local)
    sess = _session(path)
    losses = [float(sess.step(_tokens())["loss"]) for _ in range(5)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.05, losses
    if cache == "default":
        padded = _tokens()
        padded["attention_mask"][1, 12:] = 0
        with pytest.raises(DataError, match=r"row\(s\) \[1\]: node '/model/layers.0/attn/GroupQueryAttention' keeps "
                                            r"a window-sized KV cache \(sliding_window_cache=1\)") as e:
            sess.step(padded)
        assert "windowed_kv_cache=false" in e.value.hint and sess.steps == 5


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("precision", ["int4", "fp32"])
@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_check_passes(gemma_root, family, precision, cache, capsys):
    """onnx-autodiff check on the builder's file: float64 through the standard forms (the windowed cache's too),
    the window-sized past at its capacity."""
    assert main(["check", str(gemma_build(family, precision, gemma_root, **CACHES[cache]))]) == 0
    out = capsys.readouterr().out
    assert "ok:" in out and "nan" not in out


def test_check_target_onnxruntime_passes_on_the_window_sized_cache(gemma_root, capsys):
    """check --target onnxruntime on Gemma2's default build (a window-sized KV cache on its local layers): the
    probe's batch is the driver's, the window-sized past at its capacity (before: "Input 'past_key' dimension 3
    should match the packed KV head dimension, got 2 expected 16"), for the file and its training model; the
    window-sized presents are left out of the comparison, said so."""
    from onnx_autodiff.check.input_dims import probe_feeds
    from onnx_autodiff.runtimes.check import check_target

    path = gemma_build("gemma2", "int4", gemma_root)
    pasts = {k: v.shape for k, v in probe_feeds(onnx.load(str(path), load_external_data=False)).items()
             if k.startswith("past_key_values.")}
    assert sorted({s[2] for s in pasts.values()}) == [0, WINDOW] and {s[3] for s in pasts.values()} == {16}, pasts
    assert main(["check", str(path), "--target", "onnxruntime"]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("ok: the model runs on onnxruntime")
    # the rows of a window-sized present the op does not write hold stale memory (two runs differed by 8e35)
    assert "not compared: present.0.key, present.0.value (a window-sized KV cache's buffer" in out
    training = make_training_model(str(path), LossSpec("causal_lm", options={"mask": "attention_mask"}), "adamw",
                                   lr=1e-2, lora={"rank": 4, "alpha": 8, "targets": ["all"]})
    result = check_target(training, "onnxruntime")
    assert result.ok and result.lines[-1] == "ok: the model trains on onnxruntime", result.lines


@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_the_default_builds_fine_tune_serves(gemma_root, tmp_path, family, capsys):
    from tests.integration.test_genai_serving import PROMPT, generate

    path = gemma_build(family, "fp32", gemma_root)
    sess = _session(path)
    for _ in range(5):
        sess.step(_tokens())
    sess.save(tmp_path / "checkpoint.onnx")
    sess.export_inference(tmp_path / "merged.onnx")
    merged = ort.InferenceSession(str(tmp_path / "merged.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in merged.get_outputs()]

    def run(tokens, past=None, before=0):
        feeds = {"input_ids": np.array([tokens]), "attention_mask": np.ones((1, before + len(tokens)), np.int64)}
        for i in merged.get_inputs():
            if i.name.startswith("past_key_values."):  # a fresh window-sized cache: its capacity, no row valid
                empty = np.zeros((1, 2, WINDOW if "sliding" in i.shape[2] else 0, 16), np.float32)
                feeds[i.name] = empty if past is None else past["present." + i.name[len("past_key_values."):]]
        return dict(zip(names, merged.run(None, feeds)))

    whole = run(PROMPT)["logits"]
    out, steps = run(PROMPT[:3]), []  # then one token at a time: the window-sized cache evicts
    steps.append(out["logits"])
    for k, token in enumerate(PROMPT[3:]):
        out = run([token], out, 3 + k)
        steps.append(out["logits"])
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, atol=1e-4)

    ready = tmp_path / "ready"
    assert main(["export-adapter", str(tmp_path / "checkpoint.onnx"), str(ready), "--format", "genai",
                 "--genai-folder", str(path.parent)]) == 0
    _, tuned = generate(ready, str(ready / "adapter.onnx_adapter"))
    _, original = generate(path.parent)
    assert np.abs(tuned - whole).max() <= 1e-4
    assert np.abs(original - whole).max() > 1e-2  # the fine-tune changed the logits
