"""Mixed precision: a float16 or bfloat16 model trains with float32 master copies of what it trains, float32
optimizer state and dynamic loss scaling, in standard ONNX (docs/training.md, "Mixed precision").

* **Masters.** Each trained initializer ``W`` of the low-precision type becomes ``Cast(W.fp32)`` in the inference
  graph: the float32 ``W.fp32`` is what trains (its gradient, optimizer state and update are float32), the
  forward and backward read ``W`` in the model's type as before. Frozen weights stay as they are.
* **Loss in float32.** The outputs the loss reads are cast to float32 first (as autocast runs softmax and
  cross-entropy in float32): a float16 loss of a 1000-token vocabulary (~7) keeps 3 digits.
* **Loss scaling.** The Gradient differentiates ``loss * scale``; the gradients are unscaled in float32; a step
  whose gradients hold an Inf or NaN changes no weight, no optimizer state and no step count, and halves the
  scale (``backoff_factor``); after ``growth_interval`` clean steps in a row the scale doubles
  (``growth_factor``), as ``torch.amp.GradScaler`` does, with its defaults. The step outputs ``loss_scale`` (the
  scale it used) and ``step_skipped``.
* **Out.** ``masters_to_weights`` (passes/master_weights.py) turns every ``Cast(W.fp32)`` back into an
  initializer ``W`` of the model's type: the exported model has the original precision and names.

``precision="fp16" | "bf16"`` on a float32 model first converts the model to that type (``convert_model``:
weights, constants, casts and declared types); the masters are then the float32 weights themselves.
"""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import TrainingBuilderError
from ..graph import walk_graph
from ..model import metadata
from ..model.weights import is_detached, placeholder
from ..passes.master_weights import np_type, tensor_of
from .nodes import GraphBuilder
from .options import Precision

TYPES = {"fp16": TensorProto.FLOAT16, "float16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16,
         "bfloat16": TensorProto.BFLOAT16}
LOW = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
_SHAPE_FLOATS = {("Resize", 1), ("Resize", 2), ("Upsample", 1)}  # float inputs that must stay float32
_DTYPE_ATTRS = ("to", "dtype", "output_dtype")


def tensor_array(t: onnx.TensorProto, arrays) -> np.ndarray:
    """The values of initializer ``t`` (from ``arrays`` when detached); bfloat16 as ml_dtypes' type."""
    if is_detached(t):
        return np.asarray(arrays[t.name])
    arr = numpy_helper.to_array(t)
    if t.data_type == TensorProto.BFLOAT16 and arr.dtype != ml_dtypes.bfloat16:
        arr = arr.view(ml_dtypes.bfloat16) if arr.dtype.itemsize == 2 else arr.astype(ml_dtypes.bfloat16)
    return arr


def resolve(precision, model: onnx.ModelProto, trainable: list[str]) -> Precision | None:
    """The precision to train in: the one asked (a name or a ``Precision``), else the model's own when what it
    trains is float16 / bfloat16 (such a model's optimizer state cannot be kept in its own type: Adam's epsilon
    1e-8 is 0 in float16), else None (float32: nothing to do)."""
    if precision is None:
        types = {t.data_type for t in model.graph.initializer if t.name in set(trainable)} & set(LOW)
        if not types:
            return None
        if len(types) > 1:
            raise TrainingBuilderError("precision", "the trained tensors mix float16 and bfloat16; pass precision=")
        precision = "fp16" if types.pop() == TensorProto.FLOAT16 else "bf16"
    if isinstance(precision, str):
        precision = Precision(precision)
    if not isinstance(precision, Precision):
        raise TrainingBuilderError("precision", f"'fp16', 'bf16' or a Precision, got {type(precision).__name__}")
    if precision.dtype not in TYPES:
        raise TrainingBuilderError("precision", f"dtype must be 'fp16' or 'bf16', got {precision.dtype!r}")
    scale = precision.loss_scale
    if not (scale in ("auto", "dynamic", None) or (isinstance(scale, (int, float)) and scale > 0)):
        raise TrainingBuilderError("precision", f"loss_scale must be 'dynamic', a positive number or None, "
                                                f"got {scale!r}")
    return precision


def dynamic_scaling(precision: Precision) -> bool:
    """Whether the loss scale adapts: float16's default (its range ends at 65504); bfloat16 has float32's range."""
    scale = precision.loss_scale
    return scale == "dynamic" or (scale == "auto" and TYPES[precision.dtype] == TensorProto.FLOAT16)


