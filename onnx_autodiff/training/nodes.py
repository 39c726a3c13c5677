"""``GraphBuilder``: the node builder the rules and passes use (``g.Add(a, b)``, ``engine/builder.py``) over a graph of
its own: the training builder's algorithm and initialization graphs, the partial trainer's small graphs. Beside the
nodes it keeps the graph's named initializers, inputs and outputs, the values of detached initializers (optimizer
state) and the scalars a driver computes on the host (``training/optimizers.py``)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..engine.builder import Emitter, GradBuilder
from ..graph import GraphView, fresh_name


def normalize_name(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(" ", "_")


class GraphBuilder(GradBuilder):
    """Nodes (as a rule emits them), initializers, inputs and outputs of one graph under construction; names are
    fresh against ``taken`` and go under ``scope``. ``under(part)`` gives a builder of the same graph whose names go
    under ``<scope>/<part>``."""

    def __init__(self, taken: set[str], scope: str, opset: int = 17):
        super().__init__(Emitter(GraphView([], {}, {"": opset}), taken), scope)
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.arrays: dict[str, np.ndarray] = {}  # values of detached initializers (optimizer state)
        self.host_scalars: dict[str, dict] = {}  # scalars a driver computes on the host (training/optimizers.py)

    def op(self, op_type: str, *inputs: str | None, **kwargs):
        """``GradBuilder.op``, the node named ``<its first output>/<op_type>``: apart from every tensor name, as
        ``graph.make_portable`` wants, so that a name recorded now (a LoRA branch's nodes) stays the node's."""
        out = super().op(op_type, *inputs, **kwargs)
        node = self.nodes[-1]
        node.name = fresh_name(self.taken, f"{node.output[0]}/{op_type}")
        return out

    @property
    def nodes(self) -> list[onnx.NodeProto]:
        return self.em.nodes

    @property
    def taken(self) -> set[str]:
        return self.em.taken

    def initializer(self, value, dtype: int, name: str) -> str:
        """A new initializer ``<scope>/<name>`` holding ``value`` in element type ``dtype`` (an ONNX type)."""
        out = self.name(name)
        self.inits.append(numpy_helper.from_array(np.array(value, dtype=helper.tensor_dtype_to_np_dtype(dtype)), out))
        return out

    def graph(self, name: str) -> onnx.GraphProto:
        return helper.make_graph(self.nodes, name, self.inputs, self.outputs, self.inits)
