"""The onnx-autodiff command end to end, through real subprocesses (``python -m onnx_autodiff``)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.cli.demo import load_digits, split
from onnx_autodiff.engine.coverage import coverage_markdown
from onnx_autodiff.graph import TRAINING_DOMAINS
from onnx_autodiff.training import make_training_model

F = TensorProto.FLOAT


def run(*args, cwd, code=0):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, "-m", "onnx_autodiff", *map(str, args)], cwd=cwd, capture_output=True,
                       text=True, timeout=300, env=env)
    assert p.returncode == code, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p


STAGE_LINE = re.compile(r"( \.\.\.|: done in [0-9.]+ s)$")  # progress.stage's lines, shown when a stage is slow


def assert_one_line_error(p, *words):
    """The error is one line (no traceback); stage lines a loaded machine may print before it are not part of it."""
    lines = [line for line in p.stderr.splitlines() if line.strip() and not STAGE_LINE.search(line)]
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr and "error:" in lines[0] and "hint:" in lines[0], lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])


def accuracy(path, x, y):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return float(np.mean(np.argmax(sess.run(None, {sess.get_inputs()[0].name: x})[0], axis=1) == y))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A torch MLP trained briefly on 150 digits, exported with the TorchScript exporter (opset 17), and the
    digits split into train/test .npz files (X/y names, and the model's own input names)."""
    d = tmp_path_factory.mktemp("cli")
    (xt, yt), (xs, ys) = split(*load_digits(), seed=0)
    xt, xs = xt.reshape(len(xt), 64), xs.reshape(len(xs), 64)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    opt = torch.optim.Adam(net.parameters(), 1e-2)
    for _ in range(25):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.tensor(xt[:150])), torch.tensor(yt[:150])).backward()
        opt.step()
    torch.onnx.export(net, torch.zeros(1, 64), str(d / "mlp.onnx"), dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["logits"], dynamic_axes={"x": {0: "N"}, "logits": {0: "N"}})
    np.savez(d / "train.npz", X=xt, y=yt)
    np.savez(d / "named.npz", x=xt[:320], labels=yt[:320])
    np.savez(d / "test.npz", X=xs, y=ys)
    return d, (xs, ys)


def test_finetune_torch_export_last_layer_only(work):
    d, (xs, ys) = work
    p = run("make-training", "mlp.onnx", "mlp_train.onnx", "--loss", "cross_entropy", "--optimizer", "momentum",
            "--lr", "0.05", "--trainable", "2.*", cwd=d)
    assert "trainable: 2 of the model's 4 float initializers (2.weight, 2.bias)" in p.stdout
    p = run("train", "mlp_train.onnx", "--data", "train.npz", "--epochs", "3", "--batch-size", "32",
            "--checkpoint", "ckpt", cwd=d)
    old = re.findall(r"epoch (\d+)/(\d+): loss (\S+)", p.stdout)  # the epoch line's two stable readings
    newer = re.findall(r"mean loss (\S+)", p.stdout)
    assert [e for e, _, _ in old] == ["1", "2", "3"] and {n for _, n, _ in old} == {"3"}
    losses = [float(v) for _, _, v in old]
    assert losses == [float(v) for v in newer]
    assert len(losses) == 3 and losses[-1] < losses[0]
    # stderr is a pipe here, as in a log: plain progress lines, no carriage returns
    assert "epoch 1/3: 45/45 steps, step loss " in p.stderr and "\r" not in p.stderr
    run("export", "ckpt/checkpoint.onnx", "mlp_tuned.onnx", cwd=d)

    before = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(d / "mlp.onnx")).graph.initializer}
    tuned = onnx.load(str(d / "mlp_tuned.onnx"))
    after = {t.name: numpy_helper.to_array(t) for t in tuned.graph.initializer}
    assert not len(tuned.training_info) and not {o.domain for o in tuned.opset_import} & set(TRAINING_DOMAINS)
    for name in ("0.weight", "0.bias"):
        assert after[name].tobytes() == before[name].tobytes(), name
    assert not np.array_equal(after["2.weight"], before["2.weight"])
    acc_before, acc_after = accuracy(d / "mlp.onnx", xs, ys), accuracy(d / "mlp_tuned.onnx", xs, ys)
    assert acc_after > acc_before + 0.03, (acc_before, acc_after)


