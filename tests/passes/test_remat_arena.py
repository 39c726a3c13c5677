"""What a budgeted step needs from the session that runs it: the recomputation reaches onnxruntime in the
planned order, and the arena it grows again after every run grows by what is asked (docs/benchmarks.md,
"Rematerialization: the arena")."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from onnx_autodiff import TrainingSession
from onnx_autodiff.driver import runs
from onnx_autodiff.training import MemoryBudget, make_training_model

pytest.importorskip("networkx")


def _encoder_layer():
    from tests.cli_models import transformer_block
    model = transformer_block(d_model=32, heads=2, seq=16)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((8, 16, 32)).astype(np.float32), "labels": rng.integers(0, 5, 8)}
    return model, "cross_entropy", feeds, {"N": 8}


def test_the_step_runs_the_recomputation_in_the_planned_order():
    model, loss, feeds, dims = _encoder_layer()
    sess = TrainingSession(make_training_model(model, loss, memory_budget=MemoryBudget(1, dims)), progress=False)
    planned = [n.name for n in list(sess.model.graph.node) + list(sess.model.training_info[0].algorithm.node)]
    ran = [n.name for n in sess.step_model.graph.node]
    copies = [n for n in planned if n.endswith("/remat") or "/remat_" in n]
    assert copies, "the smallest budget recomputes something"
    position = {n: k for k, n in enumerate(ran)}
    assert all(c in position for c in copies), "a recomputed node is missing from the step the session runs"
    assert [position[c] for c in copies] == sorted(position[c] for c in copies)
    # each copy still runs after the forward it copies and before the backward node that reads it
    readers = {x: k for k, n in reversed(list(enumerate(sess.step_model.graph.node))) for x in n.input}
    for k, n in enumerate(sess.step_model.graph.node):
        if n.name in copies:
            assert all(readers.get(o, len(ran)) > k for o in n.output if o)
    assert np.isfinite(float(sess.step(feeds)[sess.loss_name]))


def test_a_budgeted_step_grows_its_arena_by_what_is_asked(monkeypatch):
    """A budgeted step gives the arena's free chunks back after every run and grows it again; onnxruntime's
    default growth doubles each new region, and past the live bytes the last region overshot by up to its
    own size (4-layer BERT 64 x 64, budget 1: 0.94x the plain step's peak RSS, 0.87x growing by the
    request). A step without a budget keeps its chunks and onnxruntime's default growth."""
    made = []
    register = ort.create_and_register_allocator

    def recording(info, cfg):
        made.append(cfg)
        return register(info, cfg)

    monkeypatch.setattr(runs.ort, "create_and_register_allocator", recording)
    model, loss, feeds, dims = _encoder_layer()
    for budget, strategy in ((None, -1), (1, 1)):  # -1: onnxruntime's default (doubling); 1: kSameAsRequested
        monkeypatch.setattr(runs, "_arena_registered", False)  # as in a fresh process
        sess = TrainingSession(make_training_model(model, loss, memory_budget=MemoryBudget(budget, dims)),
                               progress=False)
        assert made.pop().arena_extend_strategy == strategy and not made
        assert np.isfinite(float(sess.step(feeds)[sess.loss_name]))
    assert sess._run_options.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"
