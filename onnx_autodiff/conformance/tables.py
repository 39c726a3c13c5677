"""A runtime's conformance table, from the results of its run: per op, how its rule cases fared forward and
backward, and what it is derived into.

``lacks`` (what ``runtimes/targets.py`` reads into the runtime's ``Target``): the default-domain ops whose forward the
runtime does not take (not converted, refused, crashed), each as the narrowest entry that covers exactly its failing
cases: ``Op[attribute]`` when they all set an attribute no passing case sets, ``Op[attribute=value]`` when they
share a value no passing case has (``LSTM[layout=1]`` on onnxruntime), ``Op[opset<K]`` when they are all below the
opsets of the passing ones; ``Op`` when every case fails, or when a standard form of the op exists
(``passes/standard_forms.py``: then the lowering writes the op in standard ops, which costs nothing where the runtime
had it). The token of each failing probe too. ``fails``: every op with a case that fails or computes wrong values,
forward or backward, and that ``lacks`` does not cover, as the same kind of entry, where an opset bound may cover
passing cases too: ``check --target`` warns of them and, where the runtime is installed, runs the model on it to
confirm. The JSON
holds no timing and no number that moves between runs, so a rerun on the same versions writes the same file and a
runtime upgrade shows as a diff.
"""
from collections import Counter

from .run import ATOL, CORRECT, ERROR, NONE, NOT_CONVERTED, NOT_LOWERED, REFUSED, STATUSES, TOLERANCE, WRONG, Result

CRASHED = "crashed"  # the runtime took its process down (a Rust panic, a segfault)
ALL_STATUSES = (*STATUSES, CRASHED)
REFUSALS = {NOT_CONVERTED, REFUSED, CRASHED}
_SHORT = {WRONG: "w", REFUSED: "r", NOT_CONVERTED: "n", NOT_LOWERED: "l", ERROR: "e", CRASHED: "c"}
LABELS = {"onnxruntime": "onnxruntime", "reference": "onnx.reference", "openvino": "OpenVINO", "tract": "tract",
          "onnxruntime-node": "onnxruntime-node"}


def _entry(op: str, bad: list[Result], good: list[Result], cautious: bool) -> str | None:
    """The narrowest entry covering every case of ``bad`` and none of ``good`` (module docstring); None when there
    is none. ``cautious``: an opset bound may cover good cases below it too."""
    if not good:
        return op
    common = set.intersection(*(set(r.attrs) for r in bad)) - {a for r in good for a in r.attrs}
    if common:
        return f"{op}[{sorted(common)[0]}]"
    pairs = set.intersection(*({(k, v) for k, v in r.attrs.items() if v is not None} for r in bad))
    pairs -= {(k, v) for r in good for k, v in r.attrs.items()}
    if pairs:
        k, v = sorted(pairs)[0]
        return f"{op}[{k}={v}]"
    top = max(r.opset for r in bad)
    above = [r.opset for r in good if r.opset > top]
    if above and (cautious or all(r.opset > top for r in good)):
        return f"{op}[opset<{min(above)}]"
    return op if cautious else None


def _failed(r: Result) -> bool:
    return r.forward != CORRECT or r.backward not in (CORRECT, NONE)


def _derive(results: list[Result]) -> tuple[list[str], dict[str, list[str]]]:
    """``(lacks, fails)`` of a run (module docstring); ``fails`` maps each entry to its cases."""
    from ..passes.standard_forms import FORM_SINCE

    by_op: dict[str, list[Result]] = {}
    for r in results:
        if r.kind == "case" and not r.domain:
            by_op.setdefault(r.ops[0], []).append(r)
    lacks, fails = [], {}
    for op, rs in sorted(by_op.items()):
        refused = [r for r in rs if r.forward in REFUSALS]
        good = [r for r in rs if r.forward == CORRECT]
        covered = set()
        if refused:
            entry = _entry(op, refused, good, cautious=False)
            if entry is None and op in FORM_SINCE:
                entry = op
            if entry is not None:
                lacks.append(entry)
                covered = {id(r) for r in refused}
        rest = [r for r in rs if _failed(r) and id(r) not in covered]
        if rest:
            whole = [r for r in rs if not _failed(r)]
            fails[_entry(op, rest, whole, cautious=True)] = [
                f"{r.subject} ({r.forward if r.forward != CORRECT else 'backward ' + r.backward})" for r in rest]
    lacks += [r.token for r in results if r.kind == "probe" and r.forward in REFUSALS]
    return sorted(set(lacks)), dict(sorted(fails.items()))


def _counts(statuses) -> dict[str, int]:
    c = Counter(s for s in statuses if s != NONE)
    return {s: c[s] for s in ALL_STATUSES if c[s]}


