"""Reading and writing models with their weights outside the protobuf, atomically.

``load_split(path)`` gives a light model and its weights (memory-mapped from external-data files, so a
model larger than protobuf's 2 GiB limit loads in the size of its graph). ``save_model_atomic`` writes a
light or full model: small models as one file; larger ones as the model file plus one external-data file
``<name>.<token>.data`` beside it (the token is new at every save). The data file is written and synced
first, then the model file replaces the old one with ``os.replace``: that rename is the one moment the
new pair takes effect, so a reader (or a crash) sees either the old model with its old data file or the
new model with its new one. Data files the old model used are removed afterwards. Plain
``onnx.load(path)`` reads the result. Files get the mode the umask gives (as ``open`` would).
``write_atomic(path, data)`` is the same replace for any other file (a plot, a text report).

A checkpoint may *reference* frozen weights instead of copying them (``reference_base``: a LoRA run's
checkpoint holds only the adapters and their optimizer state): each such tensor is external data at the
location ``onnx-autodiff:base`` and ``metadata_props[metadata.BASE]`` names the model file that holds
it (relative to the checkpoint, and absolute); ``load_split`` reads those tensors from that file.
"""
from __future__ import annotations

import errno
import json
import math
import mmap
import os
import re
import uuid
from collections.abc import Mapping

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper, numpy_helper

from ..errors import ModelFileError, OutsideFolderError
from ..graph import top_graphs
from . import metadata, wire
from .packed import is_packed, pack, stored_nbytes
from .weights import (
    MIN_BYTES,
    Weights,
    checkable,
    detach_tensor,
    detached_inline,
    inside,
    is_detached,
    mark_detached,
    set_tensor_bytes,
    split_model,
)

EXTERNAL_DATA_THRESHOLD = 1 << 28  # larger models keep their tensors in a data file (protobuf stops at 2 GiB)
ALIGN = 4096  # data offsets of large tensors are page-aligned, so a runtime may map them
_TOKEN = re.compile(r"\.[0-9a-f]{12}\.data$")


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_error(e: OSError, path: str) -> ModelFileError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return ModelFileError(f"no room left on the device writing {path!r}; free some space (the previous "
                              "file, if any, is unchanged)")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ModelFileError(f"cannot write {path!r}: permission denied; choose a writable location")
    return ModelFileError(f"cannot write {path!r}: {e.strerror or e}")


def load_split(path: str | os.PathLike, base: str | os.PathLike | None = None) -> tuple[onnx.ModelProto, Weights]:
    """A light model and its weights: external data memory-mapped, large inline tensors as arrays. Every file
    it names stays in its folder (``weights.inside``). ``base``: the model file a checkpoint's referenced
    frozen weights are in, when it is not the one the checkpoint names inside its folder."""
    return _load_split(os.fspath(path), base)


def _load_split(path: str, base, check_files: bool = False) -> tuple[onnx.ModelProto, Weights]:
    """``load_split``; with ``check_files`` every external-data file is checked first (``check_external_data``)."""
    try:
        model, mapped = _parse_light(path)
    except FileNotFoundError:
        raise ModelFileError(f"model file {path!r} does not exist") from None
    except IsADirectoryError:
        raise ModelFileError(f"{path!r} is a directory, not an .onnx file") from None
    except (DecodeError, ValueError, RuntimeWarning) as e:
        raise ModelFileError(f"{path!r} is not an ONNX model ({type(e).__name__}: {e})") from None
    if check_files:
        _check_external_files(model, path)
    from_base = _resolve_base(model, path, base)
    light, weights = split_model(model, base_dir=os.path.dirname(os.path.abspath(path)))
    del model
    return light, {**weights, **mapped, **from_base}


def _parse_light(path: str) -> tuple[onnx.ModelProto, Weights]:
    """The model at ``path`` parsed without the bytes of its large float and integer initializers, each detached and
    its array a read-only memory map of its bytes in the file (``wire.strip_raw_data``): so the weights of a model
    saved in one file (as exporters write models under 2 GB) are neither read nor copied, and a training session's
    copies are the only ones (BERT-base: 440 MB less, and two parses of it fewer). What split_model would keep inline
    (other types, small tensors) keeps its bytes. A text-format file, or bytes that are not the wire format,
    take ``onnx.load`` (and its error)."""
    fmt = onnx.serialization.registry.get_format_from_file_extension(os.path.splitext(path)[1])
    if fmt not in (None, "protobuf") or os.path.getsize(path) == 0:
        return onnx.load(path, load_external_data=False), {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            stripped, cut = wire.strip_raw_data(buf, MIN_BYTES)
        except wire.WireError:
            return onnx.load(path, load_external_data=False), {}
        model = onnx.serialization.registry.get("protobuf").deserialize_proto(stripped, onnx.ModelProto())
        graphs = {("graph",): model.graph}
        for k, ti in enumerate(model.training_info):
            graphs[(k, 1)], graphs[(k, 2)] = ti.initialization, ti.algorithm
        mapped: Weights = {}
        for key, entries in cut.items():
            for ordinal, offset, size in entries:
                t = graphs[key].initializer[ordinal]
                dtype = _mappable(t, size)
                if dtype is None:  # kept inline, as split_model keeps it
                    t.raw_data = buf[offset:offset + size]
                    continue
                mark_detached(t)
                mapped[t.name] = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=tuple(t.dims))
    return model, mapped


