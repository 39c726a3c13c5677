"""Every op with a gradient rule has a JVP (a direct rule, or the fallback through the gradient rule), and
the coverage table says which."""
from onnx_autodiff.engine.coverage import FALLBACK, JVP_RULE, coverage_rows
from onnx_autodiff.engine.registry import registered_jvp_rules, registered_rules


def test_every_jvp_rule_sits_beside_a_gradient_rule():
    """So the rule sweep (tests/forward/test_jvp_rules.py over tests/rules/cases) reaches every JVP rule."""
    alone = sorted(set(registered_jvp_rules()) - set(registered_rules()))
    assert not alone, f"JVP rules without a gradient rule (and so without a rule case): {alone}"


def test_the_table_gives_the_forward_mode_of_every_op_with_a_gradient_rule():
    rows = {(d, op): detail for d, op, status, detail in coverage_rows() if status == "rule"}
    assert len(rows) == len(registered_rules())
    direct = {(d or "ai.onnx", op) for d, op in registered_jvp_rules()}
    for key, detail in rows.items():
        assert f"forward: {JVP_RULE if key in direct else FALLBACK}" in detail, (key, detail)
    assert "forward: JVP rule" in rows[("ai.onnx", "Conv")]
    assert "forward: " + FALLBACK in rows[("ai.onnx", "LRN")]
