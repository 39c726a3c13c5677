"""The one door: every public entry takes its model through ``open_model``, and one type travels inside.

``LightModel`` is that type: a *light* ModelProto (every large tensor detached: no bytes inside, see
``weights.py``) and the arrays of its detached tensors, read from where they already are (memory-mapped
from the model's files, or split once from a ModelProto the caller gave). Passes read only types and
shapes, so the whole pipeline runs on it; the bytes meet the model again in the runtime or on disk.

What we hand back is a plain ``onnx.ModelProto`` (``hand_back``), which every ONNX tool takes. A model
whose tensors add up to at most ``INLINE_LIMIT`` (256 MiB, the size past which ``io.save_model_atomic``
writes tensors to an external-data file too) comes back whole: every tensor inline, so onnx's tools work
on it wherever it is. A larger one keeps its tensors where they are, so handing it back copies no weight:
a weight memory-mapped from a file becomes an external-data reference into that file (``location``
relative to the model's folder, ``offset``, ``length``: the ONNX convention, also for a tensor stored
inline in an ``.onnx`` file, whose bytes the reference points at); an all-zero tensor (the optimizer's
fresh state, which the initialization graph also writes) becomes a sparse initializer without values,
zeros of its shape at no cost; the rest is inline. As for any model with external data, onnx's checker
and ``onnx.save`` resolve those references relative to the current folder and the saved file's folder:
check such a model in its folder or by path, and save it beside the model it came from, or anywhere
with ``save_model``. A ModelProto in memory does not know its folder, so we remember it for this process
under an opaque token in ``metadata_props[metadata.WEIGHTS_FOLDER]``; ``open_model`` finds it there (and
checks the files did not change since).

Reads stay in the folder of the file that names them (``weights.py`` refuses a location that leaves it).
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..errors import ModelFileError, ModelTypeError
from ..graph import top_graphs
from . import metadata
from .io import EXTERNAL_DATA_THRESHOLD, load_checked, save_model_atomic
from .weights import (
    attach_weights,
    fresh_zeros,
    is_detached,
    is_fresh_zeros,
    mark_detached,
    set_tensor_bytes,
    split_model,
)

INLINE_LIMIT = EXTERNAL_DATA_THRESHOLD  # tensors of a handed-back model up to this many bytes are inline
_ZERO_STATE_BYTES = 1024  # an in-memory all-zero tensor at least this large is handed back as a sparse zero


@dataclass(frozen=True)
class LightModel:
    """A light ModelProto and the arrays of its detached tensors (module docstring).

    ``folder``: the absolute folder of the model's own files (every external-data read stays inside it);
    ``source``: the ``.onnx`` file the arrays were mapped from (a LoRA checkpoint references its frozen
    weights there); ``private``: names whose arrays are copies only we hold (a session may write into them).
    """

    proto: onnx.ModelProto
    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)
    folder: str | None = None
    source: str | None = None
    private: frozenset = frozenset()

    def with_proto(self, proto: onnx.ModelProto) -> LightModel:
        """The same arrays and files under another (light) graph, such as its lowering."""
        return replace(self, proto=proto)

    def whole(self) -> onnx.ModelProto:
        """A new ModelProto with every tensor inline (the memory of all of them)."""
        m = onnx.ModelProto()
        m.CopyFrom(self.proto)
        attach_weights(m, self.arrays)
        return m

    def save(self, path, external_data_threshold: int = EXTERNAL_DATA_THRESHOLD) -> None:
        """Write the whole model atomically, streaming the arrays (``io.save_model_atomic``)."""
        save_model_atomic(self.proto, path, external_data_threshold, weights=self.arrays)


# ---- the door ----------------------------------------------------------------------------------

def open_model(model, *, weights: Mapping | None = None, base=None, what: str = "model") -> LightModel:
    """``model`` (a path, an ``onnx.ModelProto`` or a ``LightModel``) as the one type the inside uses.

    ``weights``: arrays of detached tensors of a light ModelProto (``io.load_split`` gives both). A path
    gets ``io.load_checked``'s clear errors; its tensors are memory-mapped, not read, and every file it names
    must be in its folder. ``base``: the model file a checkpoint's referenced frozen weights are in, when
    the checkpoint's folder does not hold it (a LoRA run's base)."""
    if isinstance(model, LightModel):
        return model if not weights else replace(model, arrays={**model.arrays, **weights})
    if isinstance(model, onnx.ModelProto):
        return _from_proto(model, weights)
    if isinstance(model, (str, os.PathLike)):
        light, arrays = load_checked(os.fspath(model), what, base)  # errors name the path as the caller wrote it
        path = os.path.abspath(os.fspath(model))
        return LightModel(_dense_zeros(light, arrays), {**arrays, **(weights or {})}, os.path.dirname(path), path)
    raise ModelTypeError(f"the {what} is a {type(model).__name__}; expected the path of an .onnx file, an "
                         "onnx.ModelProto or what onnx-autodiff returned")


def _from_proto(model: onnx.ModelProto, weights: Mapping | None) -> LightModel:
    token = metadata.read(model).get(metadata.WEIGHTS_FOLDER)
    folder, source = _remembered(model, token)
    light, arrays = split_model(model, base_dir=folder)
    _forget_token(light)
    light = _dense_zeros(light, arrays)
    private = {n for n, a in arrays.items() if not isinstance(a, np.memmap)}
    missing = [t.name for g in top_graphs(light) for t in g.initializer
               if is_detached(t) and t.name not in arrays and t.name not in (weights or {})]
    if missing:
        raise ModelFileError(f"initializer {missing[0]!r} is detached (no bytes, onnx-autodiff's light form) and no "
                             f"array was given for it ({len(missing)} such)",
                             hint="pass the model's path, or the weights=... dict load_split gave with it")
    return LightModel(light, {**arrays, **(weights or {})}, folder, source, frozenset(private))


def hand_back(light: LightModel) -> onnx.ModelProto:
    """The ModelProto we return: memory-mapped weights as external-data references into the files they
    are in, all-zero in-memory tensors as sparse zeros, the rest inline; a model of at most ``INLINE_LIMIT``
    bytes of tensors whole (module docstring)."""
    if sum(int(np.asarray(a).nbytes) for a in light.arrays.values()) <= INLINE_LIMIT:
        return light.whole()
    m = onnx.ModelProto()
    m.CopyFrom(light.proto)
    files: set[str] = set()
    for g in top_graphs(m):
        zeros = []
        for t in g.initializer:
            if not is_detached(t) or t.name not in light.arrays:
                continue
            arr = light.arrays[t.name]
            ref = _reference(arr, light.folder)
            if ref is not None:
                set_reference(t, *ref)
                files.add(ref[0])
            elif _all_zero(arr):
                zeros.append(t)
            else:
                set_tensor_bytes(t, arr)
        for t in zeros:
            g.initializer.remove(t)
            g.sparse_initializer.append(_sparse_zero(t))
    if files:
        _remember(m, light, files)
    return m


def save_model(model, path, external_data_threshold: int = EXTERNAL_DATA_THRESHOLD) -> None:
    """Write ``model`` (anything ``open_model`` takes) atomically with every tensor, wherever ``path`` is:
    tensors past ``external_data_threshold`` bytes go to one external-data file beside it."""
    open_model(model).save(path, external_data_threshold)


# ---- references into files ---------------------------------------------------------------------

def mapped_file(arr) -> tuple[str, int, int] | None:
    """``(real path, offset, length)`` of an array that is a whole read-only memory map of a file's bytes, else
    None (a view of a map is not the bytes of one tensor)."""
    if not isinstance(arr, np.memmap) or getattr(arr, "_mmap", None) is None:
        return None
    if arr.base is not arr._mmap or not arr.flags.c_contiguous:
        return None
    return os.path.realpath(arr.filename), int(arr.offset), int(arr.nbytes)


def _reference(arr, folder: str | None) -> tuple[str, int, int] | None:
    """``(location, offset, length)`` of an array that is a whole memory map of a file in ``folder``."""
    mapped = mapped_file(arr) if folder is not None else None
    if mapped is None:
        return None
    path, offset, length = mapped
    location = os.path.relpath(path, os.path.realpath(folder))
    if location.startswith(os.pardir) or os.path.isabs(location):
        return None
    return location.replace(os.sep, "/"), offset, length


def set_reference(t: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    del t.external_data[:]
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        t.external_data.add(key=key, value=value)


def _all_zero(arr) -> bool:
    if is_fresh_zeros(arr):
        return arr.nbytes >= _ZERO_STATE_BYTES  # zeros we made: known without reading them
    a = np.asarray(arr)
    return a.nbytes >= _ZERO_STATE_BYTES and a.dtype.kind in "fiub" and not a.any()


# ---- all-zero tensors as sparse initializers ------------------------------------------------------

def _sparse_zero(t: onnx.TensorProto) -> onnx.SparseTensorProto:
    values = helper.make_tensor(t.name, t.data_type, [0], [])
    indices = helper.make_tensor(f"{t.name}/indices", TensorProto.INT64, [0], [])
    return helper.make_sparse_tensor(values, indices, list(t.dims))


def _dense_zeros(light: onnx.ModelProto, arrays: dict) -> onnx.ModelProto:
    """In place (and returned): every sparse initializer without values becomes a detached dense one whose
    array is fresh zeros (calloc: no memory until written)."""
    for g in top_graphs(light):
        empty = [s for s in g.sparse_initializer if _is_sparse_zero(s)]
        for s in empty:
            g.sparse_initializer.remove(s)
            t = g.initializer.add(name=s.values.name, data_type=s.values.data_type, dims=s.dims)
            mark_detached(t)
            arrays[t.name] = fresh_zeros(tuple(s.dims), helper.tensor_dtype_to_np_dtype(s.values.data_type))
    return light


def dense_zeros(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` itself when no sparse initializer stands for zeros, else a copy where each is a dense tensor
    of zeros (inline): the form a graph that runs needs (a step model's state, ``build_step_model``)."""
    if not any(_is_sparse_zero(s) for g in top_graphs(model) for s in g.sparse_initializer):
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    arrays: dict = {}
    _dense_zeros(m, arrays)
    attach_weights(m, arrays)
    return m


