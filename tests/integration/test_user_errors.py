"""Each case of issue 13's "Why" list, asserting the one line a user sees (CLI) or the error of ours (API)."""
from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import cli
from onnx_autodiff.driver.spec_checks import check_update_bindings
from onnx_autodiff.errors import GradientShapeError, GradientSpecError, TrainingSpecError
from onnx_autodiff.model.metadata import TRAIN_STATE
from onnx_autodiff.passes.pipeline import lower
from tests.cli_models import digits_like, mlp_training_model
from tests.integration.test_cli import assert_one_line_error, run

F = TensorProto.FLOAT
vi = helper.make_tensor_value_info


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    d = tmp_path_factory.mktemp("errors")
    onnx.save(mlp_training_model(hidden=32, features=16), str(d / "a.onnx"))
    onnx.save(mlp_training_model(hidden=32, features=16, lr=0.02), str(d / "b.onnx"))
    x, y = digits_like(n=64, features=16)
    np.savez(d / "data.npz", X=x, y=y)
    np.savez(d / "other.npz", X=x[::-1].copy(), y=y[::-1].copy())
    run("train", "a.onnx", "--data", "data.npz", "--epochs", "1", "--checkpoint", "ck", "--quiet", cwd=d)
    return d


def checkpoint_bytes(d):
    return (d / "ck" / "checkpoint.onnx").read_bytes()


# ---- checkpoints and resume -----------------------------------------------------------------------

def test_resume_refuses_another_models_checkpoint(d):
    before = checkpoint_bytes(d)
    p = run("train", "b.onnx", "--data", "data.npz", "--epochs", "2", "--checkpoint", "ck", cwd=d, code=2)
    assert_one_line_error(p, "'ck' holds a checkpoint of another training model", "a.onnx", "not of 'b.onnx'",
                          "start fresh with another --checkpoint directory (or delete 'ck')")
    assert checkpoint_bytes(d) == before


def test_resume_refuses_other_data_or_order(d):
    p = run("train", "a.onnx", "--data", "other.npz", "--epochs", "2", "--checkpoint", "ck", cwd=d, code=2)
    assert_one_line_error(p, "'ck' was trained on other data", "pass the same --data to resume")
    p = run("train", "a.onnx", "--data", "data.npz", "--epochs", "2", "--batch-size", "8", "--checkpoint", "ck",
            cwd=d, code=2)
    assert_one_line_error(p, "'ck' was trained with --batch-size 32", "pass the same --batch-size to resume")


def test_a_second_trainer_is_locked_out(d):
    fd = os.open(d / "ck", os.O_RDONLY)  # what a running trainer holds
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        p = run("train", "a.onnx", "--data", "data.npz", "--epochs", "2", "--checkpoint", "ck", cwd=d, code=2)
    finally:
        os.close(fd)
    assert_one_line_error(p, "another onnx-autodiff train is running on the checkpoint directory 'ck'",
                          "pass another --checkpoint directory")


def test_a_second_real_trainer_is_locked_out(tmp_path, d):
    for name in ("a.onnx", "data.npz"):
        os.symlink(d / name, tmp_path / name)
    first = subprocess.Popen([sys.executable, "-m", "onnx_autodiff", "train", "a.onnx", "--data", "data.npz",
                              "--epochs", "100000", "--checkpoint", "ck", "--quiet"], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = first.stdout.readline()
        while line and not line.startswith("training on"):
            line = first.stdout.readline()
        p = run("train", "a.onnx", "--data", "data.npz", "--epochs", "2", "--checkpoint", "ck", cwd=tmp_path, code=2)
        assert_one_line_error(p, "another onnx-autodiff train is running")
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=60)
    assert first.returncode == 128 + signal.SIGTERM and "interrupted (SIGTERM)" in err
    assert sorted(os.listdir(tmp_path / "ck")) == ["checkpoint.onnx"]


def test_export_onto_its_input_is_refused(d):
    before = checkpoint_bytes(d)
    p = run("export", "ck/checkpoint.onnx", "ck/checkpoint.onnx", cwd=d, code=2)
    assert_one_line_error(p, "is the file being read ('ck/checkpoint.onnx')",
                          "write the inference model to another file")
    assert checkpoint_bytes(d) == before
    p = run("train", "a.onnx", "--data", "data.npz", "--checkpoint", "ck", "--export", "ck/checkpoint.onnx", cwd=d,
            code=2)
    assert_one_line_error(p, "--export 'ck/checkpoint.onnx' is the file being read")


