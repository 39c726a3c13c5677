"""benchmarks/public_path.py on a tiny model for 3 steps: the report's fields, not its timings."""
import json

import pytest

pytest.importorskip("torch")

from benchmarks import public_path  # noqa: E402


def test_public_path_report_fields(tmp_path):
    results = public_path.main(["--models", "tiny", "--steps", "3", "--warmup", "1", "--rounds", "1",
                                "--out", str(tmp_path)])
    assert [r["model"] for r in results] == ["tiny"]
    systems = results[0]["systems"]
    assert set(systems) == set(public_path.default_kinds())  # the peer onnxsim where it is installed
    for kind, s in systems.items():
        assert s["n"] == 2  # 3 steps, the first left out
        assert 0 < s["median_ms"] <= s["p90_ms"]
        assert s["spread"] == pytest.approx(s["p90_ms"] / s["median_ms"])
        assert s["process_spread"] >= 1.0
        assert s["median_vs_torch"] == pytest.approx(s["median_ms"] / systems["torch"]["median_ms"])
        assert s["peak_mb"] > 0 and s["stages"]["steps"]["peak_mb"] >= s["stages"]["imports"]["rss_mb"]
        expected = ["imports", "session", "steps"] if kind in ("torch", "machine") else \
            ["imports", "load", "build", "session", "steps"]  # ours: "load" is empty (a path goes in)
        assert list(s["stages"]) == expected
        if kind != "machine":  # the machine's workload has no loss
            assert s["loss_diff"] < 1e-4  # the same weights and batch: the first losses agree
    assert systems["torch"]["median_vs_torch"] == 1.0
    saved = json.loads((tmp_path / "public_path.json").read_text())
    assert saved["results"][0]["systems"]["ours"]["median_ms"] == systems["ours"]["median_ms"]
    text = (tmp_path / "public_path.md").read_text()
    assert "| tiny MLP 16-8-4 | ours |" in text and "p90/median" in text and "Issue 21's targets" in text
    assert "| tiny MLP 16-8-4 | machine |" in text and "the machine's own" in text


def test_public_path_needs_the_reference():
    with pytest.raises(SystemExit):
        public_path.parse_args(["--kinds", "ours,lean"])
    with pytest.raises(SystemExit):  # the machine's workload copies the length of PyTorch's step
        public_path.parse_args(["--kinds", "machine,torch"])
