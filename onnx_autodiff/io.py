"""Saving models atomically: a reader never sees a half-written file."""
from __future__ import annotations

import os
import shutil
import tempfile

import onnx
from onnx import external_data_helper

EXTERNAL_DATA_THRESHOLD = 1 << 30  # protobuf cannot serialize messages of 2 GiB; move data out well before


def save_model_atomic(model: onnx.ModelProto, path: str | os.PathLike,
                      external_data_threshold: int = EXTERNAL_DATA_THRESHOLD) -> None:
    """Write ``model`` to ``path`` through a temporary file in the same directory and ``os.replace``.

    A model larger than ``external_data_threshold`` bytes keeps its tensors in ``<name>.data`` next to
    it (written and replaced first, so the new model never points at missing data).
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    if model.ByteSize() > external_data_threshold:
        model = _with_external_data(model, directory, base + ".data")
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(model.SerializeToString())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _tensors(model: onnx.ModelProto):
    """Initializers of the inference graph and of every training graph (onnx's own external-data
    helpers only visit ModelProto.graph, which would leave optimizer state inline)."""
    graphs = [model.graph]
    for ti in model.training_info:
        graphs += [ti.initialization, ti.algorithm]
    for g in graphs:
        yield from g.initializer
        for sp in g.sparse_initializer:
            yield sp.values
            yield sp.indices


def _with_external_data(model: onnx.ModelProto, directory: str, location: str,
                        size_threshold: int = 1024) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    staging = tempfile.mkdtemp(prefix=f".{location}.", dir=directory)
    try:
        written = os.path.join(staging, location)
        open(written, "wb").close()
        for t in _tensors(out):
            if t.HasField("raw_data") and len(t.raw_data) >= size_threshold:
                external_data_helper.set_external_data(t, location)
                external_data_helper.save_external_data(t, staging)
                t.ClearField("raw_data")
        with open(written, "rb") as f:
            os.fsync(f.fileno())
        os.replace(written, os.path.join(directory, location))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """``onnx.load`` that also reads the external data of training-graph initializers."""
    path = os.fspath(path)
    model = onnx.load(path)
    base = os.path.dirname(os.path.abspath(path))
    for t in _tensors(model):
        if external_data_helper.uses_external_data(t):
            external_data_helper.load_external_data_for_tensor(t, base)
            t.data_location = onnx.TensorProto.DEFAULT
            del t.external_data[:]
    return model


__all__ = ["save_model_atomic", "load_model", "EXTERNAL_DATA_THRESHOLD"]
