"""Weights outside the protobuf: a light model plus a store of arrays.

A *light* model is an ordinary ModelProto whose large tensors carry no bytes: each is marked as
external data at the location ``DETACHED``, and its values live in a ``Weights`` store (name -> numpy
array). Arrays read from an external-data file are memory-mapped, so nothing is read until it is used.
Every pass reads only types and shapes, so the whole pipeline runs on light models, and the bytes meet
the model again only in the runtime (as OrtValues) or on disk (as an external-data file). A protobuf
message cannot exceed 2 GiB and every copy or check of a model serializes it, which is why the bytes
never travel inside one.

``split_model`` makes a light copy without copying the large tensors' bytes into another message
(upb frees a message's memory only with the whole message, so copy-then-clear would keep them);
``attach_weights`` puts the bytes back; ``checkable`` is a copy onnx.checker accepts (detached
tensors become typed graph inputs; onnxruntime-only ops and the model builder's stale declarations are set
aside).
"""
from __future__ import annotations

import math
import mmap
import os

import numpy as np
import onnx
from onnx import TensorProto, external_data_helper, helper, numpy_helper

from ..errors import ModelFileError, OutsideFolderError
from ..graph import FLOAT_TYPES, top_graphs
from .packed import is_packed, pack, stored_size, type_name, unpack

DETACHED = "onnx-autodiff:detached"  # the external-data location of a tensor whose bytes are in a Weights store
MIN_BYTES = 1024  # float tensors of at least this size leave the protobuf
DETACHED_FLOATS = FLOAT_TYPES - {TensorProto.BFLOAT16}  # float types split_model detaches (numpy has no bfloat16)
# integer types split_model detaches from MIN_INTEGER_BYTES on: large integer weights (MatMulNBits' codes, the int8
# backward's columns) would otherwise ride inline in every copy and serialization of the model; the threshold is
# far above the shape and index constants the passes read by value (a detached tensor is no constant to them)
DETACHED_INTEGERS = frozenset({TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16, TensorProto.UINT16,
                               TensorProto.INT32, TensorProto.UINT32, TensorProto.INT64, TensorProto.UINT64})
MIN_INTEGER_BYTES = 1 << 16
_DATA_FIELDS = {"raw_data", "float_data", "int32_data", "string_data", "int64_data", "double_data",
                "uint64_data", "data_location", "external_data"}
_NO_COPY = {"graph": {"initializer"}, "model": {"graph", "training_info"}}

Weights = dict  # name -> numpy array (C order, the tensor's dtype and dims)


class FreshZeros(np.ndarray):
    """An array known to hold zeros because we made it so (``fresh_zeros``): whoever needs to know whether
    it is all zero asks ``is_fresh_zeros`` instead of reading it (reading zero pages makes them resident)."""


def fresh_zeros(shape, dtype) -> FreshZeros:
    """Zeros that cost no memory until written (the optimizer's fresh state): an anonymous mapping of zero
    pages, marked ``FreshZeros``. ``np.zeros`` of a mid-size array may come from the heap and be cleared page
    by page once a large model's parse has raised glibc's mmap threshold, and reading a zero page makes it
    resident too (BERT-base: 440 MB of Adam moments resident before a step wrote one)."""
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize
    if size < (1 << 16):
        return np.zeros(shape, dtype).view(FreshZeros)
    return np.frombuffer(mmap.mmap(-1, size), dtype=dtype).reshape(tuple(shape)).view(FreshZeros)


def is_fresh_zeros(array) -> bool:
    return isinstance(array, FreshZeros)


def owned_copy(array) -> np.ndarray:
    """A writable C-order copy of ``array`` that only we hold (the first buffer of a tensor a step updates in
    place). A large one goes into an anonymous mapping populated in one call (``MAP_POPULATE``: 4 KiB pages
    the kernel hands over at once, where a copy into numpy's own allocation takes them one fault at a time, as
    transparent huge pages numpy advises, whose cost depends on the machine's memory at that moment: BERT-base's
    438 MB took 0.46-0.94 CPU s that way and 0.22-0.23 s this way, docs/benchmarks.md "BERT-base set-up (sixth
    session)"). A read-only memory map's bytes are copied from the map itself, so a file replaced since it was
    mapped is not read."""
    src = np.asarray(array)
    if src.nbytes < (1 << 16) or not hasattr(mmap, "MAP_POPULATE"):
        return np.array(src, order="C")
    buf = mmap.mmap(-1, src.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    out = np.frombuffer(buf, dtype=src.dtype).reshape(src.shape)
    np.copyto(out, src)
    return out


def is_detached(t: onnx.TensorProto) -> bool:
    return t.data_location == TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == DETACHED for e in t.external_data)