def test_export_path_and_inputs_are_checked_before_anything_is_created(d, tmp_path):
    for name in ("a.onnx", "data.npz"):
        os.symlink(d / name, tmp_path / name)
    p = run("train", "a.onnx", "--data", "data.npz", "--checkpoint", "new", "--export", "nodir/m.onnx",
            cwd=tmp_path, code=2)
    assert_one_line_error(p, "cannot write 'nodir/m.onnx'", "does not exist")
    assert "training on" not in p.stdout and not (tmp_path / "new").exists()
    p = run("train", "a.onnx", "--data", "missing.npz", "--checkpoint", "new", cwd=tmp_path, code=2)
    assert_one_line_error(p, "data file 'missing.npz' does not exist")
    assert not (tmp_path / "new").exists()


def test_a_checkpoint_not_written_by_train_is_named(d, tmp_path):
    os.makedirs(tmp_path / "ck")
    onnx.save(mlp_training_model(hidden=32, features=16), str(tmp_path / "ck" / "checkpoint.onnx"))
    for name in ("a.onnx", "data.npz"):
        os.symlink(d / name, tmp_path / name)
    p = run("train", "a.onnx", "--data", "data.npz", "--checkpoint", "ck", cwd=tmp_path, code=2)
    assert_one_line_error(p, "was not written by onnx-autodiff train", "start fresh")


