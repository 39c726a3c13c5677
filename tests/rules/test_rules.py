"""The table-driven sweep: every rule case through float64 finite differences, and coverage."""
import pytest

from onnx_autodiff.conformance.cases import all_cases, not_cased
from onnx_autodiff.engine.registry import registered_rules
from onnx_autodiff.testing import check_rule_case

CASES = all_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_rule_matches_finite_differences(case):
    report = check_rule_case(case)
    assert report.ok and report.checks, str(report)


def test_every_registered_rule_has_a_case():
    cased = {c.op for c in CASES} | set(not_cased())
    missing = sorted(op for (domain, op) in registered_rules() if op not in cased)
    assert not missing, f"registered rules without a case in onnx_autodiff/conformance/cases/: {missing}"