def scales_loss(precision: Precision) -> bool:
    """Whether the loss is scaled at all: dynamically, or by a fixed scale other than 1."""
    scale = precision.loss_scale
    return dynamic_scaling(precision) or (isinstance(scale, (int, float)) and scale != 1)


def model_float_type(model: onnx.ModelProto) -> int | None:
    """The float type of the model's weights (the type of most of its float bytes)."""
    sizes: dict[int, int] = {}
    for t in model.graph.initializer:
        if t.data_type in (TensorProto.FLOAT, *LOW):
            sizes[t.data_type] = sizes.get(t.data_type, 0) + (int(np.prod(t.dims)) if t.dims else 1)
    return max(sizes, key=sizes.get) if sizes else None


def convert_model(model: onnx.ModelProto, arrays: dict, dtype: int) -> dict[str, np.ndarray]:
    """The float32 model computing in ``dtype`` instead, in place: float32 initializers (values in ``arrays`` when
    detached), constants, casts to float32, dtype attributes and declared types (graph inputs, outputs, value
    infos) become ``dtype``. Float tensors that ops read as sizes (Resize's scales) stay float32. Returns the
    float32 values of the converted initializers (the masters start from them, not from their rounding)."""
    originals = {}
    keep = {n.input[k] for g in walk_graph(model.graph) for n in g.node for (op, k) in _SHAPE_FLOATS
            if n.op_type == op and k < len(n.input)}
    for g in walk_graph(model.graph):
        for t in g.initializer:
            if t.data_type != TensorProto.FLOAT or t.name in keep:
                continue
            originals[t.name] = tensor_array(t, arrays)
            arr = originals[t.name].astype(np.float32).astype(np_type(dtype))
            if is_detached(t) and dtype == TensorProto.FLOAT16:
                arrays[t.name] = arr
                t.data_type = dtype
            else:
                arrays.pop(t.name, None)
                t.CopyFrom(tensor_of(t.name, arr, dtype))
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT \
                        and not set(n.output) & keep:
                    a.t.CopyFrom(tensor_of(a.t.name, numpy_helper.to_array(a.t), dtype))
                elif a.type == onnx.AttributeProto.INT and a.name in _DTYPE_ATTRS and a.i == TensorProto.FLOAT:
                    a.i = dtype
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            tt = vi.type.tensor_type
            if vi.type.HasField("tensor_type") and tt.elem_type == TensorProto.FLOAT and vi.name not in keep:
                tt.elem_type = dtype
    return originals


