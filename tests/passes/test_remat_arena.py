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


def test_the_plan_is_made_on_the_graph_the_session_runs(monkeypatch):
    """No pass after the plan rewrites the algorithm it planned (issue 38): the loss split ran after it once,
    and the shape inference that split made over the recomputation's copies left 430 MB of heap behind in a
    4-layer BERT's session, which the budgeted step's peak then included."""
    from onnx_autodiff.passes import remat
    planned = []
    rewrite = remat.rewrite

    def recording(*args, **kwargs):
        nodes, inits = rewrite(*args, **kwargs)
        planned.append([(n.op_type, tuple(n.output)) for n in nodes])
        return nodes, inits

    monkeypatch.setattr(remat, "rewrite", recording)
    model, loss, feeds, dims = _encoder_layer()
    sess = TrainingSession(make_training_model(model, loss, memory_budget=MemoryBudget(1, dims)), progress=False)
    algorithm = [(n.op_type, tuple(n.output)) for n in sess.model.training_info[0].algorithm.node]
    assert planned[-1] == algorithm  # the chosen plan, rewritten last, is the algorithm as it runs
    assert any(n.op_type == "LogSoftmax" for n in sess.model.training_info[0].algorithm.node)  # split before


def test_the_estimate_counts_what_a_session_holds():
    """The plan's estimate is what the step's session holds: each state tensor once (an update is written in
    place), the gradients in buffers of their own, the process itself: on a step whose activations are a
    small part (two 512 x 512 layers, batch 4), it is the state, the gradients and the process."""
    import torch

    from onnx_autodiff.model import metadata
    from onnx_autodiff.passes.pipeline import lower
    from onnx_autodiff.passes.remat import process_bytes, remat_summary
    from onnx_autodiff.passes.remat_plan import peak_bytes, step_graph
    from tests.torch_export import export

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512)).eval()
    model = export(net, (torch.randn(4, 512),), ["x"], ("logits",))
    training = make_training_model(model, "cross_entropy", "adam", memory_budget=MemoryBudget(10**12))
    low = lower(training)
    settings = metadata.read_json(low, metadata.MEMORY_BUDGET)
    alg = low.training_info[0].algorithm
    step = step_graph(low, alg, settings["loss"], settings["dims"], settings["gradients"])
    params = 2 * (512 * 512 + 512) * 4
    assert len(step.held) == 4 and sum(step.nbytes(g) for g in step.held) == params
    estimate = peak_bytes(step, list(step.nodes), {o.name for o in alg.output})
    # parameters, two moments, gradients; then Adam's temporaries for one 512 x 512 weight, activations ~32 KB
    assert 4 * params <= estimate <= 4 * params + 4 * 512 * 512 * 4 + 2**17
    assert process_bytes() > 0 and "held before the step" in remat_summary(low)
