"""Rematerialization under a memory budget (onnx_autodiff/passes/remat.py): gradients as the plain step's,
a valid model, no matrix product or random op run twice, Dropout masks kept, clear errors."""
from __future__ import annotations

import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from onnx_autodiff import TrainingSession
from onnx_autodiff.driver.session import gradient_names
from onnx_autodiff.driver.step_model import build_step_model
from onnx_autodiff.errors import MemoryBudgetError
from onnx_autodiff.model.weights import check_model
from onnx_autodiff.passes.pipeline import lower
from onnx_autodiff.passes.remat import parse_size, remat_summary
from onnx_autodiff.training import LossSpec, MemoryBudget, make_training_model

torch = pytest.importorskip("torch")
pytest.importorskip("networkx")
NEVER = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "Attention", "Dropout", "RandomNormal",
         "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial"}


def _mlp():
    from tests.torch_export import export
    torch.manual_seed(0)
    nn = torch.nn
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.Tanh(),
                      nn.Linear(64, 10)).eval()
    model = export(m, (torch.randn(256, 32),), ["x"], ("logits",))
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((256, 32)).astype(np.float32), "labels": rng.integers(0, 10, 256)}
    return model, "cross_entropy", feeds, None


def _encoder_layer():
    from tests.cli_models import transformer_block
    model = transformer_block(d_model=32, heads=2, seq=16)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((8, 16, 32)).astype(np.float32), "labels": rng.integers(0, 5, 8)}
    return model, "cross_entropy", feeds, {"N": 8}


def _tiny_bert():
    pytest.importorskip("transformers")
    from tests.hf_models import build, export
    module, _ = build("bert")
    torch.manual_seed(2)  # activations large enough next to the weights for a budget to matter
    inputs = {"input_ids": torch.randint(1, 64, (16, 16)), "attention_mask": torch.ones(16, 16, dtype=torch.int64)}
    model = export(module, inputs, "ts17")
    feeds = {k: v.numpy() for k, v in inputs.items()}
    feeds["labels"] = np.random.default_rng(2).standard_normal((16, 16, 16)).astype(np.float32)
    return model, "mse", feeds, None


MODELS = {"mlp": _mlp, "encoder_layer": _encoder_layer, "tiny_bert": _tiny_bert}


def _gradients(training_model, feeds, optimized: bool) -> tuple[dict, onnx.ModelProto]:
    low = lower(training_model)
    names = gradient_names(training_model, 0)["gradients"]
    step = build_step_model(low)
    step.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not optimized:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(step.SerializeToString(), so, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in sess.get_inputs()}
    return dict(zip(names, sess.run(names, {k: v for k, v in feeds.items() if k in wanted}))), low


def _recomputed(low: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in low.training_info[0].algorithm.node if "/remat" in n.name]


@pytest.mark.parametrize("name", list(MODELS))
def test_fuzzed_budgets_keep_the_gradients(name):
    model, loss, feeds, dims = MODELS[name]()
    plain = make_training_model(model, loss)
    ref, low_plain = _gradients(plain, feeds, optimized=False)
    ref_opt, _ = _gradients(plain, feeds, optimized=True)
    scale = max(float(np.abs(g).max()) for g in ref_opt.values())
    matmuls = sum(n.op_type in NEVER for n in low_plain.training_info[0].algorithm.node)
    budgets = sorted(int(b) for b in np.exp(np.random.default_rng(7).uniform(np.log(1e4), np.log(2e7), 3)))
    recomputed_any = False
    for budget in [1, *budgets]:
        tm = make_training_model(model, loss, memory_budget=MemoryBudget(budget, dims))
        got, low = _gradients(tm, feeds, optimized=False)
        for k in ref:  # the same kernels on the same inputs: bit for bit
            np.testing.assert_array_equal(got[k], ref[k], err_msg=f"{name}, budget {budget}, {k}")
        got_opt, _ = _gradients(tm, feeds, optimized=True)
        for k in ref:  # onnxruntime fuses the original and the copy differently: float rounding (at the scale of
            # the gradients: a gradient that is zero but for rounding, such as a bias before a LayerNorm, is noise)
            np.testing.assert_allclose(got_opt[k], ref_opt[k], rtol=1e-5, atol=1e-6 * scale, err_msg=k)
        copies = _recomputed(low)
        assert not [n for n in copies if n.op_type in NEVER], f"{name}: a matrix product or random op recomputed"
        assert sum(n.op_type in NEVER for n in low.training_info[0].algorithm.node) == matmuls
        recomputed_any |= bool(copies)
        onnx.checker.check_model(low, full_check=True)
        check_model(build_step_model(low))
        assert remat_summary(low).startswith("remat: recompute")
    assert recomputed_any, f"{name}: no budget made the backward recompute anything"


