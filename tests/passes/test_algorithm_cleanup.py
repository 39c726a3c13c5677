"""The algorithm's second clean-up (``passes/training.py``) is skipped only where it would change nothing: the
lowered model is the one the clean-up gives, and a user node the backward could merge into still gets it."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import onnx_autodiff.passes.training as training
from benchmarks.run import chain_model
from benchmarks.training_model import make_training_model
from onnx_autodiff import lower


def _digest(model: onnx.ModelProto) -> bytes:
    return model.SerializeToString(deterministic=True)


def _lower_both(model, monkeypatch):
    """(lowered as it is, lowered with the clean-up always run, how many times the clean-up ran as it is)."""
    calls = []
    real = training.cleanup
    monkeypatch.setattr(training, "cleanup", lambda *a, **k: calls.append(1) or real(*a, **k))
    fast = lower(model)
    ran = len(calls)
    monkeypatch.setattr(training, "_already_clean", lambda alg, names, ctx: False)
    return fast, lower(model), ran


def test_sgd_chain_skips_the_cleanup_and_lowers_the_same(monkeypatch):
    model = make_training_model(chain_model(31), "logits", "sgd", 0.01)
    fast, full, ran = _lower_both(model, monkeypatch)
    assert ran == 0
    assert _digest(fast) == _digest(full)


def test_adam_runs_the_cleanup(monkeypatch):
    model = make_training_model(chain_model(31), "logits", "adam", 0.01)
    fast, full, ran = _lower_both(model, monkeypatch)
    assert ran == 1
    assert _digest(fast) == _digest(full)


@pytest.mark.parametrize("where", [0, 1])
def test_a_user_node_with_the_seed_key_still_takes_the_merge(monkeypatch, where):
    """A Constant 1.0 in the algorithm before the Gradient node has the key of the backward's seed: the
    clean-up merges the seed into it, so the skip must not apply."""
    model = make_training_model(chain_model(31), "logits", "sgd", 0.01)
    alg = model.training_info[0].algorithm
    one = helper.make_node("Constant", [], ["user_one"], name="user_one",
                           value=numpy_helper.from_array(np.array(1.0, np.float32)))
    nodes = list(alg.node)
    nodes.insert(where, one)
    del alg.node[:]
    alg.node.extend(nodes)
    fast, full, ran = _lower_both(model, monkeypatch)
    assert ran == 1
    assert _digest(fast) == _digest(full)
    seeds = [n for n in fast.training_info[0].algorithm.node if n.op_type == "Constant" and "/seed/" in n.name]
    assert seeds == []  # merged into user_one
