"""The forward mode of every rule case against its reverse mode, exactly: <J u, v> = <u, J^T v> in float64."""
import pytest

from onnx_autodiff.testing import check_rule_case_jvp
from tests.rules.cases import all_cases

CASES = all_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_jvp_matches_the_gradient(case):
    report = check_rule_case_jvp(case)
    assert report.ok and report.checks, str(report)
