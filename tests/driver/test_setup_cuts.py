"""The set-up's shortcuts answer as the long ways did: a chunked all-zero test, dead nodes removed in one pass."""
import numpy as np
import pytest
from onnx import helper

from onnx_autodiff.driver.state import _all_zero
from onnx_autodiff.driver.step_model import _without_dead
from onnx_autodiff.graph import node_inputs


@pytest.mark.parametrize("where", [None, 0, 70_000, 199_999])
def test_all_zero_reads_every_chunk_until_a_value_is_not_zero(where):
    a = np.zeros(200_000, np.float32)
    if where is not None:
        a[where] = np.nan if where == 70_000 else -1e-30
    assert _all_zero(a.reshape(400, 500), chunk=1 << 12) == (where is None)
    assert _all_zero(np.full(10, -0.0, np.float32))


def naive(nodes, maybe_dead, outputs):
    while True:
        read = {x for n in nodes for x in node_inputs(n)} | outputs
        dead = {id(n) for n in nodes if id(n) in maybe_dead and not any(o in read for o in n.output if o)}
        if not dead:
            return nodes
        nodes = [n for n in nodes if id(n) not in dead]


@pytest.mark.parametrize("seed", range(8))
def test_dead_nodes_go_as_the_round_by_round_removal_took_them(seed):
    rng = np.random.default_rng(seed)
    nodes = []
    for k in range(40):
        inputs = [f"t{j}" for j in rng.choice(k, size=min(k, 2), replace=False)] if k else ["x"]
        outs = [f"t{k}"] if rng.random() > 0.1 else [""]
        nodes.append(helper.make_node("Add" if len(inputs) == 2 else "Relu", inputs, outs, name=f"n{k}"))
    maybe = {id(n) for n in nodes if rng.random() < 0.7}
    outputs = {f"t{k}" for k in rng.choice(40, size=3, replace=False)}
    assert [n.name for n in _without_dead(nodes, maybe, outputs)] == [n.name for n in naive(nodes, maybe, outputs)]