def build_table(runtime: str, version: str, results: list[Result], *, graphs: str, seed: int) -> dict:
    """The JSON-ready table of one runtime's run."""
    cases = [r for r in results if r.kind == "case"]
    ops: dict[str, dict] = {}
    for r in cases:
        key = r.ops[0] if not r.domain else f"{r.domain}.{r.ops[0]}"
        entry = ops.setdefault(key, {"forward": Counter(), "backward": Counter()})
        entry["forward"][r.forward] += 1
        if r.backward != NONE:
            entry["backward"][r.backward] += 1
    for r in (r for r in results if r.kind == "graph"):
        ok = r.forward == CORRECT and r.backward in (CORRECT, NONE)
        for op in r.ops:
            entry = ops.setdefault(op, {"forward": Counter(), "backward": Counter()})
            done, total = entry.get("graphs", (0, 0))
            entry["graphs"] = (done + ok, total + 1)
    table_ops = {op: {"forward": _counts(e["forward"].elements()), "backward": _counts(e["backward"].elements()),
                      **({"graphs": list(e["graphs"])} if "graphs" in e else {})} for op, e in sorted(ops.items())}
    graph_results = [r for r in results if r.kind == "graph"]
    lacks, fails = _derive(results)
    return {
        "runtime": runtime, "version": version,
        "command": f"onnx-autodiff conformance --runtime {runtime} --graphs {len(graph_results)} --seed {seed}",
        "tolerance": TOLERANCE, "atol": ATOL,
        "lacks": lacks,
        "fails": list(fails),
        "fails_cases": fails,
        "cases": {"count": len(cases), "forward": _counts(r.forward for r in cases),
                  "backward": _counts(r.backward for r in cases)},
        "graphs": {"source": graphs, "seed": seed, "count": len(graph_results),
                   "forward": _counts(r.forward for r in graph_results),
                   "backward": _counts(r.backward for r in graph_results)},
        "probes": {r.token: r.forward for r in results if r.kind == "probe"},
        "ops": table_ops,
        "failures": [r.as_json() for r in results if r.forward not in (CORRECT,)
                     or r.backward not in (CORRECT, NONE)],
    }


def _cell(counts: dict) -> str:
    total = sum(counts.values())
    if not total:
        return "-"
    if counts.get(CORRECT, 0) == total:
        return f"{total} correct"
    return ", ".join(f"{n} {s}" for s, n in counts.items())


def label(table: dict) -> str:
    return f"{LABELS.get(table['runtime'], table['runtime'])} {table['version']}"


def text(table: dict) -> str:
    """The table as text: a summary, what it derives, one line per op, then every failure."""
    c, g = table["cases"], table["graphs"]
    lines = [f"conformance of {label(table)} ({table['command']}; float32 against float64, within "
             f"{table['tolerance']:g} of a tensor's largest value + {table['atol']:g})",
             f"rule cases: {c['count']}; forward {_cell(c['forward'])}; backward {_cell(c['backward'])}",
             f"random graphs ({g['source']}, seed {g['seed']}): {g['count']}; forward {_cell(g['forward'])}; "
             f"backward {_cell(g['backward'])}",
             f"lacks (generated; passes/targets.py reads it): {', '.join(table['lacks']) or 'nothing'}",
             f"fails otherwise (check --target warns): {', '.join(table['fails']) or 'nothing'}", "",
             f"{'op':34s} {'forward':34s} {'backward':34s} graphs"]
    for op, e in table["ops"].items():
        graphs = f"{e['graphs'][0]}/{e['graphs'][1]} correct" if "graphs" in e else ""
        lines.append(f"{op:34s} {_cell(e['forward']):34s} {_cell(e['backward']):34s} {graphs}".rstrip())
    if table["failures"]:
        lines += ["", "failures:"]
        for f in table["failures"]:
            parts = [f"forward {f['forward']}" + (f" ({f['forward_detail']})" if f.get("forward_detail") else "")]
            if f["backward"] not in (CORRECT, NONE):
                parts.append(f"backward {f['backward']}"
                             + (f" ({f['backward_detail']})" if f.get("backward_detail") else ""))
            lines.append(f"  {f['subject']}: {'; '.join(parts)}")
    return "\n".join(lines) + "\n"


def _short(counts: dict) -> str:
    total = sum(counts.values())
    if not total:
        return "-"
    ok = counts.get(CORRECT, 0)
    if ok == total:
        return "✓"
    return f"{ok}/{total} " + ",".join(_SHORT[s] for s in counts if s != CORRECT)


MARKER_BEGIN = "<!-- conformance: generated by `onnx-autodiff conformance --markdown`; a test keeps it in sync -->"
MARKER_END = "<!-- end of the generated conformance section -->"


def markdown(tables: list[dict]) -> str:
    """The parity matrix of docs/runtimes.md (between ``MARKER_BEGIN`` and ``MARKER_END``)."""
    lines = [MARKER_BEGIN, "",
             "| runtime | rule cases: forward / backward correct | random graphs: forward / backward correct | "
             "lacks (generated) | fails otherwise |", "|---|---|---|---|---|"]
    for t in tables:
        c, g = t["cases"], t["graphs"]
        lines.append(f"| {label(t)} | {c['forward'].get(CORRECT, 0)}/{c['count']} / "
                     f"{c['backward'].get(CORRECT, 0)}/{sum(c['backward'].values())} | "
                     f"{g['forward'].get(CORRECT, 0)}/{g['count']} / {g['backward'].get(CORRECT, 0)}/{g['count']} | "
                     f"{', '.join(t['lacks']) or 'nothing'} | {', '.join(t['fails']) or 'nothing'} |")
    lines += ["", "Per op: forward · backward over its rule cases (✓ every case correct; otherwise correct/cases and "
              "what the others were: w wrong values, r refused, n not converted, l not lowered, c crashed, "
              "e error). The failing cases with the runtime's words: `onnx_autodiff/data/conformance/<runtime>.txt`.",
              "", "| op | " + " | ".join(label(t) for t in tables) + " |", "|---|" + "---|" * len(tables)]
    ops = sorted({op for t in tables for op, e in t["ops"].items() if e["forward"]})
    for op in ops:
        cells = []
        for t in tables:
            e = t["ops"].get(op)
            if e is None or not e["forward"]:
                cells.append("-")
                continue
            f, b = _short(e["forward"]), _short(e["backward"])
            cells.append("✓" if f == b == "✓" else f"{f} · {b}")
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    lines += ["", MARKER_END]
    return "\n".join(lines) + "\n"


__all__ = ["build_table", "text", "markdown", "label", "CRASHED", "REFUSALS", "MARKER_BEGIN", "MARKER_END"]