def mark_detached(t: onnx.TensorProto) -> None:
    """Turn ``t`` (a tensor without bytes) into a placeholder for an array of the Weights store."""
    t.data_location = TensorProto.EXTERNAL
    del t.external_data[:]
    t.external_data.add(key="location", value=DETACHED)


def detach_tensor(t: onnx.TensorProto) -> None:
    """Drop ``t``'s bytes (inline or external) and mark it detached: its value comes from a Weights store."""
    for f in _DATA_FIELDS:
        t.ClearField(f)
    mark_detached(t)


def placeholder(name: str, array: np.ndarray) -> onnx.TensorProto:
    """A detached initializer for ``array`` (its type and shape, no bytes)."""
    t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=list(array.shape))
    mark_detached(t)
    return t


def _repeated(field) -> bool:
    flag = getattr(field, "is_repeated", None)  # protobuf >= 5; older ones only have ``label``
    return flag if flag is not None else field.label == field.LABEL_REPEATED


def _copy_fields(dst, src, skip: set[str]) -> None:
    for field, value in src.ListFields():
        if field.name in skip:
            continue
        if _repeated(field):
            getattr(dst, field.name).extend(value)
        elif field.type == field.TYPE_MESSAGE:
            getattr(dst, field.name).CopyFrom(value)
        else:
            setattr(dst, field.name, value)


def _nbytes(t: onnx.TensorProto) -> int:
    """From dims and type, as stored (packed types packed): reading ``raw_data`` would copy the bytes (math.prod:
    numpy's costs more than the rest of the split, once per initializer)."""
    return stored_size(t.data_type, math.prod(t.dims))


def inside(folder: str, location: str, what: str) -> str:
    """The path of ``location`` (a file another file names) when it resolves inside ``folder``, symlinks
    followed; ``OutsideFolderError`` naming ``what`` (the tensor or field) for ``..``, an absolute path or a
    symlink that leaves it."""
    if not location or os.path.isabs(location) or os.path.splitdrive(location)[0]:
        raise OutsideFolderError(f"{what} names {location!r}: an absolute path; a file may only name files in its "
                                 f"own folder ({folder!r})")
    root = os.path.realpath(folder)
    path = os.path.realpath(os.path.join(root, location))
    if os.path.commonpath([root, path]) != root:
        raise OutsideFolderError(f"{what} names {location!r}, which resolves to {path!r}, outside the folder of the "
                                 f"file that names it ({root!r})")
    return path


def _external_array(t: onnx.TensorProto, base_dir: str | None) -> np.ndarray:
    """A read-only memory map of an external-data tensor (its file inside ``base_dir``); a tensor of a packed type
    (int4, ...: ``packed.py``) is read and unpacked, one element a byte."""
    info = external_data_helper.ExternalDataInfo(t)
    path = inside(base_dir, info.location, f"initializer {t.name!r}")
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
    shape = tuple(t.dims)
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    needed = stored_size(t.data_type, count)
    if info.length is not None and int(info.length) != needed:
        raise ModelFileError(f"initializer {t.name!r}: its external data is {info.length} bytes long, but "
                             f"{count} element(s) of {type_name(t.data_type)} take {needed}; the model file is "
                             "damaged or was written by a tool that sizes this type otherwise",
                             hint="re-export the model (onnx.save writes the right length)")
    try:
        size = os.path.getsize(path)
    except OSError:
        raise ModelFileError(f"initializer {t.name!r}: its external-data file {path!r} is missing; keep the "
                             ".data file(s) next to the model file (onnx's external data is located relative "
                             "to the model)") from None
    offset = int(info.offset or 0)
    if offset + needed > size:
        raise ModelFileError(f"initializer {t.name!r}: {path!r} holds {size} bytes, the tensor needs "
                             f"{needed} at offset {offset}; the data file does not belong to "
                             "this model or was cut short")
    if count == 0:
        return np.zeros(shape, dtype)
    if is_packed(t.data_type):
        with open(path, "rb") as f:
            f.seek(offset)
            return unpack(f.read(needed), t.data_type, shape)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


