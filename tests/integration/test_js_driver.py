"""onnx_autodiff/web/train.js under node's test runner (tests/js/train.test.mjs, onnxruntime-node) on bundles made
here: an MLP's, one whose bundle.json names a state the model does not take, one whose step model keeps
initializer defaults (which onnxruntime-node leaves out of inputNames and then ignores when fed), one whose
step hands back the state it was fed, one of a future format version, one whose bundle.json names a model
outside its folder, and a decoder's, trained from token ids and a mask alone."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.driver.bundle import export_step
from tests.cli_models import mlp_training_model
from tests.js_runtime import JS_DIR, NODE_MODULES, run_node

F = TensorProto.FLOAT


def _copy(src, dst, edit_spec=None):
    shutil.copytree(src, dst)
    if edit_spec:
        spec = json.loads((dst / "bundle.json").read_text())
        edit_spec(spec)
        (dst / "bundle.json").write_text(json.dumps(spec))
    return dst


def _with_defaults(bundle):
    """The step model with its initial state as initializer defaults of the state inputs (the form
    build_step_model emits for onnxruntime's Python API)."""
    spec = json.loads((bundle / "bundle.json").read_text())
    step = onnx.load(bundle / "step.onnx")
    init = onnx.load(bundle / "init.onnx")
    from onnx.reference import ReferenceEvaluator

    values = dict(zip([o.name for o in init.graph.output], ReferenceEvaluator(init).run(None, {})))
    step.graph.initializer.extend(numpy_helper.from_array(values[k], k) for k in spec["state"])
    onnx.save(step, bundle / "step.onnx")


def frozen_bundle(out):
    """A step that computes a loss and hands back its state unchanged (as a runtime ignoring the fed state would)."""
    out.mkdir()
    nodes = [helper.make_node("Mul", ["x", "w"], ["xw"]), helper.make_node("ReduceSum", ["xw"], ["loss"], keepdims=0),
             helper.make_node("Identity", ["w"], ["w.new"]),
             helper.make_node("Identity", ["learning_rate"], ["lr_read"])]
    g = helper.make_graph(nodes, "frozen", [helper.make_tensor_value_info("x", F, ["N", 2]),
                                             helper.make_tensor_value_info("w", F, [2]),
                                             helper.make_tensor_value_info("learning_rate", F, [])],
                          [helper.make_tensor_value_info("loss", F, []), helper.make_tensor_value_info("w.new", F, [2]),
                           helper.make_tensor_value_info("lr_read", F, [])])
    init = helper.make_graph([helper.make_node("Constant", [], ["w"], value_floats=[0.5, -0.5])], "init", [],
                             [helper.make_tensor_value_info("w", F, [2])])
    for graph, file in ((g, "step.onnx"), (init, "init.onnx")):
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        onnx.checker.check_model(m, full_check=True)
        onnx.save(m, out / file)
    (out / "bundle.json").write_text(json.dumps({
        "format": "onnx-autodiff-step/1", "step": "step.onnx", "init": "init.onnx", "feeds": ["x"], "loss": "loss",
        "state": {"w": "w.new"}, "hyper": {"learning_rate": 0.1}}))


def decoder_bundle(out):
    """A decoder's bundle (its bundle.json's ``made``: the empty KV cache, positions from the mask) and the losses
    TrainingSession gives on the batch the JS test feeds (token ids and a mask, nothing else), in expected.json."""
    import numpy as np

    from onnx_autodiff import TrainingSession, make_training_model
    from tests.decoder_models import token_batch, with_past_decoder

    training = make_training_model(with_past_decoder(), "causal_lm", "adam", lr=0.05)
    export_step(training, out, target="portable")
    batch = token_batch()
    session = TrainingSession(training, outputs=["loss"], progress=False)
    losses = [float(session.step(batch)["loss"]) for _ in range(3)]
    (out / "expected.json").write_text(json.dumps({k: np.asarray(v).tolist() for k, v in batch.items()}
                                                  | {"losses": losses}))


def _rename_w1(spec):
    spec["state"]["W1_renamed"] = spec["state"].pop("W1")


def test_js_driver_under_node_test_runner(tmp_path):
    export_step(mlp_training_model("adam", hidden=32, features=16, classes=5), tmp_path / "mlp",
                      target="portable")
    mlp = tmp_path / "mlp"
    _copy(mlp, tmp_path / "wrong-name", _rename_w1)
    _with_defaults(_copy(mlp, tmp_path / "defaults"))
    _copy(mlp, tmp_path / "format-2", lambda spec: spec.update(format="onnx-autodiff-step/3"))
    frozen_bundle(tmp_path / "frozen")
    _copy(mlp, tmp_path / "outside", lambda spec: spec.update(step="../mlp/step.onnx"))
    decoder_bundle(tmp_path / "decoder")
    p = run_node(["--test", str(JS_DIR / "train.test.mjs")], env={"ONNX_AUTODIFF_TEST_BUNDLES": str(tmp_path)},
                 timeout=300)
    counts = {k: int(v) for k, v in re.findall(r"^# (pass|fail|skipped|todo) (\d+)$", p.stdout, re.M)}
    assert counts == {"pass": 8, "fail": 0, "skipped": 0, "todo": 0}, p.stdout


def test_the_node_example_of_docs_runtimes_runs(tmp_path):
    """The first ```js block of docs/runtimes.md, unchanged, next to train.js and the bundle of an MLP."""
    root = Path(__file__).resolve().parents[2]
    block = re.search(r"^```js\n(.*?)^```", (root / "docs" / "runtimes.md").read_text(), re.S | re.M).group(1)
    (tmp_path / "example.mjs").write_text(block)
    shutil.copy(root / "onnx_autodiff" / "web" / "train.js", tmp_path / "train.js")
    os.symlink(NODE_MODULES, tmp_path / "node_modules")
    export_step(mlp_training_model("adam", hidden=32, features=16, classes=5), tmp_path / "bundle", target="portable")
    out = run_node(["example.mjs"], timeout=120, cwd=tmp_path).stdout
    first, last = map(float, re.search(r"loss (\S+) -> (\S+); W1 is \[32,16\]", out).groups())
    assert last < 0.5 * first, out


def test_node_modules_may_be_named_by_a_relative_path(monkeypatch):
    """.ci/run names tests/js/node_modules relative to the checkout; node's createRequire needs it absolute."""
    from onnx_autodiff.runtimes.node import node_modules

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    monkeypatch.setenv("ONNX_AUTODIFF_NODE_MODULES", "tests/js/node_modules")
    found = node_modules()
    if not (root / "tests/js/node_modules/onnxruntime-node").is_dir():
        assert found is None
        return
    assert found is not None and found.is_absolute() and found == (root / "tests/js/node_modules").resolve()
