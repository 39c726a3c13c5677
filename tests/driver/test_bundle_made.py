"""A decoder's bundle trains from bundle.json alone: its ``made`` says how to make the empty KV cache and the
positions, which BundleTrainer needed the training model for (and web/train.js could not make at all)."""
from __future__ import annotations

import json

import numpy as np

from onnx_autodiff import TrainingSession, make_training_model
from onnx_autodiff.driver.bundle import export_step
from onnx_autodiff.runtimes.loop import BundleTrainer
from tests.decoder_models import DIM, token_batch, with_past_decoder


def test_bundle_json_alone_makes_the_cache_and_the_positions(tmp_path):
    training = make_training_model(with_past_decoder(), "causal_lm", "adam", lr=0.05)
    export_step(training, tmp_path / "bundle", target="portable")
    made = json.loads((tmp_path / "bundle" / "bundle.json").read_text())["made"]
    assert made["caches"] == [{"name": "past_key_values.0.key", "dtype": "float32", "window_node": "",
                               "dims": [["input_ids", 0], 1, 0, DIM]}]
    assert made["positions"]["name"] == "position_ids" and made["switches"] == []
    batch = token_batch()
    session = TrainingSession(training, outputs=["loss"], progress=False)
    want = [float(session.step(batch)["loss"]) for _ in range(3)]
    alone = BundleTrainer(tmp_path / "bundle", "onnxruntime")  # no training model given
    assert alone.feed_names == ["input_ids", "attention_mask"]
    np.testing.assert_allclose([alone.step(batch) for _ in range(3)], want, rtol=1e-5)
    # the positions matter: counted from 0 on every row (the padded row's too) the loss is another
    plain = BundleTrainer(tmp_path / "bundle", "onnxruntime")
    arange = {**batch, "position_ids": np.tile(np.arange(6), (3, 1))}
    assert abs(plain.step(arange) - want[0]) > 1e-4
