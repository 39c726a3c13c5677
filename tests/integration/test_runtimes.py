"""A step bundle trained on onnx.reference, OpenVINO and tract matches TrainingSession (onnxruntime) within
1e-5 relative, in the loss of each of 5 steps and in every state tensor after them; the checks that keep a
driver from being silently wrong; ``check --target``."""
from __future__ import annotations

import numpy as np
import pytest

from onnx_autodiff import TrainingSession
from onnx_autodiff.driver.bundle import export_step
from onnx_autodiff.errors import BundleError
from onnx_autodiff.runtimes import BundleTrainer
from tests.runtime_models import MODELS, OPTIMIZERS, training_case

RUNTIMES = ("reference", "openvino", "tract")
RTOL = 1e-5


def rel(a, b) -> float:
    """max |a - b| / max |b| (1 when b is all zeros and a is not)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.max(np.abs(b)) if b.size else 0.0
    diff = np.max(np.abs(a - b)) if b.size else 0.0
    return float(diff / scale) if scale else float(diff != 0)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """(model, optimizer) -> (bundle dir, batches, reference losses, reference state), built once each."""
    built = {}

    def get(name, optimizer):
        key = (name, optimizer)
        if key not in built:
            training, batches = training_case(name, optimizer)
            out = tmp_path_factory.mktemp(f"{name}_{optimizer}")
            export_step(training, out, target="portable")
            sess = TrainingSession(training)
            losses = [float(np.asarray(sess.step(b)[sess.loss_name]).reshape(-1)[0]) for b in batches]
            built[key] = out, batches, losses, {k: np.asarray(sess.state[k]) for k in sess.state}
        return built[key]
    return get


def _params(runtimes=RUNTIMES):
    out = []
    for name in MODELS:
        for opt in OPTIMIZERS:
            for rt in runtimes:
                marks = [pytest.mark.slow] if name == "bert" or (rt == "reference" and name == "transformer") else []
                out.append(pytest.param(name, opt, rt, id=f"{name}-{opt}-{rt}", marks=marks))
    return out


@pytest.mark.parametrize("name,optimizer,runtime", _params())
def test_bundle_parity(cases, name, optimizer, runtime):
    pytest.importorskip({"reference": "onnx", "openvino": "openvino", "tract": "tract"}[runtime])
    out, batches, ref_losses, ref_state = cases(name, optimizer)
    trainer = BundleTrainer(out, runtime)
    losses = [trainer.step(b) for b in batches]
    worst = max(rel(a, b) for a, b in zip(losses, ref_losses))
    assert set(trainer.state) == set(ref_state)
    worst_state = max(rel(trainer.state[k], ref_state[k]) for k in ref_state)
    print(f"PARITY {name} {optimizer} {runtime} loss={worst:.2e} state={worst_state:.2e}")
    assert worst <= RTOL, (losses, ref_losses)
    assert worst_state <= RTOL


def test_wrong_state_name_fails_loudly(cases):
    out, batches, _, _ = cases("mlp", "sgd")
    trainer = BundleTrainer(out, "onnxruntime")
    with pytest.raises(BundleError, match="not inputs of step.onnx"):
        trainer.step({**batches[0], "W1_typo": np.zeros(1, np.float32)})
    trainer.state["W1_typo"] = trainer.state.pop("W1")  # a loop that renamed a state tensor
    with pytest.raises(BundleError, match="W1_typo"):
        trainer.step(batches[0])


def test_runtime_ignoring_fed_state_is_detected(cases):
    """A runtime that hands back the state it was fed (as one that folded the state inputs into
    constants does from the second step on) stops the loop."""
    from onnx_autodiff.runtimes.ort import load

    def ignoring(path):
        run = load(path)
        return lambda feeds: {**run(feeds), **({o: feeds[i] for i, o in state_map.items()} if feeds else {})}

    out, batches, _, _ = cases("mlp", "sgd")
    state_map = BundleTrainer(out, "onnxruntime").state_map
    trainer = BundleTrainer(out, ignoring)
    with pytest.raises(BundleError, match="ignores the fed state"):
        trainer.step(batches[0])
    zero_lr = BundleTrainer(out, ignoring)  # a zero learning rate may leave the state as it was
    zero_lr.step(batches[0], {"learning_rate": 0.0})


def test_check_target_names_the_missing_op(tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper

    from onnx_autodiff.cli import main

    f = TensorProto.FLOAT
    g = helper.make_graph([helper.make_node("Det", ["x"], ["d"], name="det"),
                           helper.make_node("Relu", ["d"], ["y"], name="relu")], "g",
                          [helper.make_tensor_value_info("x", f, [3, 3])], [helper.make_tensor_value_info("y", f, [])])
    path = tmp_path / "det.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    assert main(["check", str(path), "--target", "openvino"]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == "openvino lacks Det: needed by node 'det' (MISSING: no standard form)"
    assert out[-1].startswith("not ok")
    assert main(["check", str(path), "--target", "onnxruntime"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "ok: the model runs on onnxruntime"


def test_target_picks_forms_the_runtime_has(tmp_path):
    import onnx

    training, _ = training_case("cnn", "adam")
    ops, pools = {}, {}
    for target in ("onnxruntime", "portable", "tract"):
        export_step(training, tmp_path / target, target=target)
        nodes = onnx.load(tmp_path / target / "step.onnx").graph.node
        ops[target] = {n.op_type for n in nodes}
        pools[target] = max(len(n.output) for n in nodes if n.op_type == "MaxPool")
    # [N, C] SoftmaxCrossEntropyLoss is LogSoftmax + NegativeLogLikelihoodLoss for every target (passes/loss_forms.py)
    assert {"MaxUnpool", "NegativeLogLikelihoodLoss"} <= ops["onnxruntime"]
    for target in ("portable", "tract"):
        assert not {"MaxUnpool", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"} & ops[target]
    assert "ScatterElements" in ops["tract"] and pools["tract"] == 2  # MaxPool's Indices, scattered
    assert pools["portable"] == 1 and "Equal" in ops["portable"]  # WebGPU has no Indices: compared with y


def test_emitted_models_are_portable(cases):
    """No empty trailing input; node names unique, no tensor's name, and no tensor name extends one with
    a dot (tract adds nodes named '<node>.bias')."""
    import onnx

    from onnx_autodiff.graph import tensor_names

    out, _, _, _ = cases("cnn", "adam")
    for file in ("step.onnx", "init.onnx"):
        m = onnx.load(out / file)
        tensors = tensor_names(m)
        names = [n.name for n in m.graph.node]
        assert len(set(names)) == len(names) and all(names)
        assert not set(names) & tensors
        assert not any(t.startswith(n + ".") for t in tensors for n in names)
        assert all(n.input[-1] for n in m.graph.node if len(n.input))
        assert not m.graph.initializer or file == "init.onnx" or not {t.name for t in m.graph.initializer} & {
            i.name for i in m.graph.input}


@pytest.mark.parametrize("runtime", ["tract", "openvino"])
def test_train_command_on_a_runtime_matches_onnxruntime(tmp_path, runtime):
    """``train --runtime R`` (bundle, state file) then ``import-state``: the same weights as ``train`` on
    onnxruntime, epoch order and batches included."""
    pytest.importorskip(runtime)
    import onnx
    from onnx import numpy_helper

    from onnx_autodiff.cli import main
    from tests.cli_models import digits_like, mlp_training_model

    onnx.save(mlp_training_model(hidden=16, features=8, classes=3), tmp_path / "t.onnx")
    x, y = digits_like(n=40, features=8, classes=3)
    np.savez(tmp_path / "d.npz", X=x, y=y)
    common = [str(tmp_path / "t.onnx"), "--data", str(tmp_path / "d.npz"), "--epochs", "2", "--batch-size", "16",
              "--quiet"]
    assert main(["train", *common, "--checkpoint", str(tmp_path / "ort"), "--export", str(tmp_path / "a.onnx")]) == 0
    assert main(["train", *common, "--checkpoint", str(tmp_path / "rt"), "--runtime", runtime]) == 0
    assert main(["import-state", str(tmp_path / "t.onnx"), str(tmp_path / "rt" / "state.npz"),
                 str(tmp_path / "b.onnx")]) == 0
    a = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "a.onnx").graph.initializer}
    b = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "b.onnx").graph.initializer}
    assert set(a) == set(b) == {"W1", "b1", "W2", "b2"}
    for k in a:
        assert rel(b[k], a[k]) <= RTOL, k
    assert not np.array_equal(a["W1"], numpy_helper.to_array(
        next(t for t in onnx.load(tmp_path / "t.onnx").graph.initializer if t.name == "W1")))


def test_import_state_refuses_a_foreign_name(tmp_path, cases):
    from onnx_autodiff.runtimes.state_file import import_state

    training, _ = training_case("mlp", "sgd")
    with pytest.raises(BundleError, match="not state of this model"):
        import_state(training, {"W9": np.zeros(1, np.float32)}, tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()


def _frozen_middle_model():
    """x @ W1 -> Relu -> @ W2 (frozen, square: a wrong orientation keeps the shapes), with the symbolic
    intermediate shape an exporter writes (value_info [N, 8])."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    f = TensorProto.FLOAT
    inits = [numpy_helper.from_array((rng.standard_normal((8, 8)) * 0.3).astype(np.float32), n) for n in ("W1", "W2")]
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
                           helper.make_node("Relu", ["h"], ["r"], name="relu"),
                           helper.make_node("MatMul", ["r", "W2"], ["y"], name="fc2")], "frozen_middle",
                          [helper.make_tensor_value_info("x", f, ["N", 8])],
                          [helper.make_tensor_value_info("y", f, ["N", 8])],
                          inits, value_info=[helper.make_tensor_value_info("h", f, ["N", 8])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_frozen_weight_read_transposed_by_the_backward(tmp_path, runtime):
    """A frozen weight is a constant of step.onnx that the forward reads as ``x @ W`` and the backward as
    ``dy @ Transpose(W)``: OpenVINO 2026.4 computed the second as ``dy @ W`` (passes/step_quirks.py), and tract
    refused the symbolic value_info; both train as TrainingSession does."""
    pytest.importorskip({"reference": "onnx", "openvino": "openvino", "tract": "tract"}[runtime])
    from onnx_autodiff.training import make_training_model

    training = make_training_model(_frozen_middle_model(), "mse", "adam", lr=0.01, frozen=["W2"])
    export_step(training, tmp_path, target="portable")
    rng = np.random.default_rng(1)
    batches = [{"x": rng.standard_normal((4, 8)).astype(np.float32),
                "labels": rng.standard_normal((4, 8)).astype(np.float32)} for _ in range(3)]
    sess = TrainingSession(training)
    ref = [float(np.asarray(sess.step(b)[sess.loss_name]).reshape(-1)[0]) for b in batches]
    trainer = BundleTrainer(tmp_path, runtime)
    losses = [trainer.step(b) for b in batches]
    assert "W1" in trainer.state and not any("W2" in k for k in trainer.state)  # W2: a constant of step.onnx
    assert max(rel(a, b) for a, b in zip(losses, ref)) <= RTOL, (losses, ref)
    assert rel(trainer.state["W1"], np.asarray(sess.state["W1"])) <= RTOL