def add_masters(model: onnx.ModelProto, arrays: dict, names: list[str], dtype: int, taken: set[str],
                originals: dict | None = None) -> tuple[list[str], dict[str, str]]:
    """Each initializer of ``names`` in ``dtype`` becomes ``Cast(<name>.fp32)`` (the float32 master, an initializer
    with its values, or with the float32 ones in ``originals`` that it was converted from); returns the trained
    names (masters in their place) and {weight: master}."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    masters, trained, casts = {}, [], []
    for name in names:
        t = inits[name]
        if t.data_type != dtype:
            trained.append(name)
            continue
        master = name + ".fp32"
        k = 0
        while master in taken:
            master, k = f"{name}.fp32_{k}", k + 1
        taken.add(master)
        source = (originals or {}).get(name)
        arr = np.ascontiguousarray((source if source is not None else tensor_array(t, arrays)).astype(np.float32))
        arrays[master] = arr
        arrays.pop(name, None)
        g.initializer.remove(t)
        g.initializer.append(placeholder(master, arr))
        node = f"{name}/from_master"
        casts.append(helper.make_node("Cast", [master], [name], name=node, to=dtype))
        taken.add(node)
        masters[name] = master
        trained.append(master)
    for k, n in enumerate(casts):
        g.node.insert(k, n)
    return trained, masters


def loss_outputs_in_float32(b: GraphBuilder, names: list[str]) -> dict[str, str]:
    """{output: its float32 cast}, the tensors the loss reads."""
    return {o: b.Cast(o, to=TensorProto.FLOAT) for o in names}


class Scaler:
    """The loss-scaling nodes of one algorithm: ``scaled(loss)`` before the Gradient, ``unscaled(grad)`` after it,
    ``guard(new, old)`` on every update, ``state`` for the update and initialization bindings."""

    def __init__(self, b: GraphBuilder, precision: Precision):
        self.b, self.g, self.precision = b, b.under("loss_scale"), precision
        self.dynamic = dynamic_scaling(precision)
        fixed = precision.loss_scale if isinstance(precision.loss_scale, (int, float)) else 1.0
        init = float(precision.init_scale) if self.dynamic else float(fixed)
        self.scale = b.initializer(init, TensorProto.FLOAT, "loss_scale")
        self.init = init
        self.good = b.initializer(0, TensorProto.INT64, "loss_scale/clean_steps") if self.dynamic else None
        self.inverse = self.g.Reciprocal(self.scale) if init != 1.0 or self.dynamic else None
        self.grads: list[str] = []
        self.ok: str | None = None
        self.reported: list[str] = []

    def scaled(self, loss: str) -> str:
        if self.inverse is None:
            return loss
        return self.g.Mul(loss, self.scale)

    def unscaled(self, grad: str) -> str:
        self.grads.append(grad)
        return grad if self.inverse is None else self.g.Mul(grad, self.inverse)

    def finite(self) -> str | None:
        """A bool scalar: every gradient finite (Inf * 0 and NaN * 0 are NaN, so their sum is 0 only then)."""
        if not self.dynamic:
            return None
        g = self.g
        zero = g.initializer(0.0, TensorProto.FLOAT, "zero")
        sums = [g.ReduceSum(g.Mul(grad, zero), keepdims=0) for grad in self.grads]
        total = g.Sum(*sums) if len(sums) > 1 else sums[0]
        self.ok = g.Not(g.IsNaN(total))
        return self.ok

    def guard(self, new: str, old: str) -> str:
        """``new`` where the step's gradients are finite, else ``old`` (named ``<old>/guarded``: an output)."""
        return new if self.ok is None else self.b.Where(self.ok, new, old, outputs=[self.b.name(f"{old}/guarded")])

    def updates(self) -> list[tuple[str, str, onnx.ValueInfoProto]]:
        """(state, new value, its value info) of the scale and the clean-step count; the step's report outputs."""
        b, g, p = self.b, self.g, self.precision
        if not self.dynamic:
            return []
        one = g.initializer(1, TensorProto.INT64, "one")
        zero_i = g.initializer(0, TensorProto.INT64, "zero_steps")
        counted = g.Where(self.ok, g.Add(self.good, one), zero_i)
        grow = g.GreaterOrEqual(counted, g.initializer(int(p.growth_interval), TensorProto.INT64, "interval"))
        grown = g.Where(grow, g.Mul(self.scale, g.initializer(float(p.growth_factor), TensorProto.FLOAT, "growth")),
                        self.scale)
        backed = g.Mul(self.scale, g.initializer(float(p.backoff_factor), TensorProto.FLOAT, "backoff"))
        scale_new = b.Where(self.ok, grown, backed, outputs=[b.name("loss_scale.new")])
        good_new = b.Where(grow, zero_i, counted, outputs=[b.name("loss_scale/clean_steps.new")])
        return [(self.scale, scale_new, helper.make_tensor_value_info(scale_new, TensorProto.FLOAT, [])),
                (self.good, good_new, helper.make_tensor_value_info(good_new, TensorProto.INT64, []))]

    def report(self) -> list[onnx.ValueInfoProto]:
        """The step's outputs ``loss_scale`` (the scale it used) and ``step_skipped``."""
        if not self.dynamic:
            return []
        b = self.b
        used = b.Identity(self.scale, outputs=[_reserve(b, "loss_scale")])
        skipped = b.Not(self.ok, outputs=[_reserve(b, "step_skipped")])
        self.reported = [used, skipped]
        return [helper.make_tensor_value_info(used, TensorProto.FLOAT, []),
                helper.make_tensor_value_info(skipped, TensorProto.BOOL, [])]


def _reserve(b: GraphBuilder, want: str) -> str:
    name = want if want not in b.taken else b.name(want)
    b.taken.add(name)
    return name


def write_record(model: onnx.ModelProto, precision: Precision, masters: dict[str, str], scaler: Scaler | None,
                 converted: bool) -> None:
    record = {"dtype": precision.dtype, "masters": masters, "converted": converted,
              "loss_scale": None if scaler is None else {"dynamic": scaler.dynamic, "scale": scaler.scale,
                                                         "init": scaler.init, "clean_steps": scaler.good,
                                                         "outputs": scaler.reported}}
    metadata.write(model, {metadata.PRECISION: json.dumps(record)})


def precision_record(model: onnx.ModelProto) -> dict | None:
    """What the mixed-precision rewrite recorded (dtype, {weight: master}, the loss scale's state), or None."""
    return metadata.read_json(model, metadata.PRECISION)


__all__ = ["Precision", "Scaler", "add_masters", "convert_model", "dynamic_scaling", "scales_loss",
           "loss_outputs_in_float32", "model_float_type", "precision_record", "resolve", "tensor_array", "tensor_of",
           "write_record"]
