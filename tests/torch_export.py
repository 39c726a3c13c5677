"""Shared helpers for the tests that hold exported PyTorch models against torch autograd.

Models are exported with the TorchScript exporter at opset 17 without constant folding, so every
parameter and buffer stays an initializer under its ``state_dict`` name (LSTM/GRU weight reordering,
transposed Linear weights, ... stay as Slice/Concat/Transpose nodes on them). The torch reference then
reads the very same float32 values, promoted to float64, through ``torch.func.functional_call``.
"""
from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import helper, numpy_helper

import onnx_autodiff as oa

TRAIN = "ai.onnx.preview.training"
FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16}


def export(module: torch.nn.Module, args: tuple, input_names: list[str], output_names=("loss",),
           training=torch.onnx.TrainingMode.PRESERVE) -> onnx.ModelProto:
    """TorchScript export at opset 17, no constant folding. PRESERVE (with the module in eval mode)
    keeps BatchNormalization as its own node: EVAL would fold it into the preceding Conv."""
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, buf, dynamo=False, opset_version=17, input_names=input_names,
                          output_names=list(output_names), training=training, do_constant_folding=False)
    return onnx.load_from_string(buf.getvalue())


def float_initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type in FLOAT_TYPES}


def with_gradient(model: onnx.ModelProto, y: str, xs: list[str]) -> tuple[onnx.ModelProto, list[str]]:
    """The model plus one Gradient node of ``y`` w.r.t. ``xs``; its outputs ``<x>_grad`` are graph outputs."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    grads = [f"{x}_grad" for x in xs]
    g.node.append(helper.make_node("Gradient", xs, grads, name="test_grad", domain=TRAIN, xs=xs, y=y))
    types = {t.name: (t.data_type, list(t.dims)) for t in g.initializer}
    for i in g.input:
        tt = i.type.tensor_type
        types.setdefault(i.name, (tt.elem_type, [d.dim_param or d.dim_value for d in tt.shape.dim]))
    for x, name in zip(xs, grads):
        g.output.append(helper.make_tensor_value_info(name, *types[x]))
    m.opset_import.append(helper.make_opsetid(TRAIN, 1))
    return m, grads


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def lowered_gradients(model: onnx.ModelProto, y: str, xs: list[str], feeds: dict) -> dict[str, np.ndarray]:
    """d(y)/d(xs) from our lowering, run in stock onnxruntime; the lowered graph is plain ONNX."""
    grad_model, grads = with_gradient(model, y, xs)
    lowered = oa.lower(grad_model)
    left = sorted({n.op_type for n in lowered.graph.node if n.domain not in ("", "ai.onnx")})
    assert not left, f"non-standard ops left after lowering: {left}"
    return dict(zip(xs, session(lowered).run(grads, feeds)))


def assert_close(ours: dict, ref: dict, rtol: float):
    """Each gradient within ``rtol`` of the max abs of its reference tensor (which must not be zero)."""
    assert set(ours) == set(ref), (sorted(ours), sorted(ref))
    for name, want in ref.items():
        got = ours[name]
        assert got.shape == want.shape, (name, got.shape, want.shape)
        scale = float(np.abs(want).max())
        assert scale > 0, f"the reference gradient of {name} is zero: the check would be vacuous"
        err = float(np.abs(got.astype(np.float64) - want).max()) / scale
        assert err <= rtol, f"gradient of {name} off by {err:.2e} relative to max |grad| {scale:.3g}"


def annotate_unknown_shapes(model: onnx.ModelProto, feeds: dict) -> tuple[onnx.ModelProto, list[str]]:
    """A copy whose intermediate tensors of unknown rank (after onnx shape inference with data
    propagation) carry their run-time type and shape as value_info, the user-side remedy our errors
    suggest ("annotate its shape"); returns it and the names annotated."""
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    known = {vi.name for vi in list(inferred.graph.value_info) + list(inferred.graph.input)
             + list(inferred.graph.output) if vi.type.tensor_type.HasField("shape")}
    known |= {t.name for t in model.graph.initializer}
    unknown = [o for n in model.graph.node for o in n.output if o and o not in known]
    if not unknown:
        return model, []
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_empty_tensor_value_info(o) for o in unknown)
    values = session(probe).run(unknown, feeds)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for name, v in zip(unknown, values):
        out.graph.value_info.append(
            helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)))
    return out, unknown