def test_a_full_disk_keeps_the_previous_checkpoint(d, tmp_path, monkeypatch, capsys):
    from onnx_autodiff.driver.session import TrainingSession

    for name in ("a.onnx", "data.npz"):
        os.symlink(d / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    real_save, calls = TrainingSession.save, []

    def save(self, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:  # the second epoch's save: write part of a temporary file, then ENOSPC
            with open(os.path.join(os.path.dirname(path), ".checkpoint.onnx.x.tmp"), "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real_save(self, path, *args, **kwargs)

    monkeypatch.setattr(TrainingSession, "save", save)
    code = cli.main(["train", "a.onnx", "--data", "data.npz", "--epochs", "3", "--checkpoint", "ck", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert "cannot write the checkpoint 'ck/checkpoint.onnx': the disk is full; the previous checkpoint (epoch 1) " \
           "is kept" in err and "hint: free some space and rerun the same command to resume" in err
    assert "report it" not in err
    assert os.listdir(tmp_path / "ck") == ["checkpoint.onnx"]
    meta = {p.key: p.value for p in onnx.load(str(tmp_path / "ck" / "checkpoint.onnx")).metadata_props}
    assert '"epochs_done": 1' in meta[TRAIN_STATE]


def test_missing_external_data_is_named(tmp_path):
    m = mlp_training_model(hidden=32, features=16)
    onnx.save(m, str(tmp_path / "ext.onnx"), save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    os.remove(tmp_path / "ext.onnx.data")
    np.savez(tmp_path / "data.npz", X=np.zeros((4, 16), np.float32), y=np.zeros(4, np.int64))
    for args in (("train", "ext.onnx", "--data", "data.npz", "--checkpoint", "ck"), ("export", "ext.onnx", "o.onnx")):
        p = run(*args, cwd=tmp_path, code=2)
        assert_one_line_error(p, "'ext.onnx' keeps tensor",
                              "in the external-data file 'ext.onnx.data', which is missing", "copy the .data file")
        assert "report it" not in p.stderr


def test_negative_learning_rate_is_refused(d):
    for lr in ("-1", "nan"):
        p = run("train", "a.onnx", "--data", "data.npz", "--lr", lr, "--checkpoint", "neg", cwd=d, code=2)
        assert_one_line_error(p, f"--lr {lr}: the learning rate must be a finite number >= 0")
    assert not (d / "neg").exists()


def test_debug_before_the_command(tmp_path):
    p = run("--debug", "lower", "missing.onnx", "o.onnx", cwd=tmp_path, code=1)
    assert "Traceback" in p.stderr and "ModelFileError" in p.stderr


def test_divergence_says_the_update_went_non_finite(d, tmp_path):
    np.savez(tmp_path / "big.npz", X=np.full((32, 16), 1e18, np.float32), y=np.arange(32) % 10)
    os.symlink(d / "a.onnx", tmp_path / "a.onnx")
    p = run("train", "a.onnx", "--data", "big.npz", "--checkpoint", "c", "--lr", "1e30", "--quiet", cwd=tmp_path,
            code=1)
    assert_one_line_error(p, "NaN or Inf", "the data is finite", "the update went non-finite first", "lower --lr")


# ---- data ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("labels, words", [
    (np.arange(1, 65) % 10 + 1, ["labels 'y' (input 'labels') run from 1 to 10", "they look one-based",
                                 "subtract 1 from the labels"]),
    (np.where(np.arange(64) == 5, -1, np.arange(64) % 10), ["hold 1 value(s) outside 0..9, e.g. -1 in sample 5",
                                                             "labels are class indices 0..C-1 (C = 10)"]),
    (np.arange(64) % 10 + 0.5, ["data array 'y' (input 'labels') holds fractional or non-finite values"]),
])
def test_bad_labels_are_named_before_the_first_step(d, tmp_path, labels, words):
    x, _ = digits_like(n=64, features=16)
    np.savez(tmp_path / "bad.npz", X=x, y=labels)
    os.symlink(d / "a.onnx", tmp_path / "a.onnx")
    p = run("train", "a.onnx", "--data", "bad.npz", "--checkpoint", "c", cwd=tmp_path, code=2)
    assert_one_line_error(p, *words)
    assert "training on" not in p.stdout and not (tmp_path / "c").exists()


def test_nan_in_the_data_is_blamed_on_the_data(d, tmp_path):
    x, y = digits_like(n=64, features=16)
    x[17, 3] = np.nan
    x[40, 0] = np.inf
    np.savez(tmp_path / "nan.npz", X=x, y=y)
    os.symlink(d / "a.onnx", tmp_path / "a.onnx")
    p = run("train", "a.onnx", "--data", "nan.npz", "--checkpoint", "c", cwd=tmp_path, code=2)
    assert_one_line_error(p, "data array 'X' (input 'x') holds 2 NaN and Inf value(s), the first in sample 17",
                          "clean or drop those samples")
    assert "lower --lr" not in p.stderr


# ---- training specs -----------------------------------------------------------------------------

def test_update_binding_of_another_shape_is_refused(d, tmp_path):
    m = mlp_training_model(hidden=32, features=16)
    ti = m.training_info[0]
    b_new = next(b.value for b in ti.update_binding if b.key == "b1")
    next(b for b in ti.update_binding if b.key == "W1").value = b_new
    with pytest.raises(TrainingSpecError, match=r"update_binding: key 'W1' \(float \[32, 16\]\) is bound to "
                                                r"'train/b1.new', which is float \[32\]"):
        check_update_bindings(m)
    onnx.save(m, str(tmp_path / "m.onnx"))
    os.symlink(d / "data.npz", tmp_path / "data.npz")
    p = run("train", "m.onnx", "--data", "data.npz", "--checkpoint", "c", cwd=tmp_path, code=2)
    assert_one_line_error(p, "key 'W1' (float [32, 16]) is bound to 'train/b1.new'")


def test_empty_update_binding_is_refused(d, tmp_path):
    m = mlp_training_model(hidden=32, features=16)
    del m.training_info[0].update_binding[:]
    with pytest.raises(TrainingSpecError, match="update_binding is empty: the algorithm's results are never written"):
        check_update_bindings(m)
    onnx.save(m, str(tmp_path / "m.onnx"))
    os.symlink(d / "data.npz", tmp_path / "data.npz")
    p = run("train", "m.onnx", "--data", "data.npz", "--checkpoint", "c", cwd=tmp_path, code=2)
    assert_one_line_error(p, "training_info[0].update_binding is empty")


# ---- gradient requests --------------------------------------------------------------------------

def _grad_model(nodes, inputs, outputs, inits, opsets=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid("ai.onnx.preview.training", 1), *opsets])
    m.ir_version = 8
    return m


def _gradient(xs, y="loss", outputs=None):
    return helper.make_node("Gradient", list(xs), outputs or [f"d{x}" for x in xs], name="grad",
                            domain="ai.onnx.preview.training", xs=list(xs), y=y)


def test_integer_xs_is_refused():
    m = _grad_model([helper.make_node("Cast", ["K"], ["Kf"], to=F, name="cast"),
                     helper.make_node("Mul", ["x", "Kf"], ["y"], name="mul"),
                     helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0, name="sum"), _gradient(["K"])],
                    [vi("x", F, [3])], [vi("loss", F, []), vi("dK", TensorProto.INT64, [3])],
                    [numpy_helper.from_array(np.arange(3), "K")])
    with pytest.raises(GradientSpecError, match="Gradient node 'grad': xs names 'K', which is int64; gradients exist "
                                                "only with respect to floating-point tensors"):
        lower(m)


def test_integer_y_is_refused():
    m = _grad_model([helper.make_node("Mul", ["x", "W"], ["y"], name="mul"),
                     helper.make_node("Cast", ["y"], ["yi"], to=TensorProto.INT64, name="cast"),
                     helper.make_node("ReduceSum", ["yi"], ["loss"], keepdims=0, name="sum"), _gradient(["W"])],
                    [vi("x", F, [3])], [vi("loss", TensorProto.INT64, []), vi("dW", F, [3])],
                    [numpy_helper.from_array(np.ones(3, np.float32), "W")])
    with pytest.raises(GradientSpecError, match="y 'loss' is int64; only a floating-point y has a gradient"):
        lower(m)


def test_unknown_domain_op_is_named():
    m = _grad_model([helper.make_node("Mul", ["x", "W"], ["y"], name="mul"),
                     helper.make_node("MyOp", ["y"], ["z"], domain="com.example", name="myop"),
                     helper.make_node("ReduceSum", ["z"], ["loss"], keepdims=0, name="sum"), _gradient(["W"])],
                    [vi("x", F, [3])], [helper.make_empty_tensor_value_info("loss"), vi("dW", F, [3])],
                    [numpy_helper.from_array(np.ones(3, np.float32), "W")], [helper.make_opsetid("com.example", 1)])
    with pytest.raises(GradientSpecError, match="the element type of y 'loss' is unknown because node 'myop' "
                                                r"\(op 'MyOp', domain 'com.example'\) has no ONNX schema"):
        lower(m)


def test_wrong_declared_gradient_shape_names_the_output():
    m = _grad_model([helper.make_node("Gemm", ["x", "W"], ["y"], name="fc", transB=1),
                     helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0, name="sum"), _gradient(["W"])],
                    [vi("x", F, [2, 4])], [vi("loss", F, []), vi("dW", F, [4, 3])],
                    [numpy_helper.from_array(np.ones((3, 4), np.float32), "W")])
    with pytest.raises(GradientShapeError, match=r"output 'dW' \(the gradient of 'W'\) is declared with shape "
                                                 r"\[4, 3\], but a gradient has the shape of its x, \[3, 4\]") as e:
        lower(m)
    assert "/grad/" not in str(e.value)  # no internal node name


# ---- a user's rule wins over the built-in, registered before or after the registry loads ----------

USER_RULE = """
import numpy as np, onnx
from onnx import helper, numpy_helper, TensorProto
from onnx_autodiff.engine import registry
from onnx_autodiff.engine.registry import gradient_rule
calls = []
{before}
@gradient_rule("Mul")
def mul_grad(g, node, dy):
    calls.append(node.name)
    dz, = dy
    a, b = node.inputs
    z = node.outputs[0]
    return [g.unbroadcast(g.Mul(dz, b), a, z) if node.needs_grad(0) else None,
            g.unbroadcast(g.Mul(dz, a), b, z) if node.needs_grad(1) else None]
from onnx_autodiff.partial.vjp import build_vjp
g = helper.make_graph([helper.make_node("Mul", ["x", "W"], ["y"], name="mul")], "g",
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
                      [numpy_helper.from_array(np.ones(3, np.float32), "W")])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]); m.ir_version = 8
build_vjp(m, wrt=["W"])
assert registry.find_rule("", "Mul", 17).fn is mul_grad and calls == ["mul"], calls
print("user rule used")
"""


@pytest.mark.parametrize("before", ["", "registry.load_rules()"])
def test_user_rule_takes_precedence(tmp_path, before):
    script = USER_RULE.format(before=before)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0 and "user rule used" in p.stdout, p.stderr


def test_labels_may_use_the_losss_ignore_index(d, tmp_path):
    m = mlp_training_model(hidden=32, features=16)
    sce = next(n for n in m.training_info[0].algorithm.node if n.op_type == "SoftmaxCrossEntropyLoss")
    sce.attribute.append(helper.make_attribute("ignore_index", -1))
    onnx.save(m, str(tmp_path / "m.onnx"))
    x, y = digits_like(n=64, features=16)
    np.savez(tmp_path / "ok.npz", X=x, y=np.where(np.arange(64) % 7 == 0, -1, y))
    np.savez(tmp_path / "bad.npz", X=x, y=np.where(np.arange(64) == 9, 10, y))
    run("train", "m.onnx", "--data", "ok.npz", "--epochs", "1", "--checkpoint", "c", "--quiet", cwd=tmp_path)
    p = run("train", "m.onnx", "--data", "bad.npz", "--checkpoint", "c2", cwd=tmp_path, code=2)
    assert_one_line_error(p, "hold 1 value(s) outside 0..9 or the ignore_index -1, e.g. 10 in sample 9")


def test_every_error_class_carries_its_hint_and_exit_code():
    """The CLI prints ``e.hint`` and exits with ``e.exit_code``: every error class of ours has both."""
    import inspect

    from onnx_autodiff import errors
    from onnx_autodiff.cli import CliError

    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.OnnxAutodiffError)]
    assert len(classes) >= 10
    for cls in classes:
        assert isinstance(cls.hint, str) and cls.hint and cls.exit_code in (1, 2), cls
    assert CliError("m", "h").hint == "h" and CliError("m").exit_code == 2
    assert {c.exit_code for c in classes} == {1, 2}
    assert errors.TrainingDivergedError("t", 1).exit_code == 1 and errors.DataError("m", "h").hint == "h"
    assert errors.TrainingSpecError("m", hint="do this").hint == "do this"
    assert errors.UnsupportedOperatorError([("n", "Foo", "", 17)]).hint.startswith("freeze the parameters")
