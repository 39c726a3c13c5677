"""Mixed precision's way out: each ``Cast(W.fp32)`` that training/precision.py put in place of a float16 /
bfloat16 weight ``W`` becomes the initializer ``W`` again, in the model's type, from the trained float32 master
(the first pass of the inference export), so the exported model has the original precision and names."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..model import metadata
from ..model.weights import is_detached, placeholder
from ..training.lora.merge import MergedWeights


def np_type(dtype: int):
    return ml_dtypes.bfloat16 if dtype == TensorProto.BFLOAT16 else helper.tensor_dtype_to_np_dtype(dtype)


def tensor_of(name: str, arr: np.ndarray, dtype: int) -> onnx.TensorProto:
    """An inline initializer of ``arr`` as ``dtype`` (bfloat16 written from its raw bits)."""
    if dtype == TensorProto.BFLOAT16:
        bits = np.ascontiguousarray(arr.astype(ml_dtypes.bfloat16)).view(np.uint16)
        return helper.make_tensor(name, dtype, list(arr.shape), bits.tobytes(), raw=True)
    return numpy_helper.from_array(np.ascontiguousarray(arr.astype(np_type(dtype))), name)


def masters_to_weights(model: onnx.ModelProto, ctx) -> bool:
    """Every recorded master folded back into its weight (``ctx.arrays`` gets the new values); our record goes."""
    record = metadata.read_json(model, metadata.PRECISION)
    if not record or not record.get("masters"):
        return False
    g = model.graph
    casts = {n.output[0]: n for n in g.node if n.op_type == "Cast"}
    inits = {t.name: t for t in g.initializer}
    merged, drop = {}, set()
    for weight, master in record["masters"].items():
        node, t = casts.get(weight), inits.get(master)
        if node is None or t is None:
            continue
        dtype = next(a.i for a in node.attribute if a.name == "to")
        value = np.asarray(ctx.arrays[master]) if is_detached(t) else numpy_helper.to_array(t)
        arr = np.ascontiguousarray(value.astype(np.float32).astype(np_type(dtype)))
        if dtype == TensorProto.BFLOAT16:
            g.initializer.append(tensor_of(weight, arr, dtype))
        else:
            g.initializer.append(placeholder(weight, arr))
            merged[weight] = arr
        g.node.remove(node)
        drop.add(master)
    keep = [t for t in g.initializer if t.name not in drop]
    del g.initializer[:]
    g.initializer.extend(keep)
    ctx.arrays = MergedWeights(ctx.arrays, merged)
    metadata.drop(model, [metadata.PRECISION])
    return True


__all__ = ["masters_to_weights", "np_type", "tensor_of"]
