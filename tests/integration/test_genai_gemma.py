"""Builder Gemma2 and Gemma3 (int4 and fp32, ``--extra_options windowed_kv_cache=false``) train: their
GroupQueryAttention nodes carry softcap (Gemma2's 50.0) and local_window_size (the sliding-window layers), which the
gradient now models (before: "the GroupQueryAttention gradient handles softcap=0.0 only" / "local_window_size=-1
only"). Sequences of 16 tokens over a window of 4.

Not yet: the builder's default (0.18, ``-e cpu``) gives the local layers ``sliding_window_cache=1``, a KV cache of
the window's size, which onnxruntime refuses to run over an empty past ("KV cache capacity (0) must be at least
local_window_size"); the gradient refuses it by name (``sliding_window_cache=1``)."""
import numpy as np
import onnx
import pytest

from onnx_autodiff import LossSpec, TrainingSession, make_training_model
from tests.genai_models import GEMMA_FAMILIES, gemma_build

pytest.importorskip("onnxruntime_genai")


@pytest.fixture(scope="module")
def gemma_root(tmp_path_factory):
    return tmp_path_factory.mktemp("gemma")


@pytest.mark.parametrize("precision", ["int4", "fp32"])
@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_lora_trains_with_softcap_and_local_windows(gemma_root, family, precision):
    path = gemma_build(family, precision, gemma_root, windowed_kv_cache="false")
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
             for n in onnx.load(str(path), load_external_data=False).graph.node if n.op_type == "GroupQueryAttention"]
    assert any(a.get("local_window_size", -1) == 4 for a in attrs)  # the cases the gradient refused
    softcap = 50.0 if family == "gemma2" else 0.0
    assert all(a.get("softcap", 0.0) == softcap and not a.get("sliding_window_cache", 0) for a in attrs)
    training = make_training_model(str(path), LossSpec("causal_lm", options={"mask": "attention_mask"}), "adamw",
                                   lr=1e-2, lora={"rank": 4, "alpha": 8, "targets": ["all"]})
    sess = TrainingSession(training, outputs=["loss"], progress=False)
    ids = np.random.default_rng(0).integers(3, 1000, (4, 16))
    losses = [float(sess.step({"input_ids": ids, "attention_mask": np.ones_like(ids)})["loss"]) for _ in range(5)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.05, losses

