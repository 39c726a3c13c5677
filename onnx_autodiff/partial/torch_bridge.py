"""An ONNX graph as one differentiable PyTorch layer.

``OnnxFunction(model)`` is an ``nn.Module`` whose parameters are the model's trainable float
initializers. Its forward runs the forward model of :func:`onnx_autodiff.partial.vjp.build_vjp` in onnxruntime,
its backward runs the backward model, through a ``torch.autograd.Function``. Tensors cross by DLPack:
CPU tensors are shared with onnxruntime both ways, never copied (a non-contiguous tensor is made
contiguous first, which copies it).

Importing this module imports torch; the rest of the package never does.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper

from ..graph import FLOAT_TYPES, float_parameters, fresh_name
from ..model.carrier import open_model
from .vjp import VjpModels, build_vjp, grad_name, inference_model


def _load(model) -> onnx.ModelProto:
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    return open_model(model).whole()


def to_ortvalue(t: torch.Tensor) -> ort.OrtValue:
    if t.device.type != "cpu":
        raise ValueError(f"OnnxFunction runs on CPU; got a tensor on {t.device} (move it with .cpu())")
    return ort.OrtValue.from_dlpack(t.detach().contiguous())


class _Runner:
    """The two onnxruntime sessions and the names that cross between them."""

    def __init__(self, vjp: VjpModels, inputs: list[str], providers, session_options):
        self.vjp = vjp
        self.inputs = inputs  # what the autograd Function receives, in order
        self.forward_outputs = [o.name for o in vjp.forward.graph.output]
        self.backward_inputs = [i.name for i in vjp.backward.graph.input]
        self.forward = ort.InferenceSession(vjp.forward.SerializeToString(), session_options, providers=providers)
        self.backward = ort.InferenceSession(vjp.backward.SerializeToString(), session_options, providers=providers)
        wrt = {x: k for k, x in enumerate(vjp.wrt)}
        self.grad_slot = [wrt.get(name) for name in inputs]

    def run(self, session, output_names, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        outs = session.run_with_ort_values(output_names, {k: to_ortvalue(v) for k, v in feeds.items()})
        return [torch.from_dlpack(o) for o in outs]


class _OnnxAutograd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner: _Runner, *tensors):
        feeds = dict(zip(runner.inputs, tensors))
        results = dict(zip(runner.forward_outputs, runner.run(runner.forward, runner.forward_outputs, feeds)))
        vjp = runner.vjp
        ctx.runner = runner
        ctx.save_for_backward(*[feeds[s] for s in vjp.saved_inputs], *[results[s] for s in vjp.saved_outputs])
        outs = tuple(results[o] for o in vjp.outputs)
        ctx.output_like = [(o.shape, o.dtype) for o in outs]
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        runner = ctx.runner
        vjp = runner.vjp
        feeds = dict(zip(vjp.saved, ctx.saved_tensors))
        for o, g, (shape, dtype) in zip(vjp.outputs, grads, ctx.output_like):
            feeds[grad_name(o)] = torch.zeros(shape, dtype=dtype) if g is None else g
        dxs = runner.run(runner.backward, vjp.grad_outputs, feeds)
        return (None, *[None if k is None else dxs[k] for k in runner.grad_slot])


def _attribute_name(onnx_name: str, taken: set[str]) -> str:
    base = re.sub(r"\W", "_", onnx_name) or "param"
    if base[0].isdigit():
        base = f"p_{base}"
    return fresh_name(taken, base)


class OnnxFunction(torch.nn.Module):
    """An ONNX model as a differentiable module.

    ``model``: a ModelProto, serialized bytes or a path. ``trainable``: the float initializers that become
    ``nn.Parameter`` s (default: all of them; the others stay constants inside the ONNX graphs).
    Call it with one tensor per graph input that is not an initializer, in graph order; it returns one
    tensor per float graph output (a tensor when there is one). Gradients flow to every float input and
    every trainable initializer. The backward is not itself differentiable (no double backward).

    ``onnx_names`` maps each parameter's attribute name to its initializer's name (ONNX names may hold
    characters a module attribute cannot).
    """

    def __init__(self, model, trainable: Sequence[str] | None = None, *, providers=None, session_options=None):
        super().__init__()
        model = _load(model)
        float_inputs, float_inits = float_parameters(model)
        trainable = list(float_inits) if trainable is None else list(trainable)
        inits = {t.name: t for t in model.graph.initializer}
        for name in trainable:
            if name not in inits or inits[name].data_type not in FLOAT_TYPES:
                raise ValueError(f"trainable names {name!r}, which is not a float initializer of the model")
        self.input_names = [i.name for i in model.graph.input if i.name not in inits]
        self.vjp = build_vjp(model, wrt=float_inputs + trainable, defaults=False)
        self.onnx_names: dict[str, str] = {}
        taken = set(dir(self))
        for name in trainable:
            attr = _attribute_name(name, taken)
            value = torch.from_numpy(numpy_helper.to_array(inits[name]).copy())
            self.register_parameter(attr, torch.nn.Parameter(value))
            self.onnx_names[attr] = name
        self._runner = _Runner(self.vjp, self.input_names + trainable,
                               providers or ["CPUExecutionProvider"], session_options)

    def forward(self, *inputs: torch.Tensor):
        if len(inputs) != len(self.input_names):
            raise TypeError(f"expected {len(self.input_names)} inputs ({', '.join(self.input_names)}), "
                            f"got {len(inputs)}")
        params = [getattr(self, attr) for attr in self.onnx_names]
        outs = _OnnxAutograd.apply(self._runner, *inputs, *params)
        return outs[0] if len(outs) == 1 else outs

    def to_onnx(self) -> onnx.ModelProto:
        """The inference model (the forward without its saved outputs) with the current parameter values."""
        values = {self.onnx_names[a]: p.detach().cpu().numpy() for a, p in self.named_parameters(recurse=False)}
        return inference_model(self.vjp, values)


__all__ = ["OnnxFunction", "to_ortvalue"]
