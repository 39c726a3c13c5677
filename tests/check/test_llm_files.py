"""What ``check`` feeds the language-model files people hold, and its float reference of their quantized ops
(onnx_autodiff/check/llm_files.py)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_autodiff.check.llm_files import check_feeds, dequantized, dim_size, feed_sets, has_quantized_ops

pytest.importorskip("transformers")


def test_dims_by_name_and_by_sum():
    assert dim_size("batch_size") == 2 and dim_size("sequence_length") == 3 and dim_size("past_sequence_length") == 2
    assert dim_size("past_sequence_length + sequence_length") == 5
    assert dim_size("total_sequence_length") == 5 and dim_size("past_sequence_length + 1", past=0) == 1


def test_with_past_feeds_satisfy_the_sums(optimum_models):
    model = onnx.load(str(optimum_models.get("llama", "past")))
    feeds = check_feeds(model)
    assert feeds["past_key_values.0.key"].shape == (2, 2, 2, 16)
    assert feeds["attention_mask"].shape == (2, 5) and feeds["attention_mask"].all()  # no fully masked row
    assert feeds["position_ids"].tolist() == [[2, 3, 4]] * 2  # after the past
    assert 2 < feeds["input_ids"].max() < 1000  # the vocabulary, not {0, 1}
    ort.InferenceSession(model.SerializeToString()).run(None, feeds)  # the model takes them


def test_padding_masks_rows_when_asked(optimum_models):
    model = onnx.load(str(optimum_models.get("gpt2", "plain")))
    left = check_feeds(model, padding="left")
    assert left["attention_mask"][0].tolist() == [0, 1, 1] and left["position_ids"][0].tolist() == [1, 0, 1]
    assert check_feeds(model, padding="right")["attention_mask"][0].tolist() == [1, 1, 0]


def test_a_merged_decoder_is_fed_on_both_branches(optimum_models):
    model = onnx.load(str(optimum_models.get("gpt2", "merged")))
    sets = dict(feed_sets(model))
    cached, fresh = sets["use_cache_branch=True"], sets["use_cache_branch=False"]
    assert cached["past_key_values.0.key"].shape[2] == 2 and cached["attention_mask"].shape[1] == 5
    assert fresh["past_key_values.0.key"].shape[2] == 0 and fresh["attention_mask"].shape[1] == 3
    sess = ort.InferenceSession(model.SerializeToString())
    for feeds in (cached, fresh):
        assert sess.run(["logits"], feeds)[0].shape == (2, 3, 1000)


@pytest.mark.parametrize("form", ["int8", "q4"])
def test_the_float_reference_computes_the_dequantized_model(optimum_models, form):
    """No quantized op is left; the outputs are the quantized model's within its own rounding (q4: the weights are
    the same values, so float32 rounding; int8: the activations are not rounded to 8 bits any more)."""
    model = onnx.load(str(optimum_models.get("llama", form)))
    assert has_quantized_ops(model)
    reference = dequantized(model)
    assert not has_quantized_ops(reference) and not any(n.op_type == "MatMulInteger" for n in reference.graph.node)
    feeds = check_feeds(model)
    a = ort.InferenceSession(model.SerializeToString()).run(["logits"], feeds)[0]
    b = ort.InferenceSession(reference.SerializeToString()).run(["logits"], feeds)[0]
    gap = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert gap < (1e-5 if form == "q4" else 0.1), gap