def _mappable(t: onnx.TensorProto, size: int) -> np.dtype | None:
    """The dtype of the array that maps ``t``'s raw_data of ``size`` bytes, when split_model would detach it (an
    inline float or integer tensor large enough for ``weights.detached_inline`` whose bytes fit its dims); else
    None."""
    if t.data_location == TensorProto.EXTERNAL or not detached_inline(t.data_type, size):
        return None
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).newbyteorder("<")
    return dtype if math.prod(t.dims) * dtype.itemsize == size else None


BASE_KEY = metadata.BASE
BASE_LOCATION = "onnx-autodiff:base"


def _is_reference(t: onnx.TensorProto) -> bool:
    return t.data_location == TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == BASE_LOCATION for e in t.external_data)


def base_path_of(model: onnx.ModelProto) -> str | None:
    """The absolute path of the model file a checkpoint's referenced weights come from, or None."""
    for p in model.metadata_props:
        if p.key == BASE_KEY:
            return json.loads(p.value)["abspath"]
    return None


def source_of(model: onnx.ModelProto, folders) -> str | None:
    """The inference model file a training model was made from (``metadata.SOURCE``) when it lies in one of
    ``folders`` (the folder of the file that records it, and folders the caller named): a stranger's model must
    not make us read files elsewhere. None when it records none, or only one outside them."""
    entry = metadata.read_json(model, metadata.SOURCE)
    if not entry or not entry.get("abspath"):
        return None
    for folder in folders:
        if not folder:
            continue
        try:
            return inside(folder, os.path.relpath(entry["abspath"], folder), "the model's source")
        except (OutsideFolderError, ValueError):  # ValueError: another drive
            continue
    return None