@pytest.mark.parametrize("name", list(MODELS))
def test_copies_wait_for_the_backward(name):
    """Runtimes order nodes by data alone: a copy that depended on constants and kept activations only could
    run in the forward and live as long as the original (no saving). Each must wait for the gradient chain,
    which starts from the model's outputs."""
    model, loss, _, dims = MODELS[name]()
    low = lower(make_training_model(model, loss, memory_budget=MemoryBudget(1, dims)))
    after = {o.name for o in low.graph.output}
    for n in [*low.graph.node, *low.training_info[0].algorithm.node]:
        if after & set(n.input):
            after.update(o for o in n.output if o)
    early = [n.name for n in _recomputed(low) if not after & set(n.output)]
    assert _recomputed(low) and not early, f"{name}: copies that can run before the backward: {early[:5]}"
    views = [n for n in low.training_info[0].algorithm.node if n.name.endswith("/tie_view/node")]
    assert all(after & set(n.output) for n in views), f"{name}: a tie that does not wait"


def test_the_smallest_budget_recomputes_cheap_nodes_and_says_so():
    model, loss, feeds, _ = _mlp()
    low = lower(make_training_model(model, loss, memory_budget=1))
    ops = {n.op_type for n in _recomputed(low)}
    assert {"Erf", "Div"} <= ops, ops
    line = remat_summary(low)
    assert "estimated peak" in line and "FLOPs" in line and "->" in line


def test_a_generous_budget_changes_nothing():
    model, loss, feeds, _ = _mlp()
    low_plain = lower(make_training_model(model, loss))
    low = lower(make_training_model(model, loss, memory_budget="1TiB"))
    assert not _recomputed(low)
    assert [n.op_type for n in low.training_info[0].algorithm.node] == \
        [n.op_type for n in low_plain.training_info[0].algorithm.node]
    assert remat_summary(low).startswith("remat: recompute nothing")


def test_dropout_masks_are_kept_not_recomputed():
    from tests.torch_export import export

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.1, activation="gelu",
                                                          batch_first=True)

        def forward(self, x):
            return self.layer(x).square().mean()

    torch.manual_seed(0)
    model = export(Layer(), (torch.randn(8, 16, 32),), ["x"], ("y",), training=torch.onnx.TrainingMode.TRAINING)
    assert any(n.op_type == "Dropout" for n in model.graph.node)
    tm = make_training_model(model, LossSpec("mse", outputs="y", label_shape=[]))
    low = lower(make_training_model(model, LossSpec("mse", outputs="y", label_shape=[]), memory_budget=1))
    copies = _recomputed(low)
    assert copies and not [n for n in copies if n.op_type == "Dropout"]
    masks = {n.output[1] for n in low.graph.node if n.op_type == "Dropout" and len(n.output) > 1 and n.output[1]}

    def masks_read(m):
        return masks & {x for n in m.training_info[0].algorithm.node for x in n.input}
    assert masks_read(low) and masks_read(low) == masks_read(lower(tm))  # the forward's own draws, as plain
    assert len(lower(tm).graph.node) == len(low.graph.node)


