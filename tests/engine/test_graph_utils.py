"""Graph utilities the lowering leans on for speed: set_nodes (one copy per node), is_topological (outputs
read once, subgraph reads counted) and cleanup_nodes' fixed point (a round that only folded ends it)."""
from __future__ import annotations

from onnx import TensorProto, helper

from onnx_autodiff.engine.cleanup import cleanup_nodes
from onnx_autodiff.graph import is_topological, set_nodes

F = TensorProto.FLOAT


def _chain_graph():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="r"),
             helper.make_node("Neg", ["a"], ["b"], name="n"),
             helper.make_node("Transpose", ["b"], ["c"], name="t", perm=[1, 0])]
    return helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [2, 3])],
                             [helper.make_tensor_value_info("c", F, [3, 2])])


def test_set_nodes_takes_the_graphs_own_messages_lazily_given():
    g = _chain_graph()
    before = [n.SerializeToString() for n in g.node]
    set_nodes(g, (n for n in reversed(g.node)))  # a generator over the list being replaced
    assert [n.SerializeToString() for n in g.node] == before[::-1]
    set_nodes(g, [g.node[2], g.node[1], g.node[0]])
    assert [n.SerializeToString() for n in g.node] == before


def test_is_topological_counts_subgraph_reads():
    then = helper.make_graph([helper.make_node("Identity", ["late"], ["o"])], "then", [],
                             [helper.make_tensor_value_info("o", F, None)])
    use = helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then, else_branch=then)
    make = helper.make_node("Relu", ["x"], ["late"], name="make")
    assert not is_topological([use, make])  # the If's bodies read 'late' before it is made
    assert is_topological([make, use])
    assert not is_topological([helper.make_node("Neg", ["a"], ["b"]), helper.make_node("Relu", ["x"], ["a"])])


def test_cleanup_runs_another_round_when_a_dead_node_blocked_a_fold():
    """Identity(a) cannot fold while a dead node also reads a; the round that removes the dead node must
    be followed by one that folds it (only a round without CSE merges or dead nodes ends the loop)."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="p"),
             helper.make_node("Neg", ["a"], ["unused"], name="dead"),
             helper.make_node("Identity", ["a"], ["b"], name="id"),
             helper.make_node("Exp", ["b"], ["y"], name="out")]
    out = cleanup_nodes(nodes, {"y"})
    assert [(n.name, list(n.input), list(n.output)) for n in out] == [("p", ["x"], ["b"]), ("out", ["b"], ["y"])]


def test_cleanup_folds_a_chain_of_identities_and_merges_duplicates():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="p"),
             helper.make_node("Identity", ["a"], ["b"], name="i1"),
             helper.make_node("Identity", ["b"], ["c"], name="i2"),
             helper.make_node("Exp", ["x"], ["e"], name="e1"),
             helper.make_node("Exp", ["x"], ["e2"], name="e2"),  # merged into e1 by CSE
             helper.make_node("Sum", ["c", "e", "e2"], ["y"], name="sum")]
    out = cleanup_nodes(nodes, {"y"})
    assert [(n.name, list(n.input), list(n.output)) for n in out] == [
        ("p", ["x"], ["c"]), ("e1", ["x"], ["e"]), ("sum", ["c", "e", "e"], ["y"])]
