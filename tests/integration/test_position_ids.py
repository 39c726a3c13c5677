"""With-past decoders (Optimum's / transformers.js's ``model.onnx``) that take ``position_ids`` train from token data
only: the driver makes the positions transformers makes for a prompt from the mask (driver/kv_cache.py), so a
left-padded row computes its tokens' logits as the unpadded row does."""
from __future__ import annotations

import numpy as np
import pytest

from onnx_autodiff import LossSpec, TrainingSession, make_training_model
from onnx_autodiff.driver.kv_cache import PositionInput
from tests.optimum_models import ATTENTION, feeds

pytest.importorskip("transformers")
LOSS = LossSpec("causal_lm", options={"mask": "attention_mask"})


def test_positions_are_transformers_positions_of_a_prompt():
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 0, 1]])
    made = PositionInput("position_ids", np.dtype(np.int64)).empty({"input_ids": mask, "attention_mask": mask})
    want = np.where(mask == 0, 1, np.cumsum(mask, 1) - 1)  # transformers' generate() for a prompt
    assert made.dtype == np.int64 and (made == want).all()
    assert (made[0, 2:] == [0, 1, 2]).all()
    plain = PositionInput("position_ids", np.dtype(np.int64)).empty({"input_ids": mask})
    assert (plain == np.arange(5)).all()


@pytest.mark.parametrize("arch", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_token_data_is_enough_and_left_padding_keeps_the_logits(optimum_models, arch):
    """llama: rotary positions (Qwen2/Qwen3, Mistral and Phi-3's with-past files have the same inputs); gpt2:
    learned absolute positions, where a left-padded row run at positions 0..S-1 would score differently. The
    padded row's logits at its tokens are the unpadded row's (a loss would differ by the first token, which the
    padding before it predicts)."""
    model = optimum_models.get(arch, "past")
    training = make_training_model(str(model), LOSS, "sgd", lr=0.0,
                                   lora={"rank": 4, "alpha": 8, "targets": ATTENTION[arch]})
    sess = TrainingSession(training, outputs=["loss", "logits"], progress=False)
    assert "position_ids" not in sess.feed_names
    ids = np.random.default_rng(0).integers(3, 1000, (1, 8))
    ones = np.ones_like(ids)
    unpadded = sess.step({"input_ids": ids, "attention_mask": ones})
    given = sess.step(feeds(model, ids))  # position_ids fed by hand, as before
    assert abs(float(unpadded["loss"]) - float(given["loss"])) < 1e-6 * float(given["loss"])
    pad = np.zeros((1, 4), ids.dtype)
    padded_feeds = {"input_ids": np.concatenate([pad, ids], 1), "attention_mask": np.concatenate([pad, ones], 1)}
    padded = sess.step(padded_feeds)["logits"][:, 4:]
    scale = np.abs(unpadded["logits"]).max()
    assert np.abs(padded - unpadded["logits"]).max() < 1e-4 * scale
    if arch == "gpt2":  # the positions matter: 0..S-1 over the padding gives other logits
        shifted = sess.step({**padded_feeds, "position_ids": np.arange(12)[None]})["logits"][:, 4:]
        assert np.abs(shifted - unpadded["logits"]).max() > 1e-2 * scale
