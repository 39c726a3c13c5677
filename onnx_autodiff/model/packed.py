"""Tensors of fewer than 8 bits an element, which onnx stores packed (``raw_data`` and external data alike): 4-bit
types two a byte, 2-bit four a byte, 6-bit four in three bytes, the low bits first. numpy (ml_dtypes) holds them one
element a byte, so a tensor's bytes on disk are not its array's ``nbytes``: every reader and writer of tensor bytes
sizes them with ``stored_size`` and converts with ``unpack`` / ``pack`` (onnx's own packing, ``numpy_helper``)."""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# bits an element of each packed type this onnx has (int2/uint2 from onnx 1.19, float6 from 1.23)
BITS = {getattr(TensorProto, name): bits for name, bits in (
    ("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4), ("INT2", 2), ("UINT2", 2), ("FLOAT6E2M3", 6), ("FLOAT6E3M2", 6))
    if hasattr(TensorProto, name)}


def is_packed(data_type: int) -> bool:
    return data_type in BITS


def stored_size(data_type: int, count: int) -> int:
    """Bytes ``count`` elements of ``data_type`` take in a tensor's raw_data or external data."""
    if data_type in BITS:
        return math.ceil(count * BITS[data_type] / 8)
    return count * np.dtype(helper.tensor_dtype_to_np_dtype(data_type)).itemsize


def stored_nbytes(array: np.ndarray) -> int:
    """Bytes ``array`` takes stored in an ONNX tensor (its ``nbytes`` unless its type is packed)."""
    arr = np.asarray(array)
    try:
        data_type = helper.np_dtype_to_tensor_dtype(arr.dtype)
    except (KeyError, ValueError, TypeError):
        return int(arr.nbytes)
    return stored_size(data_type, int(arr.size)) if data_type in BITS else int(arr.nbytes)


def unpack(data, data_type: int, dims) -> np.ndarray:
    """The array of packed ``data`` (bytes of a tensor of ``data_type`` and ``dims``), one element a byte."""
    t = TensorProto(data_type=data_type, dims=list(dims), raw_data=bytes(data))
    return numpy_helper.to_array(t)


def pack(array: np.ndarray) -> bytes:
    """The packed bytes of ``array`` (of a packed type), as raw_data and external data hold them."""
    return numpy_helper.from_array(np.ascontiguousarray(array)).raw_data


def type_name(data_type: int) -> str:
    return onnx.TensorProto.DataType.Name(data_type)


__all__ = ["BITS", "is_packed", "stored_size", "stored_nbytes", "unpack", "pack", "type_name"]
