"""The classifier files Optimum exports (tests/optimum_models.py: a tiny random BERT text classifier and ViT image
classifier, GELU through Erf, symbolic dims): LoRA on the attention and the classification head trains with
cross-entropy, the labels the only feed beside the model's own inputs. ``check`` on the same files:
tests/check/test_float64_reference.py (BERT) and tests/check/test_check_dims.py (ViT)."""
from __future__ import annotations

import numpy as np
import pytest

from onnx_autodiff import TrainingSession, make_training_model

pytest.importorskip("transformers")


def _bert(tmp_path, rng):
    from tests.optimum_models import bert_classifier

    ids = rng.integers(3, 1000, (8, 12))
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    return bert_classifier(tmp_path / "bert" / "model.onnx"), feeds, ["query", "value", "classifier"], 3


def _vit(tmp_path, rng):
    from tests.optimum_models import vit_classifier

    feeds = {"pixel_values": rng.standard_normal((8, 3, 16, 16)).astype(np.float32)}
    return vit_classifier(tmp_path / "vit" / "model.onnx"), feeds, ["q_proj", "v_proj", "classifier"], 5


@pytest.mark.parametrize("make", [_bert, _vit], ids=["bert", "vit"])
def test_lora_trains_a_classifier(tmp_path, make):
    rng = np.random.default_rng(0)
    path, feeds, targets, labels = make(tmp_path, rng)
    sess = TrainingSession(make_training_model(str(path), "cross_entropy", "adamw", lr=1e-2,
                                               lora={"rank": 4, "targets": targets}), progress=False)
    assert sorted(sess.feed_names) == sorted([*feeds, "labels"])
    feeds["labels"] = rng.integers(0, labels, 8)
    losses = [float(sess.step(feeds)["loss"]) for _ in range(6)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.02, losses
