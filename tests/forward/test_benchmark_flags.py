"""The forward-mode benchmarks at a tiny size: the CPU-time and profile flags of benchmarks.forward_mode, and the
MaxPool tangent forms of benchmarks.forward_forms (which assert that every form gives the same tangent)."""
from __future__ import annotations

import re

import pytest

from benchmarks import forward_forms, forward_mode
from onnx_autodiff.engine.builder import _OPTIONS


def test_forward_mode_cpu_time_and_profile(capsys):
    assert forward_mode.main(["--models", "mlp", "--runs", "1", "--cpu-time"]) == 0
    out = capsys.readouterr().out
    assert "CPU time per run" in out
    assert re.search(r"\| MLP 784-512-512-10 \| \d+ / \d+ / \d+ / \d+ \| [\d.]+ \| [\d.]+ \| [\d.]+x", out)
    assert forward_mode.main(["--models", "mlp", "--profile", "jvp", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"jvp: \d+ nodes, kernel time [\d.]+ ms per run", out)
    assert re.search(r"\| (Fused)?Gemm \| [\d.]+ \| [\d.]+% \| \d+ \|", out)


def test_forward_forms_agree_at_a_tiny_size(capsys):
    assert forward_forms.main(["--shape", "2,3,6,4", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("x |") >= 4 and "SpaceToDepth + ArgMax + GatherElements (the rule)" in out


def test_forward_mode_emit_switches_a_form_while_building(monkeypatch):
    seen = []
    monkeypatch.setattr(forward_mode, "run", lambda args: seen.append(dict(_OPTIONS.get())) or 0)
    assert forward_mode.main(["--emit", "lstm_tangent=0", "--emit", "some_form=1"]) == 0
    assert seen == [{"lstm_tangent": False, "some_form": True}]
    with pytest.raises(SystemExit, match="NAME=0 or NAME=1"):
        forward_mode.main(["--emit", "lstm_tangent"])