def test_trains_in_a_training_session():
    model, loss, feeds, dims = _encoder_layer()
    losses = {}
    for budget in (None, 1):
        sess = TrainingSession(make_training_model(model, loss, memory_budget=MemoryBudget(budget, dims)),
                               progress=False)
        assert (budget is None) != bool(_recomputed(sess.model))
        # under a budget the step runs in the stored order the plan was made for
        order = ort.ExecutionOrder.PRIORITY_BASED if budget else ort.ExecutionOrder.DEFAULT
        assert sess._options.execution_order == order
        # and the arena gives its free chunks back after every run (docs/benchmarks.md)
        assert (sess._run_options is not None) == bool(budget)
        if budget:
            assert sess._run_options.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"
        losses[budget] = [float(sess.step(feeds)[sess.loss_name]) for _ in range(5)]
    assert losses[1][-1] < losses[1][0]
    np.testing.assert_allclose(losses[1], losses[None], rtol=1e-5)


def test_a_budgeted_step_without_an_arena_has_nothing_to_give_back():
    """onnxruntime refuses to shrink an arena that the session does not have."""
    model, loss, feeds, dims = _encoder_layer()
    options = ort.SessionOptions()
    options.enable_cpu_mem_arena = False
    sess = TrainingSession(make_training_model(model, loss, memory_budget=MemoryBudget(1, dims)),
                           session_options=options, progress=False)
    assert sess._run_options is None
    assert np.isfinite(float(sess.step(feeds)[sess.loss_name]))


@pytest.mark.parametrize("text, size", [("2GiB", 2 * 2**30), ("500MB", 500 * 10**6), ("1.5 GB", 1.5e9),
                                        ("123", 123), (4096, 4096), ("auto", "auto"), (None, None)])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["2 parsecs", "-1GB", "", "1e9", 0, -5, True, [1]])
def test_a_budget_that_is_not_a_size_fails_before_any_work(bad):
    model, loss, _, _ = _mlp()
    with pytest.raises(MemoryBudgetError, match="memory_budget"):
        make_training_model(model, loss, memory_budget=bad)


def test_symbolic_dims_need_a_size():
    model, loss, _, _ = _encoder_layer()
    with pytest.raises(MemoryBudgetError, match="'N'.*MemoryBudget"):
        make_training_model(model, loss, memory_budget="1MB")
    with pytest.raises(MemoryBudgetError, match="MemoryBudget dims"):
        make_training_model(model, loss, memory_budget=MemoryBudget("1MB", {"N": 0}))


def test_without_networkx_the_error_names_the_extra(monkeypatch):
    model, loss, _, _ = _mlp()
    monkeypatch.setitem(sys.modules, "networkx", None)
    with pytest.raises(MemoryBudgetError, match=r"onnx-autodiff\[remat\]"):
        make_training_model(model, loss, memory_budget="1MB")
    make_training_model(model, loss)  # no budget: networkx is not needed


def test_the_command_line(tmp_path):
    from tests.integration.test_cli import assert_one_line_error, run
    model, _, _, _ = _encoder_layer()
    onnx.save(model, tmp_path / "m.onnx")
    p = run("make-training", "m.onnx", "t.onnx", "--memory-budget", "1KB", "--budget-dim", "N=8", cwd=tmp_path)
    assert "remat: recompute" in p.stdout and "FLOPs" in p.stdout
    assert _recomputed(lower(onnx.load(tmp_path / "t.onnx")))
    for bad in (["--memory-budget", "lots"], ["--memory-budget", "1MB", "--budget-dim", "N=x"],
                ["--memory-budget", "1MB"]):
        p = run("make-training", "m.onnx", "u.onnx", *bad, cwd=tmp_path, code=2)
        assert_one_line_error(p, "budget")
        assert not (tmp_path / "u.onnx").exists()