def test_train_resumes_exactly_from_its_checkpoint(work):
    d, _ = work
    model = make_training_model(onnx.load(str(d / "mlp.onnx")), "cross_entropy", "adam", lr=0.01)
    onnx.save(model, str(d / "adam_train.onnx"))
    run("train", "adam_train.onnx", "--data", "named.npz", "--epochs", "2", "--checkpoint", "full", "--quiet", cwd=d)
    run("train", "adam_train.onnx", "--data", "named.npz", "--epochs", "1", "--checkpoint", "half", "--quiet", cwd=d)
    p = run("train", "adam_train.onnx", "--data", "named.npz", "--epochs", "2", "--checkpoint", "half", "--quiet",
            cwd=d)
    assert "resuming from" in p.stdout and "epoch 2/2" in p.stdout and "epoch 1/2" not in p.stdout
    full = onnx.load(str(d / "full" / "checkpoint.onnx"))
    half = onnx.load(str(d / "half" / "checkpoint.onnx"))
    assert [t.raw_data for t in full.graph.initializer] == [t.raw_data for t in half.graph.initializer]
    assert [t.raw_data for t in full.training_info[0].algorithm.initializer] == \
        [t.raw_data for t in half.training_info[0].algorithm.initializer]
    p = run("train", "adam_train.onnx", "--data", "named.npz", "--epochs", "2", "--checkpoint", "half", cwd=d)
    assert "nothing to do" in p.stdout