def detached_inline(data_type: int, nbytes: int, min_bytes: int = MIN_BYTES) -> bool:
    """Whether an inline tensor of ``data_type`` and ``nbytes`` stored bytes leaves the protobuf: a float one of at
    least ``min_bytes``, an integer one (not packed) of at least ``max(min_bytes, MIN_INTEGER_BYTES)``."""
    if data_type in DETACHED_FLOATS:
        return nbytes >= min_bytes
    return data_type in DETACHED_INTEGERS and nbytes >= max(min_bytes, MIN_INTEGER_BYTES)


def _detachable(t: onnx.TensorProto, base_dir: str | None, min_bytes: int) -> bool:
    if t.data_location == TensorProto.EXTERNAL:
        return base_dir is not None  # without the directory it stays a reference to its file
    return detached_inline(t.data_type, _nbytes(t), min_bytes)


def array_of(t: onnx.TensorProto) -> np.ndarray:
    # a view of one bytes copy (numpy_helper.to_array would copy twice); packed types unpack (packed.py)
    if t.HasField("raw_data") and not is_packed(t.data_type):
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).newbyteorder("<")
        return np.frombuffer(t.raw_data, dtype=dtype).reshape(tuple(t.dims))
    return numpy_helper.to_array(t)


def _split_graph(src: onnx.GraphProto, dst: onnx.GraphProto, weights: Weights, base_dir: str | None,
                 min_bytes: int) -> None:
    _copy_fields(dst, src, _NO_COPY["graph"])
    for t in src.initializer:
        if is_detached(t) or not _detachable(t, base_dir, min_bytes):
            dst.initializer.add().CopyFrom(t)
            continue
        weights[t.name] = (_external_array(t, base_dir) if t.data_location == TensorProto.EXTERNAL
                           else array_of(t))
        light = dst.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
        if t.HasField("doc_string"):
            light.doc_string = t.doc_string
        if t.HasField("segment"):
            light.segment.CopyFrom(t.segment)
        mark_detached(light)


def split_model(model: onnx.ModelProto, base_dir: str | None = None,
                min_bytes: int = MIN_BYTES) -> tuple[onnx.ModelProto, Weights]:
    """A light copy of ``model`` and the arrays of its large float and integer initializers (``detached_inline``)
    and of every external tensor (memory-mapped from ``base_dir``, the model file's directory; without it, external
    tensors stay references to their files). The input is not changed. Tensors already detached stay detached
    (their arrays are wherever the caller keeps them)."""
    weights: Weights = {}
    out = onnx.ModelProto()
    _copy_fields(out, model, _NO_COPY["model"])
    _split_graph(model.graph, out.graph, weights, base_dir, min_bytes)
    for ti in model.training_info:
        new = out.training_info.add()
        _copy_fields(new, ti, {"initialization", "algorithm"})
        if ti.HasField("initialization"):
            _split_graph(ti.initialization, new.initialization, weights, base_dir, min_bytes)
        if ti.HasField("algorithm"):
            _split_graph(ti.algorithm, new.algorithm, weights, base_dir, min_bytes)
    return out, weights


def set_tensor_bytes(t: onnx.TensorProto, array: np.ndarray) -> None:
    """Store ``array`` inline in ``t`` (raw_data, little-endian), dropping any external-data marks."""
    arr = np.asarray(array)
    want = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).newbyteorder("<")
    if tuple(arr.shape) != tuple(t.dims) or arr.dtype.newbyteorder("<") != want:
        raise ValueError(f"tensor {t.name!r}: the array is {arr.dtype} {arr.shape}, the model declares "
                         f"{want} {tuple(t.dims)}")
    t.ClearField("data_location")
    del t.external_data[:]
    if is_packed(t.data_type):
        t.raw_data = pack(arr)
    elif isinstance(arr.base, bytes) and arr.dtype == want and arr.flags.c_contiguous and arr.nbytes == len(arr.base):
        t.raw_data = arr.base  # the bytes it was read from: one copy fewer
    else:
        t.raw_data = np.ascontiguousarray(arr, dtype=want).tobytes()