def _is_sparse_zero(s: onnx.SparseTensorProto) -> bool:
    return not len(s.values.dims) or s.values.dims[0] == 0


# ---- the folder of a ModelProto in memory --------------------------------------------------------

_FOLDERS: dict[str, tuple[str, str | None, dict[str, tuple[int, int]]]] = {}


def _stat(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _remember(m: onnx.ModelProto, light: LightModel, files: set[str]) -> None:
    token = uuid.uuid4().hex
    _FOLDERS[token] = (light.folder, light.source, {f: _stat(os.path.join(light.folder, f)) for f in files})
    metadata.write(m, {metadata.WEIGHTS_FOLDER: token})


def _forget_token(light: onnx.ModelProto) -> None:
    metadata.drop(light, [metadata.WEIGHTS_FOLDER])


def _external(model: onnx.ModelProto) -> str | None:
    for g in top_graphs(model):
        for t in g.initializer:
            if t.data_location == TensorProto.EXTERNAL and not is_detached(t):
                loc = next((e.value for e in t.external_data if e.key == "location"), "")
                if loc != "onnx-autodiff:base":
                    return t.name
    return None


def _remembered(model: onnx.ModelProto, token: str | None) -> tuple[str | None, str | None]:
    """The folder (and source file) of a ModelProto's external-data tensors, when we handed it back."""
    external = _external(model)
    if external is None:
        return None, None
    if token not in _FOLDERS:
        raise ModelFileError(f"initializer {external!r} keeps its bytes in an external-data file, and a ModelProto in "
                             "memory does not say which folder that file is in",
                             hint="pass the model's path instead (its external data is located beside it), or load "
                                  "it with onnx.load(path), which reads the external data")
    folder, source, files = _FOLDERS[token]
    for name, stat in files.items():
        path = os.path.join(folder, name)
        if not os.path.exists(path) or _stat(path) != stat:
            raise ModelFileError(f"{path!r}, which holds this model's weights, changed or went away since "
                                 "onnx-autodiff read it", hint="build the model again from the file as it is now")
    return folder, source


__all__ = ["LightModel", "open_model", "hand_back", "save_model", "dense_zeros", "mapped_file", "set_reference",
           "INLINE_LIMIT"]