def test_lower(tmp_path):
    g = helper.make_graph(
        [helper.make_node("Mul", ["X", "W"], ["Y"], name="mul"),
         helper.make_node("Gradient", ["X", "W"], ["dX", "dW"], name="grad", domain="ai.onnx.preview.training",
                          xs=["X", "W"], y="Y")],
        "g", [helper.make_tensor_value_info("X", F, [3])],
        [helper.make_tensor_value_info(n, F, [3]) for n in ("Y", "dX", "dW")],
        [numpy_helper.from_array(np.array([1.0, 2.0, 3.0], np.float32), "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid("ai.onnx.preview.training", 1)])
    m.ir_version = 8
    onnx.save(m, str(tmp_path / "g.onnx"))
    p = run("lower", "g.onnx", "plain.onnx", cwd=tmp_path)
    assert "lowered 1 training node" in p.stdout
    plain = onnx.load(str(tmp_path / "plain.onnx"))
    assert not [n for n in plain.graph.node if n.domain in TRAINING_DOMAINS]
    x = np.array([4.0, 5.0, 6.0], np.float32)
    _, dx, dw = ort.InferenceSession(plain.SerializeToString()).run(None, {"X": x})
    np.testing.assert_array_equal(dx, [1, 2, 3])
    np.testing.assert_array_equal(dw, x)


def test_check_and_rules(work, tmp_path):
    d, _ = work
    p = run("check", "mlp.onnx", cwd=d)
    assert "gradcheck of logits" in p.stdout and "ok: 4 tensor(s) agree" in p.stdout
    p = run("rules", cwd=tmp_path)
    assert re.search(r"ai\.onnx\s+Gemm\s+rule", p.stdout) and "op types with a gradient rule" in p.stdout
    p = run("rules", "--markdown", cwd=tmp_path)
    assert p.stdout == coverage_markdown()


def test_demo_short(tmp_path):
    p = run("demo", "--out", "out", "--epochs", "2", "--seed", "1", cwd=tmp_path)
    epochs = re.findall(r"epoch +(\d)/2 +mean loss ([0-9.]+) +test accuracy ([0-9.]+)%", p.stdout)
    assert len(epochs) == 2
    reloaded = float(re.search(r"reloaded in onnxruntime.InferenceSession: test accuracy ([0-9.]+)%", p.stdout)[1])
    assert reloaded == float(epochs[-1][2]) and reloaded > 85.0, p.stdout
    (xt, yt), (xs, ys) = split(*load_digits(), seed=1)
    assert abs(100 * accuracy(tmp_path / "out" / "digits_cnn.onnx", xs, ys) - reloaded) < 0.01
    png = (tmp_path / "out" / "loss_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert "epoch 2/2: 45/45 steps, step loss " in p.stderr and "\r" not in p.stderr


# ---- errors: one line with a hint, exit 2 for input errors ---------------------------------------

def unsupported_model(path):
    g = helper.make_graph(
        [helper.make_node("Det", ["M"], ["d"], name="det"), helper.make_node("MatMul", ["X", "M"], ["XM"], name="mm"),
         helper.make_node("Mul", ["XM", "d"], ["S"], name="scale"),
         helper.make_node("Add", ["S", "B"], ["Y"], name="bias")],
        "det", [helper.make_tensor_value_info("X", F, ["N", 3])], [helper.make_tensor_value_info("Y", F, ["N", 3])],
        [numpy_helper.from_array(np.eye(3, dtype=np.float32), "M"),
         numpy_helper.from_array(np.zeros(3, np.float32), "B")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))


def test_error_paths(work, tmp_path):
    d, _ = work
    (tmp_path / "text.onnx").write_text("this is not a model\n")
    unsupported_model(tmp_path / "det.onnx")
    os.symlink(d / "mlp.onnx", tmp_path / "mlp.onnx")
    onnx.save(make_training_model(onnx.load(str(d / "mlp.onnx"))), str(tmp_path / "mlp_train.onnx"))
    np.savez(tmp_path / "bad_label.npz", X=np.zeros((4, 64), np.float32), y=np.zeros((4, 10), np.float32))

    assert_one_line_error(run("lower", "missing.onnx", "o.onnx", cwd=tmp_path, code=2), "'missing.onnx' does not exist")
    assert_one_line_error(run("export", "text.onnx", "o.onnx", cwd=tmp_path, code=2),
                          "'text.onnx' is not an ONNX model")
    assert_one_line_error(run("make-training", "mlp.onnx", "o.onnx", "--loss", "hinge", cwd=tmp_path, code=2),
                          "unknown loss 'hinge'", "make_training_model(loss=...)")
    assert_one_line_error(run("make-training", "det.onnx", "o.onnx", "--loss", "mse", cwd=tmp_path, code=2),
                          "no gradient rule for node 'det'", "op 'Det'", "--frozen")
    assert_one_line_error(run("train", "mlp_train.onnx", "--data", "bad_label.npz", "--checkpoint", "c", cwd=tmp_path,
                              code=2), "data array 'y' (input 'labels') has shape [4, 10], the input needs [N]")
    assert not (tmp_path / "c").exists()  # a failed run leaves no checkpoint directory
    assert not (tmp_path / "o.onnx").exists()
    # the unsupported op is fine once the tensor behind it is frozen
    run("make-training", "det.onnx", "o.onnx", "--loss", "mse", "--frozen", "M", cwd=tmp_path)
    # usage errors are argparse's (exit 2); --debug gives the traceback
    p = run("train", "mlp_train.onnx", cwd=tmp_path, code=2)
    assert "--data" in p.stderr
    p = run("lower", "missing.onnx", "o.onnx", "--debug", cwd=tmp_path, code=1)
    assert "Traceback" in p.stderr and "ModelFileError" in p.stderr


def test_divergence_exits_1_with_a_hint(work, tmp_path):
    d, _ = work
    onnx.save(make_training_model(onnx.load(str(d / "mlp.onnx")), "cross_entropy", "sgd"), str(tmp_path / "t.onnx"))
    x = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32) * 1e18
    np.savez(tmp_path / "data.npz", X=x, y=np.arange(64) % 10)
    p = run("train", "t.onnx", "--data", "data.npz", "--checkpoint", "c", "--lr", "1e30", "--quiet", cwd=tmp_path,
            code=1)
    assert_one_line_error(p, "NaN or Inf", "lower --lr")
