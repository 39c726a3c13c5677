"""docs/operators.md is generated from the registry; this keeps the two in sync."""
from pathlib import Path

from onnx_autodiff.engine.coverage import coverage_markdown, coverage_rows

DOC = Path(__file__).resolve().parents[2] / "docs" / "operators.md"


def test_operators_doc_matches_the_registry():
    assert DOC.read_text() == coverage_markdown(), (
        "docs/operators.md is stale: regenerate it with `onnx-autodiff rules --markdown > docs/operators.md`"
    )


def test_rule_and_no_gradient_are_different_answers():
    rows = {(d, op): status for d, op, status, _ in coverage_rows()}
    assert rows[("ai.onnx", "Mul")] == "rule"
    assert rows[("ai.onnx", "Shape")] == "no gradient"
    assert ("ai.onnx", "Gradient") not in rows


def test_rules_command_counts_agree_with_the_doc():
    import re
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "onnx_autodiff", "rules"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    pattern = r"(\d+) op types with a gradient rule, (\d+) more differentiated through their schema's function body, " \
              r"(\d+) declared without gradient"
    assert re.search(pattern, p.stdout.splitlines()[-1]).groups() == re.search(pattern, DOC.read_text()).groups()