def _set_base(model: onnx.ModelProto, ref: dict) -> None:
    props = [p for p in model.metadata_props if p.key != BASE_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(props)
    model.metadata_props.add(key=BASE_KEY, value=json.dumps(ref))


def reference_base(model: onnx.ModelProto, base: str, names: set[str], path: str) -> int:
    """Make the initializers ``names`` of (light) ``model``, to be saved at ``path``, references to the same
    tensors of the model file ``base``; returns how many."""
    base = os.path.abspath(base)
    count = 0
    for t in model.graph.initializer:
        if t.name in names:
            detach_tensor(t)
            del t.external_data[:]
            t.external_data.add(key="location", value=BASE_LOCATION)
            count += 1
    if count:
        _set_base(model, {"path": os.path.relpath(base, os.path.dirname(os.path.abspath(path))), "abspath": base})
    return count


def _base_error(message: str) -> ModelFileError:
    e = ModelFileError(message, hint="a LoRA checkpoint reads its frozen weights from the training model it was "
                                     "trained from: keep that file where it was")
    return e


def _resolve_base(model: onnx.ModelProto, path: str, given: str | os.PathLike | None) -> Weights:
    """The arrays of the tensors ``model`` references in its base file, which become detached tensors. The base
    is ``given``, else the file the checkpoint names, which must be in its folder (a stranger's checkpoint must
    not make us read elsewhere)."""
    refs = [t for t in model.graph.initializer if _is_reference(t)]
    if not refs:
        return {}
    entry = next((p.value for p in model.metadata_props if p.key == BASE_KEY), None)
    if entry is None:
        raise ModelFileError(f"{path!r}: initializer {refs[0].name!r} references a base model, but the model "
                             f"names none (metadata {BASE_KEY!r})")
    ref = json.loads(entry)
    if given is not None:
        base = os.path.abspath(os.fspath(given))
    else:
        try:
            base = inside(os.path.dirname(os.path.abspath(path)), ref["path"], f"{path!r} (its base model)")
        except OutsideFolderError as e:
            raise OutsideFolderError(f"{path!r} holds only the trained tensors; its frozen weights are in "
                                     f"{ref['path']!r}, outside its folder, which is not read unless you name it",
                                     hint="pass the base model: --base MODEL, or TrainingSession(ckpt, "
                                          "base_path=MODEL) / open_model(ckpt, base=MODEL)") from e
    if not os.path.exists(base):
        raise _base_error(f"{path!r} holds only the trained tensors; its frozen weights are in {ref['path']!r} "
                          f"({base!r}), which is missing: keep the base model where it was when the checkpoint "
                          "was written, or name it (--base MODEL)")
    base_model, base_weights = load_split(base)
    inits = {t.name: t for t in base_model.graph.initializer}
    out = {}
    for t in refs:
        b = inits.get(t.name)
        if b is None or b.data_type != t.data_type or list(b.dims) != list(t.dims):
            raise _base_error(f"{path!r}: tensor {t.name!r} is referenced in {base!r}, which does not hold "
                                 "it with the same type and shape: the base model changed since the checkpoint")
        out[t.name] = base_weights[t.name] if is_detached(b) else numpy_helper.to_array(b)
        del t.external_data[:]
        mark_detached(t)
    _set_base(model, {**ref, "abspath": os.path.abspath(base)})
    return out


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def external_data_files(model: onnx.ModelProto) -> list[str]:
    """The external-data files (locations relative to the model's folder) its initializers name, sorted."""
    found = set()
    for g in top_graphs(model):
        for t in g.initializer:
            if t.data_location == TensorProto.EXTERNAL and not is_detached(t) and not _is_reference(t):
                found.update(e.value for e in t.external_data if e.key == "location")
    return sorted(found)


def check_external_data(path: str) -> None:
    """Every external-data file the model at ``path`` names is in its folder (``OutsideFolderError``) and there
    (our error naming the tensor, where onnx would say 'should be stored in ..., but it is not regular file')."""
    try:
        model, _ = _parse_light(path)
    except (DecodeError, RuntimeWarning, ValueError, OSError):
        return  # load_split's own error says it is not a model
    _check_external_files(model, path)


def _check_external_files(model: onnx.ModelProto, path: str) -> None:
    base = os.path.dirname(os.path.abspath(path))
    for location in external_data_files(model):
        names = [t.name for g in top_graphs(model) for t in g.initializer
                 if any(e.key == "location" and e.value == location for e in t.external_data)]
        if not os.path.isfile(inside(base, location, f"{path!r}: initializer {names[0]!r}")):
            raise ModelFileError(f"{path!r} keeps tensor {names[0]!r} in the external-data file {location!r}, "
                                 f"which is missing from {base!r}",
                                 hint="copy the .data file that was written with the model next to it")


def load_checked(path: str | os.PathLike, what: str = "model",
                 base: str | os.PathLike | None = None) -> tuple[onnx.ModelProto, Weights]:
    """``load_split`` for a file a user names: a clear error for a missing file, a directory, a missing
    external-data file, or something that is not (valid) ONNX."""
    path = os.fspath(path)
    not_onnx = "pass a .onnx file written by onnx.save or an exporter"
    if not os.path.exists(path):
        raise ModelFileError(f"{what} file {path!r} does not exist", hint="check the path")
    if os.path.isdir(path):
        raise ModelFileError(f"{what} path {path!r} is a directory, not an .onnx file",
                             hint="name the .onnx file inside it")
    try:
        model, weights = _load_split(path, base, check_files=True)
    except ModelFileError as e:
        if "is not an ONNX model" in str(e):
            raise ModelFileError(str(e), hint=not_onnx) from e  # load_split said it: once, with the hint
        raise  # says what is wrong with the file already
    except ValueError as e:
        raise ModelFileError(f"{path!r} is not an ONNX model ({first_line(e)})", hint=not_onnx) from e
    if not model.ir_version or not model.HasField("graph"):
        raise ModelFileError(f"{path!r} is not an ONNX model (no IR version or graph)", hint=not_onnx)
    try:
        onnx.checker.check_model(checkable(model))
    except onnx.checker.ValidationError as e:
        raise ModelFileError(f"{path!r} is not a valid ONNX model: {first_line(e)}",
                             hint="run onnx.checker.check_model on it to see every problem") from e
    return model, weights


def check_output_path(path: str | os.PathLike, option: str, *, not_same_as: tuple = ()) -> None:
    """Refuse an output path that cannot be written, before any work is done."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ModelFileError(f"{option} {path!r} is a directory", hint="name the .onnx file to write")
    if not os.path.isdir(directory):
        raise ModelFileError(f"cannot write {path!r}: directory {directory!r} does not exist", hint="create it first")
    for other in filter(None, not_same_as):
        same = os.path.abspath(other) == os.path.abspath(path) or (
            os.path.exists(other) and os.path.exists(path) and os.path.samefile(other, path))
        if same:
            raise ModelFileError(f"{option} {path!r} is the file being read ({other!r}); writing it would destroy "
                                 "it", hint="write the inference model to another file")


def _referenced_files(path: str) -> set[str]:
    """The external-data files the model at ``path`` names (empty when there is none or it is unreadable)."""
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception:
        return set()
    return {f for f in external_data_files(model) if os.path.basename(f) == f}


def _array(weights: Mapping | None, t: onnx.TensorProto) -> np.ndarray:
    if weights is None or t.name not in weights:
        raise ModelFileError(f"initializer {t.name!r} is detached and its array was not given; pass the "
                             "weights with the model")
    return np.asarray(weights[t.name])


def _write_data(tensors: list[tuple[onnx.TensorProto, np.ndarray]], tmp: str, location: str) -> None:
    """Write the arrays one after another (large ones page-aligned) and point each tensor at its bytes."""
    with open(tmp, "xb") as f:
        offset = 0
        for t, arr in tensors:
            if is_packed(t.data_type):  # two (or four) elements a byte, as onnx stores them
                data = memoryview(pack(arr)) if arr.size else b""
            else:
                arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
                data = memoryview(arr).cast("B") if arr.size else b""
            if len(data) >= ALIGN and offset % ALIGN:
                pad = ALIGN - offset % ALIGN
                f.write(b"\0" * pad)
                offset += pad
            f.write(data)
            t.data_location = TensorProto.EXTERNAL
            del t.external_data[:]
            for k, v in (("location", location), ("offset", str(offset)), ("length", str(len(data)))):
                t.external_data.add(key=k, value=v)
            offset += len(data)
        f.flush()
        os.fsync(f.fileno())


def _replace(path: str, data: bytes) -> None:
    """``data`` into a temporary file beside ``path`` (``.<name>.<token>.tmp``, synced), then ``os.replace``."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Write ``data`` (text is UTF-8) to ``path`` atomically: a reader, or a crash, sees the old file or the
    new one, never a part. ``ModelFileError`` (an OSError) says why a write failed."""
    path = os.fspath(path)
    try:
        _replace(path, data.encode() if isinstance(data, str) else data)
    except OSError as e:
        raise _write_error(e, path) from e


def save_model_atomic(model: onnx.ModelProto, path: str | os.PathLike,
                      external_data_threshold: int = EXTERNAL_DATA_THRESHOLD, *,
                      weights: Mapping | None = None) -> None:
    """Write ``model`` (light, with the arrays of its detached tensors in ``weights``, or whole) to
    ``path`` atomically, as one file or as a model file plus one external-data file (see the module
    docstring); large tensors (float, and integer from 64 KiB) move to the data file when the model holds more than
    ``external_data_threshold`` bytes of them. The model passed in is not changed."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    light, inline = split_model(model)  # a light copy we may change; ``inline``: arrays that were in it
    arrays = dict(inline)
    big = []
    for g in top_graphs(light):
        for t in g.initializer:
            if is_detached(t):
                arr = inline[t.name] if t.name in inline else _array(weights, t)
                arrays[t.name] = arr
                big.append(t)
    external = sum(stored_nbytes(arrays[t.name]) for t in big) > external_data_threshold
    old = _referenced_files(path) if os.path.exists(path) else set()
    location = f"{base}.{uuid.uuid4().hex[:12]}.data" if external else None
    tmp_data = os.path.join(directory, f".{location}.tmp") if location else None
    try:
        # small ones stay readable inline
        moved = [t for t in big if external and stored_nbytes(arrays[t.name]) >= MIN_BYTES]
        if moved:
            _write_data([(t, arrays[t.name]) for t in moved], tmp_data, location)
            os.replace(tmp_data, os.path.join(directory, location))
        for t in big:
            if is_detached(t):
                set_tensor_bytes(t, arrays[t.name])
        _replace(path, light.SerializeToString())
    except BaseException as e:
        for leftover in (tmp_data,):
            if leftover and os.path.exists(leftover):
                os.unlink(leftover)
        if location and os.path.exists(os.path.join(directory, location)) and not _uses(path, location):
            os.unlink(os.path.join(directory, location))
        if isinstance(e, OSError):
            raise _write_error(e, path) from e
        raise
    _remove_stale(directory, base, keep=location, old=old)


def _uses(path: str, location: str) -> bool:
    return location in _referenced_files(path)


def _remove_stale(directory: str, base: str, keep: str | None, old: set[str]) -> None:
    """Remove the data files of ours the replaced model used, and those a killed save left (a data file
    named otherwise belongs to the user, maybe to other models too, and stays)."""
    stale = {f for f in old if f != keep and f.startswith(base + ".") and f.endswith(".data")}
    try:
        names = os.listdir(directory)
    except OSError:
        names = []
    for name in names:
        if name != keep and name.startswith(base + ".") and _TOKEN.search(name):
            stale.add(name)
        if name.startswith(f".{base}.") and name.endswith(".tmp"):
            stale.add(name)
    for name in stale:
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass


__all__ = ["source_of", "save_model_atomic", "write_atomic", "load_split", "EXTERNAL_DATA_THRESHOLD"]
