"""Training data for the ``train`` command: an .npz mapped onto the step's inputs and checked before the
first step, so a bad array is named in one line instead of failing inside onnxruntime (or training on
garbage without a word).

Checks: every input has an array (by name, or X / y), dtype and shape agree with the input, every float
array is finite, and class labels of a cross-entropy / NLL loss lie in ``0..C-1`` (or equal the loss's
``ignore_index``).
"""
from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper

from ..errors import DataError

_CLASS_LOSSES = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
_NPZ_HINT = "write it with numpy.savez(path, X=..., y=...) or with arrays named like the model inputs"


def load_npz(path: str) -> dict[str, np.ndarray]:
    if not os.path.exists(path):
        raise DataError(f"data file {path!r} does not exist", "pass an .npz written by numpy.savez")
    if not zipfile.is_zipfile(path):
        raise DataError(f"{path!r} is not a NumPy .npz archive", _NPZ_HINT)
    try:
        with np.load(path, allow_pickle=False) as z:
            if not hasattr(z, "files"):
                raise ValueError("a single array, not an archive")
            return {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{path!r} is not a NumPy .npz archive ({text})", _NPZ_HINT) from e


def input_types(model: onnx.ModelProto) -> dict[str, tuple[int, list | None]]:
    """Input name -> (element type, dims with None for a symbolic or unknown dim)."""
    out = {}
    for vi in model.graph.input:
        tt = vi.type.tensor_type
        dims = ([d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim] if tt.HasField("shape")
                else None)
        out[vi.name] = (tt.elem_type, dims)
    return out


def _shown(dims: list) -> str:
    return "[" + ", ".join("N" if k == 0 and d is None else ("?" if d is None else str(d))
                           for k, d in enumerate(dims)) + "]"


def map_data(trainer, data: dict[str, np.ndarray], lr_input: str | None, record: dict | None) -> dict[str, np.ndarray]:
    """Arrays for every data input of the step: by name, or X -> the first model input and y -> the label (the
    first label input of the training model); converted to the input's dtype where that loses nothing, with the
    shape and sample count checked. ``trainer``: a ``TrainingSession`` or a ``BundleTrainer``, which both give
    ``feed_names``, ``model`` (the training model), ``index`` and ``step_model`` (``fit.Trainer``): one check for
    every runtime."""
    needed = [n for n in trainer.feed_names if n != lr_input]
    model = trainer.model
    inference_inputs = [i.name for i in model.graph.input
                        if i.name not in {t.name for t in model.graph.initializer}]
    labels = (record or {}).get("labels") or [i.name for i in model.training_info[trainer.index].algorithm.input
                                              if i.name != lr_input]
    aliases = {}
    if inference_inputs:
        aliases[inference_inputs[0]] = "X"
    if labels:
        aliases[labels[0]] = "y"
    mapped, source = {}, {}
    for name in needed:
        if name in data:
            mapped[name], source[name] = data[name], name
        elif aliases.get(name) in data:
            mapped[name], source[name] = data[aliases[name]], aliases[name]
        else:
            alias = f" (or {aliases[name]!r})" if name in aliases else ""
            raise DataError(f"the data has no array for input {name!r}{alias}; it has {sorted(data)}",
                            f"name the arrays after the inputs {needed}, or X / y for the first input and the label")
    types = input_types(trainer.step_model)
    n = None
    for name, arr in mapped.items():
        elem, dims = types[name]
        what = _what(name, source[name])
        want = helper.tensor_dtype_to_np_dtype(elem)
        if arr.dtype.kind not in "biuf":
            raise DataError(f"data array {what} is {arr.dtype}, the input needs {want}",
                            f"store numbers: convert it with .astype(np.{want.name})")
        if dims is not None and (arr.ndim != len(dims) or any(d and d != s for d, s in zip(dims[1:], arr.shape[1:]))):
            raise DataError(f"data array {what} has shape {list(arr.shape)}, the input needs {_shown(dims)}",
                            "the first axis is the sample axis; reshape the array or rebuild the model "
                            "with another label")
        arr = _converted(arr, want, what)
        if n is None:
            n = len(arr) if arr.ndim else 0
        elif arr.ndim == 0 or len(arr) != n:
            raise DataError(f"data arrays disagree on the number of samples ({n} vs "
                            f"{len(arr) if arr.ndim else 'a scalar'} for {what})",
                            "every array needs the samples on its first axis")
        mapped[name] = np.ascontiguousarray(arr)
    if not n:
        raise DataError("the data holds no samples", "check the arrays in the .npz")
    check_finite(mapped, source)
    check_labels(model, mapped, source, trainer.index)
    return mapped


def _converted(arr: np.ndarray, want: np.dtype, what: str) -> np.ndarray:
    """``arr`` as ``want`` where that loses nothing (whole-number floats for class indices included)."""
    if arr.dtype == want:
        return arr
    if want.kind in "iub" and arr.dtype.kind == "f":
        if np.all(np.isfinite(arr)) and np.array_equal(arr, np.round(arr)):
            return arr.astype(want)
        raise DataError(f"data array {what} holds fractional or non-finite values, the input needs "
                        f"{want} (class indices)", f"store whole numbers: .astype(np.{want.name})")
    if np.can_cast(arr.dtype, want, casting="same_kind") or (arr.dtype.kind in "iub" and want.kind in "iuf"):
        return arr.astype(want)
    raise DataError(f"data array {what} is {arr.dtype}, the input needs {want}",
                    f"convert it with .astype(np.{want.name})")


def _what(name: str, source: str) -> str:
    return repr(name) if name == source else f"{source!r} (input {name!r})"


def check_finite(arrays: Mapping[str, np.ndarray], source: dict[str, str] | None = None,
                 what: str = "data array") -> None:
    """A NaN or Inf in the data is the data's fault: say so before the first step, not as a divergence.
    ``what``: how the message calls an array (``fit``: a data array; ``TrainingSession.step``: a feed)."""
    for name, arr in arrays.items():
        if arr.dtype.kind != "f":
            continue
        bad = ~np.isfinite(arr)
        if bad.any():
            first = int(np.argwhere(bad.reshape(len(arr), -1).any(axis=1))[0][0]) if arr.ndim else 0
            kinds = " and ".join(k for k, m in (("NaN", np.isnan(arr)), ("Inf", np.isinf(arr))) if m.any())
            raise DataError(
                f"{what} {_what(name, (source or {}).get(name, name))} holds {int(bad.sum())} {kinds} "
                f"value(s), the first in sample {first}",
                "clean or drop those samples (numpy.isfinite finds them) before training")


def class_losses(model: onnx.ModelProto, index: int = 0) -> list[tuple[str, int | None, int | None]]:
    """(label input, class count or None, ignore_index or None) for each cross-entropy / NLL loss of the
    training model (its graph and ``training_info[index]``'s algorithm, lowered or not) whose labels are an
    input. Read off the training model, not a runtime's step (whose step fixes may have decomposed the loss),
    so every runtime checks the same labels."""
    algorithm = model.training_info[index].algorithm if index < len(model.training_info) else onnx.GraphProto()
    nodes = list(model.graph.node) + list(algorithm.node)
    inputs = {i.name for i in model.graph.input} | {i.name for i in algorithm.input}
    found = [k for k, n in enumerate(nodes) if n.op_type in _CLASS_LOSSES and len(n.input) > 1 and n.input[1] in inputs]
    if not found:
        return []
    infos = _shapes(model, algorithm, nodes[len(model.graph.node):found[-1] + 1])
    out = []
    for node in (nodes[k] for k in found):
        vi = infos.get(node.input[0])
        classes = None
        if vi is not None and vi.type.tensor_type.HasField("shape") and len(vi.type.tensor_type.shape.dim) > 1:
            d = vi.type.tensor_type.shape.dim[1]
            classes = d.dim_value if d.HasField("dim_value") else None
        ignore = next((a.i for a in node.attribute if a.name == "ignore_index"), None)
        out.append((node.input[1], classes, ignore))
    return out


def _shapes(model: onnx.ModelProto, algorithm: onnx.GraphProto, nodes: list) -> dict[str, onnx.ValueInfoProto]:
    """Inferred value infos of the inference graph followed by the algorithm's ``nodes`` up to the last loss."""
    m = onnx.ModelProto()
    m.CopyFrom(model)  # a light model: graphs and small tensors only
    del m.training_info[:]
    known = {i.name for i in m.graph.input}
    m.graph.node.extend(nodes)
    m.graph.input.extend(i for i in algorithm.input if i.name not in known)
    m.graph.initializer.extend(algorithm.initializer)
    try:
        inferred = onnx.shape_inference.infer_shapes(m)
    except Exception:  # noqa: BLE001 - shape inference is a help here, not a requirement
        return {}
    return {vi.name: vi for vi in list(inferred.graph.value_info) + list(inferred.graph.output)
            + list(inferred.graph.input)}


def check_labels(model: onnx.ModelProto, arrays: dict[str, np.ndarray],
                 source: dict[str, str] | None = None, index: int = 0) -> None:
    """Class labels in 0..C-1 (or the loss's ignore_index); one-based labels are called that. ``model``: the
    training model (``class_losses``)."""
    for label, classes, ignore in class_losses(model, index):
        arr = arrays.get(label)
        if arr is None or arr.dtype.kind not in "iu":
            continue
        what = _what(label, (source or {}).get(label, label))
        valid = arr >= 0 if classes is None else (arr >= 0) & (arr < classes)
        if ignore is not None:
            valid |= arr == ignore
        if valid.all():
            continue
        bad = arr[~valid]
        first = int(np.argwhere((~valid).reshape(len(arr), -1).any(axis=1))[0][0])
        span = f"0..{classes - 1}" if classes else "0 or more"
        also = f" or the ignore_index {ignore}" if ignore is not None else ""
        if classes and arr.min() == 1 and arr.max() == classes:
            raise DataError(f"labels {what} run from 1 to {classes}, but the model has {classes} classes "
                            f"numbered 0..{classes - 1}: they look one-based", "subtract 1 from the labels")
        raise DataError(f"labels {what} hold {bad.size} value(s) outside {span}{also}, e.g. {int(bad[0])} in "
                        f"sample {first}",
                        f"labels are class indices 0..C-1 (C = {classes or 'the model output size'}); "
                        "drop those samples or fix the labels")


__all__ = ["load_npz", "map_data", "check_finite", "check_labels", "class_losses", "input_types"]
