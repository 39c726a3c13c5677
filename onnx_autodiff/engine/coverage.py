"""The operator coverage table, generated from the registry (docs/operators.md is its output).

Each op's detail ends with its forward mode: a direct JVP rule, or the JVP read off its gradient rule (the
fallback of engine/forward.py), so every op with a gradient rule has a JVP."""
from __future__ import annotations

import onnx

from ..graph import has_subgraph
from .registry import non_differentiable_ops, registered_jvp_rules, registered_rules


def coverage_rows() -> list[tuple[str, str, str, str]]:
    """(domain, op type, status, detail) for every op with a rule, a function body, or declared without gradient."""
    rows = []
    jvps = registered_jvp_rules()
    for (domain, op), rules in registered_rules().items():
        floors = ", ".join(f"opset {r.since}+" for r in rules)
        module = rules[-1].fn.__module__.rsplit(".", 1)[-1]
        direct = jvps.get((domain, op))
        forward = (f"{JVP_RULE} (opset {', '.join(str(r.since) for r in direct)}+)" if direct else FALLBACK)
        rows.append((domain or "ai.onnx", op, "rule", f"{module} ({floors}); forward: {forward}"))
    for (domain, op), reason in non_differentiable_ops().items():
        rows.append((domain or "ai.onnx", op, "no gradient", f"{reason}; forward: no tangent"))
    have = {(d, op) for d, op, _, _ in rows}
    for op, detail in function_ops().items():
        if ("ai.onnx", op) not in have:
            forward = "" if "no rule" in detail else "; forward: through the body's ops"
            rows.append(("ai.onnx", op, "function body", detail + forward))
    return sorted(rows, key=lambda r: (r[0], r[1]))


JVP_RULE = "JVP rule"
FALLBACK = "JVP read off the gradient rule"

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
    n_jvp = sum(r[2] == "rule" and f"forward: {JVP_RULE}" in r[3] for r in rows)
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
        f"Forward mode (`jvp`, `hvp`, `jacobian`; docs/forward_mode.md): {n_jvp} of the {n_rule} op types with a "
        f"gradient rule have a direct {JVP_RULE}; the other {n_rule - n_jvp} have their JVP read off the gradient "
        "rule (\"forward: " + FALLBACK + "\", the gradient of <J^T u, v> with respect to u), so every op with a "
        "gradient rule has a JVP.",
        "",
        "| domain | op | status | detail |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {d} | {op} | {status} | {detail} |" for d, op, status, detail in rows]
    return "\n".join(lines) + "\n"
