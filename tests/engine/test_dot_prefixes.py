"""graph._dot_prefixes (the names a node may not take, ``make_portable``): the set it finds walking each name from
its longest prefix, stopping at one already found, is every dot-followed prefix of every name."""
from __future__ import annotations

import random

from onnx import TensorProto, helper

from onnx_autodiff.graph import _dot_prefixes, distinct_node_names


def _every_prefix(names: set[str]) -> set[str]:
    return {name[:k] for name in names for k in range(1, len(name)) if name[k] == "."}


def test_awkward_names_give_every_dot_prefix():
    rng = random.Random(0)
    for _ in range(2000):
        names = {"".join(rng.choice("ab.") for _ in range(rng.randint(0, 8))) for _ in range(rng.randint(0, 12))}
        assert _dot_prefixes(names) == _every_prefix(names), names


def test_a_node_named_as_a_dotted_prefix_is_renamed():
    nodes = [helper.make_node("Relu", ["x"], ["enc.layer.0.out"], name="enc.layer"),
             helper.make_node("Relu", ["enc.layer.0.out"], ["enc.layer.1.out"], name="enc.layer.1.out.x")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("enc.layer.1.out", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph)
    assert distinct_node_names(model)
    assert [n.name for n in model.graph.node] == ["enc.layer_node", "enc.layer.1.out.x"]
