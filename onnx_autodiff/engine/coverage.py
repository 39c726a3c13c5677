"""The operator coverage table, generated from the registry (docs/operators.md is its output)."""
from __future__ import annotations

import onnx

from ..graph import has_subgraph
from .registry import non_differentiable_ops, registered_rules


def coverage_rows() -> list[tuple[str, str, str, str]]:
    """(domain, op type, status, detail) for every op with a rule, a function body, or declared without gradient."""
    rows = []
    for (domain, op), rules in registered_rules().items():
        floors = ", ".join(f"opset {r.since}+" for r in rules)
        module = rules[-1].fn.__module__.rsplit(".", 1)[-1]
        rows.append((domain or "ai.onnx", op, "rule", f"{module} ({floors})"))
    for (domain, op), reason in non_differentiable_ops().items():
        rows.append((domain or "ai.onnx", op, "no gradient", reason))
    have = {(d, op) for d, op, _, _ in rows}
    for op, detail in function_ops().items():
        if ("ai.onnx", op) not in have:
            rows.append(("ai.onnx", op, "function body", detail))
    return sorted(rows, key=lambda r: (r[0], r[1]))


# function ops whose expanded bodies tests/engine/test_function_ops.py checks (finite differences or torch)
CHECKED_FUNCTION_OPS = {"Attention", "CenterCropPad", "MeanVarianceNormalization", "RMSNormalization",
                        "RotaryEmbedding", "Swish"}


def function_ops() -> dict[str, str]:
    """ai.onnx ops the installed onnx defines by a function body: without a hand rule they are
    differentiated by expanding that body (function_ops.py)."""
    out = {}
    for s in onnx.defs.get_all_schemas_with_history():
        if s.domain not in ("", "ai.onnx") or not (s.has_function or s.has_context_dependent_function):
            continue
        body = s.function_body if s.has_function else None
        if body is not None and any(has_subgraph(n) for n in body.node):
            out[s.name] = "body has control flow: not expanded (no rule)"
        elif s.name == "SequenceMap":
            out[s.name] = "works on sequences, which the reverse walk does not differentiate (no rule)"
        else:
            checked = "checked" if s.name in CHECKED_FUNCTION_OPS else "not yet checked by a test"
            out.setdefault(s.name, f"expanded from its schema body at the model's opset ({checked})")
    return out


def coverage_markdown() -> str:
    rows = coverage_rows()
    n_rule = sum(r[2] == "rule" for r in rows)
    n_fn = sum(r[2] == "function body" and "no rule" not in r[3] for r in rows)
    n_none = sum(r[2] == "no gradient" for r in rows)
    lines = [
        "# Operator coverage",
        "",
        "Generated from the rule registry by `onnx-autodiff rules --markdown` "
        "(`onnx_autodiff.engine.coverage.coverage_markdown()`); a test keeps this file in sync.",
        "",
        f"{n_rule} op types with a gradient rule, {n_fn} more differentiated through their schema's "
        f"function body, {n_none} declared without gradient (gradients stop there: zero, not an error). "
        "Any other op on a differentiated path raises `UnsupportedOperatorError`.",
        "",
        "| domain | op | status | detail |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {d} | {op} | {status} | {detail} |" for d, op, status, detail in rows]
    return "\n".join(lines) + "\n"
