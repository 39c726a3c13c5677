"""A model past protobuf's 2 GiB limit through every command: a frozen 600,000 x 1024 float32 embedding
(2.46 GB, external data) and a trainable head. make-training, train with a checkpoint, resume, export and
a reload in plain onnxruntime, each in its own process, each peaking under twice the model's bytes.

Slow (about 2-4 minutes and 10 GB of disk on 2 cores): marked ``slow``, run by ``.ci/run`` explicitly."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

pytestmark = pytest.mark.slow

ROWS, DIM, CLASSES = 600_000, 1024, 10
MODEL_BYTES = ROWS * DIM * 4

# runs one CLI command in this process and reports the process's peak RSS (VmHWM) on stderr
LAUNCH = """
import sys
from onnx_autodiff.cli import main
code = main(sys.argv[1:])
with open('/proc/self/status') as f:
    peak = next(int(l.split()[1]) for l in f if l.startswith('VmHWM:'))
print(f'PEAK_KB {peak}', file=sys.stderr)
sys.exit(code)
"""


def run(cwd, *args):
    p = subprocess.run([sys.executable, "-c", LAUNCH, *args], cwd=cwd, capture_output=True, text=True,
                       timeout=1200)
    assert p.returncode == 0, p.stderr
    peak = int(next(line.split()[1] for line in p.stderr.splitlines() if line.startswith("PEAK_KB"))) * 1024
    assert peak < 2 * MODEL_BYTES, (f"{args[0]} peaked at {peak / 2**30:.2f} GiB "
                                    f"for a {MODEL_BYTES / 2**30:.2f} GiB model")
    print(f"{args[0]}: peak RSS {peak / 2**30:.2f} GiB (model {MODEL_BYTES / 2**30:.2f} GiB)")
    return p, peak


def build(d, ids):
    """The embedding as a sparse external-data file: only the rows the data reads hold values."""
    rng = np.random.default_rng(0)
    with open(d / "big.onnx.data", "wb") as f:
        f.truncate(MODEL_BYTES)
        for row in np.unique(ids):
            f.seek(int(row) * DIM * 4)
            f.write(rng.standard_normal(DIM).astype(np.float32).tobytes())
    emb = TensorProto(name="emb", data_type=TensorProto.FLOAT, dims=[ROWS, DIM], data_location=TensorProto.EXTERNAL)
    for k, v in (("location", "big.onnx.data"), ("offset", "0"), ("length", str(MODEL_BYTES))):
        emb.external_data.add(key=k, value=v)
    head_w = helper.make_tensor("head.weight", TensorProto.FLOAT, [DIM, CLASSES],
                                (rng.standard_normal((DIM, CLASSES)) * 0.05).astype(np.float32).ravel())
    head_b = helper.make_tensor("head.bias", TensorProto.FLOAT, [CLASSES], np.zeros(CLASSES, np.float32))
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["e"], name="embed"),
             helper.make_node("ReduceMean", ["e"], ["pooled"], name="pool", axes=[1], keepdims=0),
             helper.make_node("MatMul", ["pooled", "head.weight"], ["mm"], name="head_mm"),
             helper.make_node("Add", ["mm", "head.bias"], ["logits"], name="head_add")]
    g = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 8])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES])],
                          [emb, head_w, head_b])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    with open(d / "big.onnx", "wb") as f:
        f.write(model.SerializeToString())


def test_a_model_past_2gb_trains_resumes_and_exports(tmp_path):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, ROWS, (64, 8)).astype(np.int64)
    labels = rng.integers(0, CLASSES, 64).astype(np.int64)
    np.savez(tmp_path / "data.npz", ids=ids, labels=labels)
    build(tmp_path, ids)

    refused = subprocess.run([sys.executable, "-m", "onnx_autodiff", "check", "big.onnx"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "past what one ONNX model (2 GiB) can hold" in refused.stderr, refused.stderr

    run(tmp_path, "make-training", "big.onnx", "train.onnx", "--loss", "cross_entropy", "--optimizer", "adam",
        "--lr", "0.01", "--trainable", "head.*")
    raw = onnx.load(str(tmp_path / "train.onnx"), load_external_data=False)
    assert raw.ByteSize() < 1 << 20  # the weights went to the data file, the model file is its graph
    common = ["--data", "data.npz", "--batch-size", "16", "--checkpoint", "ck", "--quiet"]
    first, _ = run(tmp_path, "train", "train.onnx", "--epochs", "1", *common)
    second, _ = run(tmp_path, "train", "train.onnx", "--epochs", "3", *common)
    assert "resuming from" in second.stdout
    run(tmp_path, "export", "ck/checkpoint.onnx", "trained.onnx")

    # plain onnxruntime reads the exported pair; the head moved, the frozen embedding did not
    sess = ort.InferenceSession(str(tmp_path / "trained.onnx"), providers=["CPUExecutionProvider"])
    logits = sess.run(None, {"ids": ids})[0]
    assert logits.shape == (64, CLASSES) and np.isfinite(logits).all()
    from onnx_autodiff.model.io import load_split

    light, weights = load_split(tmp_path / "trained.onnx")  # memory-mapped: a whole load is past protobuf's limit
    emb = next(t for t in onnx.load(str(tmp_path / "trained.onnx"), load_external_data=False).graph.initializer
               if t.name == "emb")
    assert emb.data_location == TensorProto.EXTERNAL
    source = np.memmap(tmp_path / "big.onnx.data", np.float32, "r", shape=(ROWS, DIM))
    for row in ids[:4, 0]:
        np.testing.assert_array_equal(weights["emb"][row], source[row])
    bias = onnx.numpy_helper.to_array(next(t for t in light.graph.initializer if t.name == "head.bias"))
    assert np.abs(bias).max() > 0  # the trained bias left zero
    assert not [n for n in os.listdir(tmp_path / "ck") if n.endswith(".tmp")]
