"""``NodeBuilder``: the nodes, initializers, inputs and outputs of one graph under construction, with unique
names (the training builder's algorithm and initialization graphs, the trainer's small graphs)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..graph import fresh_name


def normalize_name(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(" ", "_")


class NodeBuilder:
    """Nodes, initializers, inputs and outputs of one graph under construction, with unique names."""

    def __init__(self, taken: set[str], prefix: str):
        self.taken = taken
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.arrays: dict[str, np.ndarray] = {}  # values of detached initializers (optimizer state)
        self.host_scalars: dict[str, dict] = {}  # scalars a driver computes on the host (training/optimizers.py)

    def name(self, want: str) -> str:
        return fresh_name(self.taken, f"{self.prefix}/{want}" if self.prefix else want)

    def op(self, op_type: str, inputs: list[str], hint: str, n_out: int = 1, domain: str = "",
           outputs: list[str] | None = None, **attrs) -> list[str] | str:
        outs = outputs or [self.name(f"{hint}_out{k}" if n_out > 1 else hint) for k in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.name(f"{hint}/{op_type}"),
                                           domain=domain, **attrs))
        return outs if n_out > 1 or outputs else outs[0]

    def const(self, value, dtype: int, hint: str = "const") -> str:
        arr = np.array(value, dtype=helper.tensor_dtype_to_np_dtype(dtype))
        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(arr, name))
        return name
