"""A runtime's refusal as one line of ours: which op and node it would not convert or run, in the runtime's own
words cut to the sentence that says why, and the target whose lowering avoids the op (``runtimes/targets.py``).

OpenVINO, tract and onnxruntime name the node they stopped at, each in its own format; the parsers below read those
formats, and a message none of them recognizes is kept whole on one line.
"""
from __future__ import annotations

import os
import re

import onnx

from ..errors import RuntimeRefusedError
from ..passes.standard_forms import FORM_SINCE
from .targets import RUNTIMES, TARGETS

_LABELS = {"onnxruntime": "onnxruntime", "reference": "onnx.reference", "openvino": "OpenVINO", "tract": "tract",
           "onnxruntime-node": "onnxruntime-node"}
_NOISE = ("Exception from ", "Check '", "FrontEnd API failed", "Stack backtrace", "Caused by:", "Model wasn't",
          "Summary:", "Failed operations", "While validating")


def _openvino(text: str) -> list[tuple[str, str, str]]:
    found = []
    for m in re.finditer(r"-- (\w+)-\d+ with a message:\n(.*?)(?=\n-- |\nSummary:|\Z)", text, re.S):
        node = re.search(r"<Node\((\w+)\): ([^>]*)>", m.group(2))
        found.append((m.group(1), node.group(2) if node else "", _why(m.group(2))))
    for m in re.finditer(r"No conversion rule found for operations: ([^\n]*)", text):
        found += [(op.rsplit("-", 1)[0].strip(), "", "no converter for the op") for op in m.group(1).split(",")]
    return found


def _tract(text: str) -> list[tuple[str, str, str]]:
    m = re.search(r'node #\d+ "([^"]*)"\s*(\S*)', text)
    if not m:
        return []
    unimplemented = re.search(r"Unimplemented\((\w+)\)", text)
    op = unimplemented.group(1) if unimplemented else ""
    cause = re.search(r"Caused by:\s*\n\s*(?:\d+: )?([^\n]+)", text)
    return [(op, m.group(1), "not implemented" if unimplemented else (cause.group(1).strip() if cause else ""))]


def _onnxruntime(text: str) -> list[tuple[str, str, str]]:
    m = re.search(r"implementation for (\w+)\(\d+\) node with name '([^']*)'", text)
    if m:
        return [(m.group(1), m.group(2), "no kernel for it")]
    m = re.search(r"running (\w+) node\. Name:'([^']*)' Status Message: ([^\n]*)", text)
    if m:
        return [(m.group(1), m.group(2), m.group(3).strip())]
    return []


_PARSERS = {"openvino": _openvino, "tract": _tract, "onnxruntime": _onnxruntime, "onnxruntime-node": _onnxruntime}


def _why(text: str) -> str:
    """The line of a runtime message that says why (not the file and line the check failed at)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    said = [ln for ln in lines if not ln.startswith(_NOISE) and not re.match(r"^\d+: ", ln)]
    return (said or lines or [""])[0][:300]


def _nodes_of(path: str) -> dict[str, onnx.NodeProto]:
    """The model's nodes by name and by output name (OpenVINO names a node by its output)."""
    try:
        graph = onnx.load(path, load_external_data=False).graph
    except Exception:  # noqa: BLE001 - the runtime's message stands without the map
        return {}
    return {o: n for n in graph.node for o in n.output} | {n.name: n for n in graph.node}


def avoiding_targets(op: str, runtime: str) -> list[str]:
    """The targets, other than ``runtime``'s, whose lowering writes ``op`` in standard ops."""
    if op not in FORM_SINCE:
        return []
    return [t.name for t in TARGETS.values() if t.name != runtime and not t.has_op(op)]


def refusal_hint(ops: list[str], runtime: str) -> str:
    """What avoids the first op of ``ops`` on ``runtime``: the runtime's own target when its record lacks the op
    (the bundle was made for another), else another target whose lowering writes the op in standard ops."""
    own = RUNTIMES.get(runtime)
    for op in ops:
        if op in FORM_SINCE and own is not None and not own.has_op(op):
            return f"export the bundle for --target {runtime}: its lowering writes {op} in standard ops"
        targets = avoiding_targets(op, runtime)
        if targets:
            return f"export the bundle for --target {targets[0]}: its lowering writes {op} in standard ops"
    if ops:
        return (f"no lowering of onnx-autodiff avoids {ops[0]} on {runtime}: train on another runtime "
                f"(onnx-autodiff check MODEL --target {runtime} names what it lacks; docs/runtimes.md)")
    return f"onnx-autodiff check MODEL --target {runtime} names what {runtime} lacks (docs/runtimes.md)"


def refused(runtime: str, stage: str, path: str, error: BaseException) -> RuntimeRefusedError:
    """``error``, raised by ``runtime`` converting ("convert") or running ("run") the model at ``path``, as our
    one-line error."""
    text = str(error)
    found = _PARSERS.get(runtime, lambda _: [])(text)
    nodes = _nodes_of(path) if found else {}
    found = [(op or (nodes[node].op_type if node in nodes else ""), nodes[node].name if node in nodes else node, why)
             for op, node, why in found]
    label = _LABELS.get(runtime, runtime)
    verb = "convert" if stage == "convert" else "run"
    name = os.path.basename(path)
    if found:
        parts = [f"{op or 'a node'}" + (f" (node {node!r})" if node else "") + (f": {why}" if why else "")
                 for op, node, why in found[:3]]
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        message = f"{label} could not {verb} {name}: {'; '.join(parts)}{more}"
    else:
        message = f"{label} could not {verb} {name}: {_why(text) or type(error).__name__}"
    ops = [op for op, _, _ in found if op]
    return RuntimeRefusedError(message, refusal_hint(ops, runtime), runtime=runtime, stage=stage, ops=ops,
                               nodes=[node for _, node, _ in found if node], detail=text)


__all__ = ["refused", "refusal_hint", "avoiding_targets"]
