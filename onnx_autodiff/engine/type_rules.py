"""Type rules: how onnx's shape inference sees through an op it has no schema for (onnxruntime's contrib ops).

A rule file registers ``@type_rule(op, domain=...)`` beside the op's gradient rule (as JAX registers a
primitive's abstract evaluation beside its JVP). ``fn(s, node)`` writes each output the node has with
standard ONNX nodes of the same element type and shape: ``s`` (a ``StandIn``) emits them, ``node`` is the
rule's usual ``NodeView``. The rule goes into ``graph.STAND_INS``, which ``graph.infer_tensor_info`` reads;
an output it leaves unwritten stays unknown.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..graph import STAND_INS, TensorInfo, normalize_domain
from .builder import NodeView


class StandIn:
    """Emits the stand-in nodes of one node, named under ``<node>/type rule``; facts about tensors known
    before inference (graph inputs, initializers, declared values)."""

    def __init__(self, node: onnx.NodeProto, opset: int, known: dict[str, TensorInfo]):
        self.scope = f"{node.name or node.output[0]}/type rule"
        self.opset = opset
        self.known = known
        self.nodes: list[onnx.NodeProto] = []

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        """One node; returns its output (``out``, or a fresh name)."""
        name = f"{self.scope}/{op_type}_{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out or name], name=name, **attrs))
        return out or name

    def __getattr__(self, op_type: str):
        if op_type[:1].isupper():
            return lambda *inputs, **attrs: self.op(op_type, *inputs, **attrs)
        raise AttributeError(op_type)

    def ints(self, values) -> str:
        return self.op("Constant", value=numpy_helper.from_array(np.asarray(values, np.int64).reshape(-1)))

    def info(self, name: str | None) -> TensorInfo:
        return self.known.get(name or "", TensorInfo(None, None))

    def reduce_mean(self, x: str, axes, out: str | None = None) -> str:
        """ReduceMean over ``axes``, dims kept (axes an input from opset 18)."""
        if self.opset >= 18:
            return self.op("ReduceMean", x, self.ints(axes), out=out, keepdims=1)
        return self.op("ReduceMean", x, out=out, axes=list(axes), keepdims=1)

    def zeros(self, shape, like: str) -> str:
        """A tensor of static ``shape`` in ``like``'s element type (CastLike from opset 15; before it, the
        type known for ``like`` or float)."""
        z = self.op("ConstantOfShape", self.ints(shape))
        if self.opset >= 15:
            return self.op("CastLike", z, like)
        return self.op("Cast", z, to=self.info(like).dtype or onnx.TensorProto.FLOAT)


def type_rule(*op_types: str, domain: str = ""):
    """Register ``fn(s: StandIn, node: NodeView)`` as the type rule of each op type."""
    def register(fn: Callable) -> Callable:
        def stand_in(node: onnx.NodeProto, opset: int, known: dict[str, TensorInfo]) -> list[onnx.NodeProto]:
            s = StandIn(node, opset, known)
            fn(s, NodeView(node, opset, []))
            return s.nodes

        for op in op_types:
            STAND_INS[(normalize_domain(domain), op)] = stand_in
        return fn

    return register
