"""Every ```python block of README.md and docs/*.md runs, unchanged.

The blocks of one page run in order in one namespace, as a reader would type them. Where the prose around
a block speaks of the reader's own things ("your model", "batches"), ``CONTEXT`` gives them: small files
in the working directory and names in the namespace. README.md's block needs nothing: it builds its files.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.training import make_training_model

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
F = TensorProto.FLOAT


def blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)


def _model(nodes, inputs, outputs, inits, name="m"):
    m = helper.make_model(helper.make_graph(nodes, name, inputs, outputs, inits),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def linear_regression():
    """One data input X [N, 3], weights coef [3, 1] and intercept [1]: 'model' in partial_training.md."""
    rng = np.random.default_rng(0)
    return _model([helper.make_node("MatMul", ["X", "coef"], ["xw"]),
                   helper.make_node("Add", ["xw", "intercept"], ["Y"])],
                  [helper.make_tensor_value_info("X", F, ["N", 3])], [helper.make_tensor_value_info("Y", F, ["N", 1])],
                  [numpy_helper.from_array(rng.normal(size=(3, 1)).astype(np.float32), "coef"),
                   numpy_helper.from_array(np.zeros(1, np.float32), "intercept")])


def classifier():
    """input [N, 4] -> body (frozen) -> head -> logits [N, 3]: 'classifier.onnx' / 'model.onnx'."""
    rng = np.random.default_rng(1)
    return _model([helper.make_node("Gemm", ["input", "body.weight", "body.bias"], ["h"], transB=1),
                   helper.make_node("Relu", ["h"], ["r"]),
                   helper.make_node("Gemm", ["r", "head.weight", "head.bias"], ["logits"], transB=1)],
                  [helper.make_tensor_value_info("input", F, ["N", 4])],
                  [helper.make_tensor_value_info("logits", F, ["N", 3])],
                  [numpy_helper.from_array(rng.normal(size=(8, 4)).astype(np.float32), "body.weight"),
                   numpy_helper.from_array(np.zeros(8, np.float32), "body.bias"),
                   numpy_helper.from_array(rng.normal(size=(3, 8)).astype(np.float32), "head.weight"),
                   numpy_helper.from_array(np.zeros(3, np.float32), "head.bias")])


def _batches(n=3):
    rng = np.random.default_rng(2)
    return [(rng.normal(size=(5, 4)).astype(np.float32), rng.integers(0, 3, 5)) for _ in range(n)]


def partial_training(cwd):
    import torch

    x = np.random.default_rng(3).normal(size=(8, 3)).astype(np.float32)
    block = _model([helper.make_node("Gemm", ["z", "inner.weight", "inner.bias"], ["out"], transB=1)],
                   [helper.make_tensor_value_info("z", F, ["N", 4])],
                   [helper.make_tensor_value_info("out", F, ["N", 5])],
                   [numpy_helper.from_array(np.ones((5, 4), np.float32), "inner.weight"),
                    numpy_helper.from_array(np.zeros(5, np.float32), "inner.bias")])
    return {"model": linear_regression(), "torch": torch, "feeds": {"X": x},
            "dy": {"Y": np.ones((8, 1), np.float32)}, "onnx_model": block, "X": x, "y": x.sum(axis=1)}


def training(cwd):
    onnx.save(make_training_model(classifier(), "cross_entropy", "adam"), str(cwd / "model.onnx"))
    data = _batches()
    return {"batches": [{"input": x, "labels": y} for x, y in data],
            "x": np.concatenate([x for x, _ in data]), "y": np.concatenate([y for _, y in data])}


def training_builder(cwd):
    onnx.save(classifier(), str(cwd / "classifier.onnx"))
    return {"batches": _batches(), "lr_schedule": lambda step: 1e-3 * 0.9 ** step}


def distributed(cwd):
    """model.onnx as for training.md; global_batches of 5 rows (cut into 2 micro-batches of 2 and 3)."""
    return {"global_batches": training(cwd)["batches"]}


def llm(cwd):
    """llm.md's section 6 builds its tiny int4 model-builder folder itself: it needs the builder installed (the
    page's other sections need nothing)."""
    pytest.importorskip("onnxruntime_genai")
    return {}


CONTEXT = {"architecture.md": lambda tmp_path: {}, "distributed.md": distributed, "llm.md": llm,
           "partial_training.md": partial_training, "runtimes.md": lambda tmp_path: {}, "training.md": training,
           "training_builder.md": training_builder}

CONTEXT["quantized_bases.md"] = lambda tmp_path: {}  # self-contained: the page builds its model
CONTEXT["forward_mode.md"] = lambda tmp_path: {}  # self-contained (its heat-equation training takes ~4 s)


def gpu(cwd):
    """model.onnx: an inference classifier ``input`` [N, 4] -> logits [N, 3]; x, y a batch; the WebGPU plugin EP
    on a software adapter (tests/webgpu_runtime.py; skips where it is missing)."""
    from tests.webgpu_runtime import webgpu_device

    webgpu_device()
    onnx.save(classifier(), str(cwd / "model.onnx"))
    x, y = _batches(1)[0]
    return {"x": x, "y": y}


CONTEXT["gpu.md"] = gpu


def federated(cwd):
    """'train.onnx' (a classifier with Adam), each client's partition (``data``) and held-out ``test_feeds``."""
    from tests.cli_models import digits_like, mlp_training_model

    onnx.save(mlp_training_model("adam", lr=0.05, hidden=16, features=8, classes=3), cwd / "train.onnx")
    x, y = digits_like(96, features=8, classes=3, seed=2)
    return {"data": lambda p, n: {"x": x[32 + p::n], "labels": y[32 + p::n]},
            "test_feeds": {"x": x[:32], "labels": y[:32]}}


CONTEXT["federated.md"] = federated
SLOW_PAGES = {"federated.md": "Ray starts a simulation: about 40-60 s"}


@pytest.mark.parametrize("page", [pytest.param(p, marks=[pytest.mark.slow] if p.name in SLOW_PAGES else [])
                                  for p in PAGES if blocks(p)], ids=lambda p: p.name)
def test_snippets_run(page, tmp_path, monkeypatch):
    from onnx_autodiff.engine import registry

    monkeypatch.chdir(tmp_path)
    setup = CONTEXT.get(page.name)
    namespace = {"__name__": f"snippet_{page.stem}"}
    namespace.update(setup(tmp_path) if setup else {})
    with registry.scratch_registry():  # a snippet that registers a rule must not change the registry other tests see
        for k, code in enumerate(blocks(page)):
            try:
                exec(compile(code, f"{page.name}[block {k}]", "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"{page.name} block {k} fails: {type(e).__name__}: {e}\n{code}") from e


def test_every_page_with_python_is_covered():
    """A page whose blocks need context must have it here (README.md needs none)."""
    needing = {p.name for p in PAGES if blocks(p)} - {"README.md", "writing_rules.md"}
    assert needing <= set(CONTEXT), needing - set(CONTEXT)
