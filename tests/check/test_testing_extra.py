"""hypothesis is a test-only dependency: the package never imports it, and onnx_autodiff.testing's strategies
say which extra installs it when it is missing."""
from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_the_package_does_not_import_hypothesis():
    code = ("import sys, onnx_autodiff, onnx_autodiff.testing; "
            "from onnx_autodiff.testing import In, RuleCase, check_rule_case, node_templates; "
            "print('hypothesis' in sys.modules)")
    assert _run(code) == "False"


def test_a_strategy_without_hypothesis_names_the_extra():
    code = ("import sys; sys.modules['hypothesis'] = None\n"  # what an environment without it looks like
            "from onnx_autodiff.errors import MissingExtraError\n"
            "from onnx_autodiff.testing import RuleCase, In, check_rule_case, rule_graphs, shapes\n"
            "assert check_rule_case(RuleCase('Tanh', [In((2, 3))])).ok\n"
            "for make in (shapes, lambda: rule_graphs([RuleCase('Tanh', [In((2, 3))])])):\n"
            "    try:\n"
            "        make()\n"
            "    except MissingExtraError as e:\n"
            "        print(e.hint)\n")
    assert _run(code).splitlines() == ["pip install 'onnx-autodiff[testing]'"] * 2
