"""The registry fuzz: random graphs made from every rule case (``onnx_autodiff.testing.rule_graphs``: every op
with a case, its attributes, broadcasting, ranks 0-4, symbolic dims, computed tensors reused, transposed and
multiplied, If / Loop / Scan bodies), each held against float64 central differences; and the held-out chains
of matrix products (``linalg_graphs``: MatMul / Gemm / Transpose / Einsum, 2-D and batched).

The default run checks 300 registry graphs and 200 chains: about 35 s on one core (load 2.4), so about 18 s of
the suite's time under ``-n 2`` (four registry parts and two chain parts spread over the workers; 17-26 s per
registry part at a load of 8). Under CI (``CI`` set) the examples are the same every run.
``pytest -m sweep tests/check/test_fuzz_rules.py`` checks ten times as many (about six minutes on one core).
A rule that declines a graph with our error (a symbolic dim where it needs a static one) and a graph that only
onnx's reference evaluator could check and cannot (``Uncheckable``) count as events, not failures.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings

from onnx_autodiff.conformance.cases import all_cases
from onnx_autodiff.engine.registry import override_rule
from onnx_autodiff.testing import DECLINED, In, RuleCase, Uncheckable, check_graph, linalg_graphs, rule_graphs

CASES = all_cases()
PARTS = 4  # the registry graphs in parts (by opset) that pytest -n spreads over its workers
LEVELS = sorted({c.opset for c in CASES if c.opset >= 13})
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                      HealthCheck.filter_too_much])


def _holds(graph) -> None:
    try:
        report = check_graph(graph)
    except DECLINED as e:
        event(f"declined: {type(e).__name__}")
        return
    except Uncheckable:
        event("uncheckable on the reference evaluator")
        return
    event(f"checked on {report.runtime}")
    assert report.ok and report.checks, f"{report}\n{graph}"


def _registry_test(part: int, examples: int):
    strategy = rule_graphs(CASES, opsets=LEVELS[part::PARTS])

    @settings(FUZZ, max_examples=examples)
    @given(strategy)
    def run(graph):
        _holds(graph)

    return run


@pytest.mark.parametrize("part", range(PARTS))
def test_rule_graphs_match_finite_differences(part):
    _registry_test(part, 300 // PARTS)()


@pytest.mark.sweep
@pytest.mark.parametrize("part", range(PARTS))
def test_rule_graphs_sweep(part):
    _registry_test(part, 3000 // PARTS)()


def _linalg_test(batched: bool, examples: int):
    @settings(FUZZ, max_examples=examples)
    @given(linalg_graphs(batched=batched))
    def run(graph):
        _holds(graph)

    return run


@pytest.mark.parametrize("batched", [False, True], ids=["2d", "batched"])
def test_matrix_product_chains_match_finite_differences(batched):
    _linalg_test(batched, 100)()


@pytest.mark.sweep
@pytest.mark.parametrize("batched", [False, True], ids=["2d", "batched"])
def test_matrix_product_chains_sweep(batched):
    _linalg_test(batched, 1000)()


def test_a_wrong_rule_is_found_in_the_company_of_the_others():
    """A rule author's use: their op's case first in every graph (``focus``), among the built-in cases. A Sin
    rule that multiplies by sin instead of cos is caught within a few graphs."""
    strategy = rule_graphs(CASES + [RuleCase("Sin", [In((2, 3))])], focus=["Sin"], max_nodes=2, control_flow=False)
    caught = []

    @settings(FUZZ, max_examples=10, derandomize=True, database=None)
    @given(strategy)
    def probe(graph):
        try:
            report = check_graph(graph)
        except (*DECLINED, Uncheckable):
            return
        if not report.ok:
            caught.append(graph)

    with override_rule("Sin", lambda g, node, dy: [g.Mul(dy[0], g.Sin(node.inputs[0]))]):
        probe()
    assert caught
