"""``onnx-autodiff demo``: a small CNN learns the 8x8 digits, offline, with stock onnxruntime.

The data (1797 images, UCI "Optical Recognition of Handwritten Digits", CC BY 4.0) ships with the
package. The inference model is written with ``onnx.helper``, ``make_training_model`` adds the loss
(cross-entropy) and the optimizer (Adam), ``TrainingSession`` runs the steps with a cosine learning
rate fed through the ``learning_rate`` input, and the exported inference model is reloaded in a plain
``onnxruntime.InferenceSession`` to measure the test accuracy. With matplotlib installed (the ``plot`` extra)
a loss curve is written as a PNG.
"""
from __future__ import annotations

import math
import os
import time
from importlib import resources

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..driver.session import TrainingSession
from ..model.io import save_model_atomic, write_atomic
from ..ort_options import session_options
from ..training import make_training_model

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


# ---- the loss plot (matplotlib, the optional ``plot`` extra) -----------------------------------

def loss_figure(step_losses: list[float], epoch_losses: list[float]):
    """A matplotlib Figure: per-step loss and per-epoch mean loss against the training step, with titled
    axes, ticks and a legend. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot()
    steps = np.arange(1, len(step_losses) + 1)
    ax.plot(steps, step_losses, color="#9db4e8", linewidth=1, label="loss per step")
    per_epoch = len(step_losses) / max(len(epoch_losses), 1)
    ax.plot(per_epoch * (np.arange(len(epoch_losses)) + 1), epoch_losses, "o-", color="#143ca0", linewidth=2,
            label="mean loss per epoch")
    ax.set_xlabel("training step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title("onnx-autodiff demo: 8x8 digits CNN")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_losses(step_losses: list[float], epoch_losses: list[float], path: str) -> str | None:
    """Write ``loss_figure`` as a PNG at ``path``. Needs matplotlib (``pip install onnx-autodiff[plot]``);
    without it returns None and writes nothing."""
    try:
        fig = loss_figure(step_losses, epoch_losses)
    except ImportError:
        return None
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_atomic(path, buf.getvalue())
    return path


def run(out_dir: str = "demo_out", epochs: int = 12, seed: int = 0, batch_size: int = 32, lr: float = 0.01,
        progress: bool = True, log=print) -> dict:
    """Train the CNN; returns the numbers it printed (accuracies, losses, seconds, paths)."""
    import onnxruntime as ort

    start = time.perf_counter()
    (x_train, y_train), (x_test, y_test) = split(*load_digits(), seed=seed)
    log(f"digits: {len(y_train)} training and {len(y_test)} test images of 8x8 pixels, 10 classes "
        "(UCI, CC BY 4.0)")
    os.makedirs(out_dir, exist_ok=True)
    inference = cnn_model(seed)
    training = make_training_model(inference, "cross_entropy", "adam", lr=lr)
    save_model_atomic(training, os.path.join(out_dir, "digits_cnn_training.onnx"))
    sess = TrainingSession(training)
    total = epochs * math.ceil(len(y_train) / batch_size)
    opts = session_options()

    def cosine(steps_done: int) -> float:  # the learning-rate schedule, fed per step
        return 0.5 * lr * (1 + math.cos(math.pi * steps_done / total))

    def report(state) -> None:
        test_acc = accuracy(ort.InferenceSession(sess.inference_model().SerializeToString(), opts,
                                                 providers=["CPUExecutionProvider"]), x_test, y_test)
        log(f"epoch {state.epochs_done:2d}/{epochs}  mean loss {state.losses[-1]:.4f}  test accuracy {test_acc:.2%}")

    step_losses: list[float] = []
    state = sess.fit({"image": x_train, "labels": y_train}, batch_size, epochs, seed=seed + 1, lr=cosine,
                     progress=progress, log=lambda line: None, on_epoch=report,
                     callback=lambda step, out: step_losses.append(float(out["loss"])))
    epoch_losses = state.losses
    train_seconds = time.perf_counter() - start
    model_path = os.path.join(out_dir, "digits_cnn.onnx")
    sess.export_inference(model_path)
    png_path = plot_losses(step_losses, epoch_losses, os.path.join(out_dir, "loss_curve.png"))
    plain = ort.InferenceSession(model_path, opts, providers=["CPUExecutionProvider"])
    final = accuracy(plain, x_test, y_test)
    log(f"exported {model_path}; reloaded in onnxruntime.InferenceSession: test accuracy {final:.2%} "
        f"({int(round(final * len(y_test)))}/{len(y_test)})")
    plotted = f"loss curve: {png_path}" if png_path else \
        "no loss curve (install matplotlib: pip install onnx-autodiff[plot])"
    log(f"{plotted}; {total} steps in {train_seconds:.1f} s")
    return {"accuracy": final, "epoch_losses": epoch_losses, "seconds": train_seconds,
            "model": model_path, "png": png_path, "steps": total}


__all__ = ["run", "cnn_model", "load_digits", "split", "plot_losses", "loss_figure"]
