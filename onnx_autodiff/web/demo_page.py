"""``onnx-autodiff demo --web``: the digits CNN trained in the browser with onnxruntime-web.

The command builds the demo's training model (``demo.cnn_model`` + cross-entropy + Adam), exports its portable
step bundle, writes the digits split as raw little-endian arrays and an inference model whose weights are plain
inputs (the page feeds it the trained state to measure the test accuracy), and serves all of it with the page
(index.html, demo.js, train.js) and onnxruntime-web's files on 127.0.0.1.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import onnx

from ..cli import demo
from ..driver.bundle import export_step
from ..model.io import save_model_atomic, write_atomic
from ..training import make_training_model
from .serve import WEB_DIR, find_ort_web, start_server


def weights_as_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every initializer turned into a graph input without a default (onnxruntime-web accepts
    no feed for an input that has an initializer)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    inits = list(m.graph.initializer)
    del m.graph.initializer[:]
    m.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits)
    onnx.checker.check_model(m, full_check=True)
    return m


def prepare(out_dir: str | os.PathLike, seed: int = 0, epochs: int = 12, batch_size: int = 32,
            lr: float = 0.01) -> Path:
    """Write bundle/, infer.onnx and data/ (digits.json + .bin arrays) under ``out_dir``; returns it."""
    out = Path(out_dir)
    (x_train, y_train), (x_test, y_test) = demo.split(*demo.load_digits(), seed=seed)
    inference = demo.cnn_model(seed)
    export_step(make_training_model(inference, "cross_entropy", "adam", lr=lr), out / "bundle", target="portable")
    save_model_atomic(weights_as_inputs(inference), out / "infer.onnx")
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    spec = {"epochs": epochs, "batch_size": batch_size, "lr": lr, "seed": seed, "image_shape": list(x_train.shape[1:]),
            "image": "image", "labels": "labels"}
    for part, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        write_atomic(data / f"{part}_x.bin", x.astype("<f4").tobytes())
        write_atomic(data / f"{part}_y.bin", y.astype("<i8").tobytes())
        spec[part] = {"n": len(y), "x": f"{part}_x.bin", "y": f"{part}_y.bin"}
    write_atomic(data / "digits.json", json.dumps(spec, indent=1))
    return out


def _say(line: str) -> None:
    print(line, flush=True)


def serve(out_dir: str | os.PathLike, port: int = 8000, ort_web: str | None = None, seed: int = 0,
          epochs: int = 12, log=_say):
    """Check onnxruntime-web is there, prepare ``out_dir`` and serve the page; returns the running server."""
    dist = find_ort_web(ort_web)
    out = prepare(out_dir, seed=seed, epochs=epochs)
    server = start_server({"/": WEB_DIR, "/ort/": dist, "/bundle/": out / "bundle", "/data/": out / "data",
                           "/model/": out}, port)
    log(f"onnxruntime-web from {dist}; bundle and data in {out}")
    log(f"open http://127.0.0.1:{server.server_address[1]}/ in a browser (Ctrl-C stops the server)")
    return server


__all__ = ["prepare", "serve", "weights_as_inputs"]
