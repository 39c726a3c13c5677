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


def _with_external_data(model: onnx.ModelProto, directory: str, location: str) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    external_data_helper.convert_model_to_external_data(
        out, all_tensors_to_one_file=True, location=location, size_threshold=1024)
    staging = tempfile.mkdtemp(prefix=f".{location}.", dir=directory)
    try:
        external_data_helper.write_external_data_tensors(out, staging)
        written = os.path.join(staging, location)
        if os.path.exists(written):
            with open(written, "rb") as f:
                os.fsync(f.fileno())
            os.replace(written, os.path.join(directory, location))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


__all__ = ["save_model_atomic", "EXTERNAL_DATA_THRESHOLD"]