def attach_weights(model: onnx.ModelProto, weights) -> None:
    """Put the arrays of ``weights`` (a mapping) back into the detached tensors of ``model``, in place.
    Detached tensors without an entry stay detached."""
    for g in top_graphs(model):
        for t in g.initializer:
            if is_detached(t) and t.name in weights:
                set_tensor_bytes(t, weights[t.name])


def _elsewhere(t: onnx.TensorProto) -> bool:
    return t.data_location == TensorProto.EXTERNAL


# default-domain ops that onnxruntime defines and onnx does not (onnxruntime-genai's model builder emits it):
# onnx.checker knows no schema for them, so the checking copy moves them to onnxruntime's own domain
ONNXRUNTIME_DEFAULT_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization"})
_ORT_DOMAIN = "com.microsoft"


def checkable(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` itself when onnx.checker takes it as it is, else a copy it takes: every detached or external
    initializer becomes a graph input of its type and shape (the checker would look for its file), each
    op of ``ONNXRUNTIME_DEFAULT_DOMAIN_OPS`` is moved to com.microsoft (where the checker does not look
    for schemas), and a value_info that gives a Constant's output another shape than its value is dropped
    (the builder declares its ``[1]`` constants as scalars; the value is what runs)."""
    ort_ops = any(n.op_type in ONNXRUNTIME_DEFAULT_DOMAIN_OPS and n.domain in ("", "ai.onnx")
                  for g in top_graphs(model) for n in g.node)
    stale = any(_stale_constant_infos(g) for g in top_graphs(model))
    if not ort_ops and not stale and not any(_elsewhere(t) for g in top_graphs(model) for t in g.initializer):
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for g in top_graphs(m):
        _set_ort_ops_aside(m, g)
        drop = _stale_constant_infos(g)
        if drop:
            keep_infos = [vi for vi in g.value_info if vi.name not in drop]
            del g.value_info[:]
            g.value_info.extend(keep_infos)
        gone = [t for t in g.initializer if _elsewhere(t)]
        if not gone:
            continue
        keep = [t for t in g.initializer if not _elsewhere(t)]
        del g.initializer[:]
        g.initializer.extend(keep)
        inputs = {i.name for i in g.input}
        g.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in gone
                       if t.name not in inputs)
    return m


def _set_ort_ops_aside(m: onnx.ModelProto, g: onnx.GraphProto) -> None:
    moved = False
    for n in g.node:
        if n.op_type in ONNXRUNTIME_DEFAULT_DOMAIN_OPS and n.domain in ("", "ai.onnx"):
            n.domain = _ORT_DOMAIN
            moved = True
    if moved and not any(o.domain == _ORT_DOMAIN for o in m.opset_import):
        m.opset_import.append(helper.make_opsetid(_ORT_DOMAIN, 1))


def _stale_constant_infos(g: onnx.GraphProto) -> set[str]:
    """Names of Constant outputs whose value_info declares a shape other than the value's."""
    dims = {}
    for n in g.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            value = next((a.t for a in n.attribute if a.name == "value"), None)
            if value is not None:
                dims[n.output[0]] = list(value.dims)
    stale = set()
    for vi in g.value_info:
        if vi.name in dims and vi.type.tensor_type.HasField("shape"):
            declared = vi.type.tensor_type.shape.dim
            if len(declared) != len(dims[vi.name]) or any(
                    d.HasField("dim_value") and d.dim_value != v for d, v in zip(declared, dims[vi.name])):
                stale.add(vi.name)
    return stale


def check_model(model: onnx.ModelProto) -> None:
    """onnx.checker full_check of a light or full model."""
    onnx.checker.check_model(checkable(model), full_check=True)


__all__ = ["Weights", "DETACHED", "DETACHED_FLOATS", "DETACHED_INTEGERS", "MIN_BYTES", "MIN_INTEGER_BYTES",
           "detached_inline", "split_model", "detach_tensor", "attach_weights",
           "checkable", "check_model", "is_detached", "mark_detached", "placeholder", "set_tensor_bytes",
           "array_of", "inside", "fresh_zeros", "is_fresh_zeros", "FreshZeros", "owned_copy"]
