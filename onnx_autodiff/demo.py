"""``onnx-autodiff demo``: a small CNN learns the 8x8 digits, offline, with stock onnxruntime.

The data (1797 images, UCI "Optical Recognition of Handwritten Digits", CC BY 4.0) ships with the
package. The inference model is written with ``onnx.helper``, ``make_training_model`` adds the loss
(cross-entropy) and the optimizer (Adam), ``TrainingSession`` runs the steps with a cosine learning
rate fed through the ``learning_rate`` input, and the exported inference model is reloaded in a plain
``onnxruntime.InferenceSession`` to measure the test accuracy. A loss curve is written as a PNG with
nothing but zlib and struct.
"""
from __future__ import annotations

import math
import os
import struct
import sys
import time
import zlib
from importlib import resources

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F = TensorProto.FLOAT


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [1797, 8, 8] in 0..16, labels uint8 [1797]) from the packaged archive."""
    with resources.files("onnx_autodiff").joinpath("data", "digits.npz").open("rb") as f:
        with np.load(f) as z:
            return z["images"], z["labels"]


def split(images, labels, seed: int, test_fraction: float = 0.2):
    """A stratified train/test split: the same share of every digit goes to the test set."""
    rng = np.random.default_rng(seed)
    test = []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        test += list(idx[: int(round(len(idx) * test_fraction))])
    mask = np.zeros(len(labels), bool)
    mask[test] = True
    x = (images.astype(np.float32) / 16.0)[:, None, :, :]
    y = labels.astype(np.int64)
    return (x[~mask], y[~mask]), (x[mask], y[mask])


def cnn_model(seed: int) -> onnx.ModelProto:
    """Conv(16, 3x3) -> Relu -> MaxPool -> Conv(32, 3x3) -> Relu -> MaxPool -> Flatten -> Gemm(10)."""
    rng = np.random.default_rng(seed)

    def he(shape, fan_in):
        return (rng.standard_normal(shape) * math.sqrt(2.0 / fan_in)).astype(np.float32)

    w = {"conv1.weight": he((16, 1, 3, 3), 9), "conv1.bias": np.zeros(16, np.float32),
         "conv2.weight": he((32, 16, 3, 3), 144), "conv2.bias": np.zeros(32, np.float32),
         "fc.weight": he((10, 128), 128) / math.sqrt(2.0), "fc.bias": np.zeros(10, np.float32)}
    nodes = [
        helper.make_node("Conv", ["image", "conv1.weight", "conv1.bias"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "conv2.weight", "conv2.bias"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("MaxPool", ["r2"], ["p2"], name="pool2", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p2"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], name="fc", transB=1),
    ]
    g = helper.make_graph(nodes, "digits_cnn", [helper.make_tensor_value_info("image", F, ["N", 1, 8, 8])],
                          [helper.make_tensor_value_info("logits", F, ["N", 10])],
                          [numpy_helper.from_array(v, k) for k, v in w.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="onnx-autodiff demo")
    m.ir_version = 8
    return m


def accuracy(session, x: np.ndarray, y: np.ndarray) -> float:
    name = session.get_inputs()[0].name
    logits = session.run(None, {name: x})[0]
    return float(np.mean(np.argmax(logits, axis=1) == y))


# ---- a PNG line plot with zlib + struct ---------------------------------------------------------

_FONT = {  # 3x5 glyphs, one row per 3 bits
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001010010010",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", " ": "000000000000000",
    "o": "000111101101111", "l": "110010010010111", "s": "000111110011111",
}


def _text(img, x: int, y: int, s: str, color, scale: int = 2) -> None:
    for k, ch in enumerate(s):
        bits = _FONT.get(ch, _FONT[" "])
        for i, bit in enumerate(bits):
            if bit == "1":
                r, c = divmod(i, 3)
                x0, y0 = x + (4 * k + c) * scale, y + r * scale
                img[y0:y0 + scale, x0:x0 + scale] = color


def _line(img, x0: float, y0: float, x1: float, y1: float, color, width: int = 1) -> None:
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    xs = np.rint(np.linspace(x0, x1, n)).astype(int)
    ys = np.rint(np.linspace(y0, y1, n)).astype(int)
    h, w = img.shape[:2]
    for dx in range(width):
        for dy in range(width):
            ok = (xs + dx < w) & (ys + dy < h) & (xs + dx >= 0) & (ys + dy >= 0)
            img[ys[ok] + dy, xs[ok] + dx] = color


def png_bytes(img: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of ``img`` (uint8, [H, W, 3])."""
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[r].tobytes() for r in range(h))  # filter type 0 on every row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def loss_curve_png(step_losses: list[float], epoch_losses: list[float], width: int = 640, height: int = 360) -> bytes:
    """Per-step loss (light) and per-epoch mean loss (dark, at mid-epoch) against the step; y runs from 0
    to the largest loss, the labels are that maximum and the last step."""
    img = np.full((height, width, 3), 255, np.uint8)
    left, right, top, bottom = 50, 20, 20, 40
    pw, ph = width - left - right, height - top - bottom
    ymax = max(max(step_losses, default=1.0), 1e-12)
    n = max(len(step_losses) - 1, 1)

    def xy(i, v):
        return left + pw * i / n, top + ph * (1 - min(v, ymax) / ymax)

    grey, axis = (225, 225, 225), (0, 0, 0)
    for k in range(1, 5):
        _line(img, left, top + ph * k / 4, left + pw, top + ph * k / 4, grey)
    for i in range(1, len(step_losses)):
        _line(img, *xy(i - 1, step_losses[i - 1]), *xy(i, step_losses[i]), (150, 180, 235))
    steps_per_epoch = len(step_losses) / max(len(epoch_losses), 1)
    pts = [xy(steps_per_epoch * (e + 0.5), v) for e, v in enumerate(epoch_losses)]
    for a, b in zip(pts, pts[1:]):
        _line(img, *a, *b, (20, 60, 160), width=3)
    _line(img, left, top, left, top + ph, axis, 2)
    _line(img, left, top + ph, left + pw, top + ph, axis, 2)
    _text(img, 4, top - 4, f"{ymax:.2f}", axis)
    _text(img, 4, top + ph - 8, "0", axis)
    _text(img, left, top + ph + 10, "0", axis)
    label = str(len(step_losses))  # the last step
    _text(img, left + pw - 8 * len(label), top + ph + 10, label, axis)
    _text(img, left + pw // 2 - 16, 4, "loss", axis)
    return png_bytes(img)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run(out_dir: str = "demo_out", epochs: int = 12, seed: int = 0, batch_size: int = 32, lr: float = 0.01,
        progress: bool = True, log=print) -> dict:
    """Train the CNN; returns the numbers it printed (accuracies, losses, seconds, paths)."""
    import onnxruntime as ort

    from .cli import train_epoch
    from .io import save_model_atomic
    from .session import TrainingSession
    from .training_builder import make_training_model

    start = time.perf_counter()
    (x_train, y_train), (x_test, y_test) = split(*load_digits(), seed=seed)
    log(f"digits: {len(y_train)} training and {len(y_test)} test images of 8x8 pixels, 10 classes "
        "(UCI, CC BY 4.0)")
    os.makedirs(out_dir, exist_ok=True)
    inference = cnn_model(seed)
    training = make_training_model(inference, "cross_entropy", "adam", lr=lr)
    save_model_atomic(training, os.path.join(out_dir, "digits_cnn_training.onnx"))
    sess = TrainingSession(training)
    rng = np.random.default_rng(seed + 1)
    steps_per_epoch = math.ceil(len(y_train) / batch_size)
    total = epochs * steps_per_epoch
    step_losses: list[float] = []
    epoch_losses: list[float] = []
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    for epoch in range(epochs):
        order = rng.permutation(len(y_train))
        feeds = []
        for k in range(steps_per_epoch):
            idx = order[k * batch_size:(k + 1) * batch_size]
            t = epoch * steps_per_epoch + k
            rate = 0.5 * lr * (1 + math.cos(math.pi * t / total))  # cosine schedule, fed per step
            feeds.append({"image": x_train[idx], "labels": y_train[idx], "learning_rate": np.float32(rate)})
        losses = train_epoch(sess, feeds, epoch, epochs, progress)
        step_losses += losses
        epoch_losses.append(float(np.mean(losses)))
        test_acc = accuracy(ort.InferenceSession(sess.inference_model().SerializeToString(), opts,
                                                 providers=["CPUExecutionProvider"]), x_test, y_test)
        log(f"epoch {epoch + 1:2d}/{epochs}  loss {epoch_losses[-1]:.4f}  test accuracy {test_acc:.2%}")
    train_seconds = time.perf_counter() - start
    model_path = os.path.join(out_dir, "digits_cnn.onnx")
    sess.export_inference(model_path)
    png_path = os.path.join(out_dir, "loss_curve.png")
    _write_atomic(png_path, loss_curve_png(step_losses, epoch_losses))
    plain = ort.InferenceSession(model_path, opts, providers=["CPUExecutionProvider"])
    final = accuracy(plain, x_test, y_test)
    log(f"exported {model_path}; reloaded in onnxruntime.InferenceSession: test accuracy {final:.2%} "
        f"({int(round(final * len(y_test)))}/{len(y_test)})")
    log(f"loss curve: {png_path}; {total} steps in {train_seconds:.1f} s")
    return {"accuracy": final, "epoch_losses": epoch_losses, "seconds": train_seconds,
            "model": model_path, "png": png_path, "steps": total}


__all__ = ["run", "cnn_model", "load_digits", "split", "loss_curve_png", "png_bytes"]
