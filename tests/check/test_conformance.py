"""The conformance tables: checked in for five runtimes with their versions, read into the targets' ``lacks``,
shown in docs/runtimes.md (kept in sync here); the derivation of lacks from results; a small run end to end."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from onnx_autodiff.cli import main
from onnx_autodiff.conformance import checked_in_tables, conformance, docs_section
from onnx_autodiff.conformance.run import CORRECT, NONE, NOT_CONVERTED, WRONG, Result
from onnx_autodiff.conformance.tables import MARKER_BEGIN, MARKER_END, build_table
from onnx_autodiff.runtimes.targets import HAND_WRITTEN, RUNTIMES, TABLES, TARGETS

DOC = Path(__file__).resolve().parents[2] / "docs" / "runtimes.md"
FIVE = ["onnxruntime", "reference", "openvino", "tract", "onnxruntime-node"]


def test_five_runtimes_have_a_checked_in_table_with_their_version():
    tables = {t["runtime"]: t for t in checked_in_tables()}
    assert sorted(tables) == sorted(FIVE)
    for name, table in tables.items():
        assert table["version"] and table["cases"]["count"] > 400, name
        assert (TABLES / f"{name}.txt").read_text().startswith("conformance of ")


@pytest.mark.parametrize("runtime", FIVE)
def test_the_target_lacks_what_its_table_says(runtime):
    table = json.loads((TABLES / f"{runtime}.json").read_text())
    assert RUNTIMES[runtime].lacks == frozenset(table["lacks"]) | HAND_WRITTEN.get(runtime, frozenset())
    assert RUNTIMES[runtime].table == runtime
    assert TARGETS["portable"].lacks >= RUNTIMES[runtime].lacks


def test_what_the_tables_found():
    """The facts the targets were hand-written with before, now measured, and those found since."""
    lacks = {t["runtime"]: set(t["lacks"]) for t in checked_in_tables()}
    assert {"MaxUnpool", "Dropout", "Det", "NegativeLogLikelihoodLoss[ignore_index]",
            "ReduceSum[axes of run-time length]"} <= lacks["openvino"]
    assert {"MaxUnpool", "Det", "Unique", "Col2Im", "SoftmaxCrossEntropyLoss",
            "NegativeLogLikelihoodLoss"} <= lacks["tract"]
    assert "NegativeLogLikelihoodLoss" not in lacks["openvino"]  # only with ignore_index
    assert lacks["onnxruntime"] == lacks["onnxruntime-node"] == {"LSTM[layout=1]"}


def test_docs_runtimes_section_matches_the_tables():
    text = DOC.read_text()
    begin, end = text.index(MARKER_BEGIN), text.index(MARKER_END) + len(MARKER_END) + 1
    assert text[begin:end] == docs_section(), (
        "docs/runtimes.md's conformance section is stale: replace it with `onnx-autodiff conformance --markdown`")


def _case(name, forward, opset=17, attrs=None, backward=CORRECT):
    return Result(name, "case", [name.split("-")[0]], attrs or {}, "", forward, backward, opset=opset)


def test_lacks_are_the_narrowest_entry_covering_the_failing_cases():
    results = [
        _case("Loss-a", CORRECT, attrs={"reduction": "mean"}),
        _case("Loss-b", NOT_CONVERTED, attrs={"reduction": "mean", "ignore_index": "1"}),
        _case("Rnn-a", CORRECT, attrs={"layout": "0"}), _case("Rnn-b", NOT_CONVERTED, attrs={"layout": "1"}),
        _case("Soft-a", WRONG, opset=11), _case("Soft-b", CORRECT, opset=11), _case("Soft-c", CORRECT, opset=13),
        _case("Old-a", NOT_CONVERTED, opset=9), _case("Old-b", CORRECT, opset=13),
        _case("Edge-a", NOT_CONVERTED), _case("Edge-b", CORRECT),  # no trait tells them apart, no standard form
        _case("MaxUnpool-a", NOT_CONVERTED), _case("MaxUnpool-b", CORRECT),  # a standard form exists
        _case("Gone-a", NOT_CONVERTED), _case("Gone-b", NOT_CONVERTED),
        _case("Back-a", CORRECT, attrs={"p": "1"}, backward=WRONG), _case("Back-b", CORRECT, attrs={"p": "2"}),
        Result("probe", "probe", ["ReduceSum"], {}, "", NOT_CONVERTED, NONE, token="ReduceSum[feature]"),
    ]
    table = build_table("rt", "1.0", results, graphs="none", seed=0)
    assert table["lacks"] == ["Gone", "Loss[ignore_index]", "MaxUnpool", "Old[opset<13]", "ReduceSum[feature]",
                              "Rnn[layout=1]"]
    # what lacks does not cover: check --target warns (an opset bound may cover passing cases: Soft-b)
    assert table["fails"] == ["Back[p=1]", "Edge", "Soft[opset<13]"]
    assert table["fails_cases"]["Back[p=1]"] == ["Back-a (backward wrong values)"]
    assert table["ops"]["Soft"] == {"forward": {CORRECT: 2, WRONG: 1}, "backward": {CORRECT: 3}}


def test_an_op_both_probed_and_failing_its_cases_is_listed_once():
    """tract's table listed Col2Im twice: once from its rule cases, once from the probe of its forms."""
    results = [_case("Col-a", NOT_CONVERTED), _case("Col-b", NOT_CONVERTED),
               Result("probe", "probe", ["Col"], {}, "", NOT_CONVERTED, NONE, token="Col")]
    assert build_table("rt", "1.0", results, graphs="none", seed=0)["lacks"] == ["Col"]
    for table in checked_in_tables():
        assert len(set(table["lacks"])) == len(table["lacks"]), table["runtime"]


def test_a_small_run_on_onnxruntime(tmp_path, capsys):
    tables = conformance(["onnxruntime"], graphs=4, ops=["Tanh", "Softmax"], progress=False)
    table = tables["onnxruntime"]
    assert table["cases"]["forward"] == {CORRECT: table["cases"]["count"]}
    assert table["graphs"]["count"] == 4 and table["lacks"] == []
    assert set(table["ops"]) >= {"Tanh", "Softmax"}
    assert main(["conformance", "--runtime", "onnxruntime", "--ops", "Tanh", "--graphs", "1", "--quiet",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "conformance of onnxruntime" in out and (tmp_path / "onnxruntime.json").is_file()


def test_conformance_cli_needs_a_runtime_and_prints_the_docs_section(capsys):
    assert main(["conformance"]) == 2
    assert "--runtime R" in capsys.readouterr().err
    assert main(["conformance", "--markdown"]) == 0
    assert capsys.readouterr().out == docs_section()


def test_graph_sources_are_deterministic():
    from onnx_autodiff.conformance.subjects import chain_graphs, registry_graphs

    pytest.importorskip("hypothesis")
    first = [(s.name, s.ops, s.model.SerializeToString()) for s in chain_graphs(3, seed=1)]
    assert first == [(s.name, s.ops, s.model.SerializeToString()) for s in chain_graphs(3, seed=1)]
    drawn = list(registry_graphs(3, seed=1))
    assert len(drawn) == 3 and all(s.kind == "graph" and s.ops and s.wrt for s in drawn)
    assert [s.model.SerializeToString() for s in drawn] == [s.model.SerializeToString()
                                                             for s in registry_graphs(3, seed=1)]
