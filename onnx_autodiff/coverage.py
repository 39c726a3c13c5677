"""The operator coverage table, generated from the registry (docs/operators.md is its output)."""
from __future__ import annotations

from .registry import non_differentiable_ops, registered_rules


def coverage_rows() -> list[tuple[str, str, str, str]]:
    """(domain, op type, status, detail) for every op with a rule or declared without gradient."""
    rows = []
    for (domain, op), rules in registered_rules().items():
        floors = ", ".join(f"opset {r.since}+" for r in rules)
        module = rules[-1].fn.__module__.rsplit(".", 1)[-1]
        rows.append((domain or "ai.onnx", op, "rule", f"{module} ({floors})"))
    for (domain, op), reason in non_differentiable_ops().items():
        rows.append((domain or "ai.onnx", op, "no gradient", reason))
    return sorted(rows, key=lambda r: (r[0], r[1]))


def coverage_markdown() -> str:
    rows = coverage_rows()
    n_rule = sum(r[2] == "rule" for r in rows)
    lines = [
        "# Operator coverage",
        "",
        "Generated from the rule registry by `onnx-autodiff rules --markdown` "
        "(`onnx_autodiff.coverage.coverage_markdown()`); a test keeps this file in sync.",
        "",
        f"{n_rule} op types with a gradient rule, {len(rows) - n_rule} declared without gradient "
        "(gradients stop there: zero, not an error). Any other op on a differentiated path raises "
        "`UnsupportedOperatorError`.",
        "",
        "| domain | op | status | detail |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {d} | {op} | {status} | {detail} |" for d, op, status, detail in rows]
    return "\n".join(lines) + "\n"
