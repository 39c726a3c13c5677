"""Every benchmark command runs: each entry point of benchmarks/ at its tiny size in its own process, exit 0 and its
result table (or result line) printed. Its numbers are not checked: at these sizes they mean nothing. A new benchmark
module with a ``__main__`` fails ``test_every_entry_point_has_a_smoke_case`` until it gets a case here."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")

# module -> (the commands, "{tmp}" standing for a fresh folder; a pattern the last command's stdout must match;
# the Python packages it needs beyond the test extra's core)
CASES = {
    "run": ([["--tiny", "--out", "{tmp}"]], r"\| MLP 784-512-512-10 \| 1 \|[^\n]*\n(.*\n)*\| chain of 100 nodes \|",
            ["torch"]),
    "lower_chain": ([["100"]], r"(?m)^\s+100 nodes\s+wall\s+[\d.]+ s\s+cpu", []),
    "setup_phases": ([["--tiny"]], r"(?m)^TOTAL set-up to the first step\s+[\d.]+\s+[\d.]+$", []),
    "profile": ([["mlp", "--steps", "1", "--top", "3"],  # then against this checkout itself: both sides' tables
                 ["mlp", "--steps", "1", "--top", "3", "--against", ROOT, "--rounds", "1"]],
                r"\| op type / part \| before ms \|(.*\n)*\| backward of forward node \|", ["torch"]),
    "forward_mode": ([["--models", "mlp", "--runs", "1"]], r"\| MLP 784-512-512-10 \| \d+ / \d+ / \d+ / \d+ \|",
                     ["torch"]),
    "conv_grad_micro": ([["cnn1"]], r"cnn1 weight gradient: offsets [\d.]+ ms, im2col [\d.]+ ms", []),
    "rewrite_micro": ([["maxpool", "1"]], r"maxpool: [\d.]+ ms CPU \(median of 1\)", []),
    "transformer_forms": ([["layernorm", "1", "--tiny"]], r"new form \(layer_norm_kernel_moments=True\): [\d.]+ ms",
                          []),
    "maxpool_forms": ([["1", "8,4,8,8"]], r"(?m)^\s+[\d.]+ ms\s+MaxPool with Indices \+ MaxUnpool \(the rule\)", []),
    "profile_peer": ([["tiny", "--steps", "2", "--rounds", "1", "--kinds", "ours"]],
                     r"\| optimizer \| [\d.]+ \(\d+\) \|(.*\n)*\| onnxruntime runs a step \| 2 \|", ["torch"]),
    "profile_opset": ([["18", "mlp", "--steps", "1", "--top", "3", "--against", ROOT, "--rounds", "1"]],
                      r"mlp at opset 18, 1 thread\(s\), 1 steps per run(.*\n)*\| backward of forward node \|",
                      ["torch"]),
    "int8_backward": ([["--shapes", "64x256x128", "--rounds", "1"]],
                      r"\| \[64, 256\] @ \[256, 128\] \| gauss \| int8 per row \|", []),
    "step_memory": ([["tiny", "--steps", "1", "--threads", "1"]], r"step 1 \([\d.]+ s\): rss \d+ MB", []),
    "distributed": ([["prepare", "{tmp}", "--models", "mlp"], ["run", "{tmp}", "mlp", "--steps", "1"]],
                    r'"model": "mlp", "processes": 1, .*"samples_per_s"', []),
    # slow: transformers models exported (dynamo for the LoRA ones) and trained in several processes each
    "remat": ([["--tiny"]], r"\| ours, budget 1, priority order \| \d+", ["transformers", "networkx"]),
    "llm_lora": ([["--tiny", "--workdir", "{tmp}"]], r"\| ours / PEFT \|", ["transformers", "peft"]),
    "genai_lora": ([["--tiny", "--workdir", "{tmp}"]], r"\| ours / PEFT float32 \|",
                   ["transformers", "peft", "onnxruntime_genai"]),
    "genai_int8": ([["--tiny", "--workdir", "{tmp}", "loss"], ["--tiny", "--workdir", "{tmp}", "grad-error"]],
                   r"\| ours int8 vs ours float32 \| \d+ \| [\d.e+-]+ \|",
                   ["transformers", "peft", "onnxruntime_genai"]),
    "mixed_precision": ([["--tiny", "--workdir", "{tmp}"]], r"fp16 vs fp32: loss within", ["transformers"]),
    "lm_loss_memory": ([["--tiny", "--workdir", "{tmp}"]], r'"vocab_sized": \d+', ["transformers"]),
    "federated": ([["--tiny", "--no-centralized"]], r"\| 2 \| [\d.]+ \| [\d.]+ \|", ["flwr"]),
    "profile_layers": ([["--tiny", "--match", "act_fn"]], r"backward of nodes named \*act_fn\*", ["transformers"]),
}
# CPU seconds of each slow case on the 2-core machine (measured 2026-12-07): remat 27, llm_lora 27, genai_lora 18,
# lm_loss_memory 17, mixed_precision 11, genai_int8 20 (two runs); federated (Ray starts: about 1 min of wall
# time, 8 s of CPU); profile_layers 10 (a tiny BERT exported, profiled in a process of its own); .ci/run runs them
# (-m slow)
SLOW = {"remat", "llm_lora", "genai_lora", "mixed_precision", "lm_loss_memory", "federated", "profile_layers",
        "genai_int8"}
# entry points with a test of their own, or that are not commands a user runs
ELSEWHERE = {"public_path": "tests/integration/test_public_path_bench.py",  # a tiny run, the report's fields
             # (issue 38's models at their tiny size: test_public_path_issue_38_models_at_tiny_size below)
             "forward_forms": "tests/forward/test_benchmark_flags.py",  # a tiny run: every form's tangent agrees
             "worker": "benchmarks/run.py"}  # the process benchmarks.run drives over stdin; --tiny runs it


def entry_points() -> list[str]:
    names = []
    for f in sorted(os.listdir(BENCH)):
        if f.endswith(".py"):
            with open(os.path.join(BENCH, f)) as fh:
                if re.search(r'^if __name__ == "__main__":', fh.read(), re.M):
                    names.append(f[:-3])
    return names


def test_every_entry_point_has_a_smoke_case():
    found = entry_points()
    assert "run" in found and "lower_chain" in found  # the scan itself works
    missing = [n for n in found if n not in CASES and n not in ELSEWHERE]
    assert not missing, f"benchmarks without a smoke case: {missing}; add each to CASES (a tiny-size command)"
    stale = [n for n in list(CASES) + list(ELSEWHERE) if n not in found]
    assert not stale, f"smoke cases of modules that are no entry point: {stale}"
    for name, path in ELSEWHERE.items():
        with open(os.path.join(ROOT, path)) as f:
            assert name in f.read(), f"{path} does not run benchmarks.{name}"


def _params():
    for name in CASES:
        marks = [pytest.mark.slow] if name in SLOW else []
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", list(_params()))
def test_benchmark_runs_at_its_tiny_size(name, tmp_path):
    _run(name, *CASES[name], tmp_path)


@pytest.mark.slow  # about 18 s of CPU: a transformers model exported, three worker processes
def test_run_real_size_path_at_tiny_size(tmp_path):
    """benchmarks.run's real-size rows (the set-up done in the worker from the model's path) on a 2-layer BERT."""
    _run("run", [["--tiny", "--models", "bert-tiny", "--no-lowering", "--out", "{tmp}"]],
         r"\| tiny BERT [^|]*\| 1 \| [\d.]+ s, \d+ / \d+ \| [\d.]+ s, \d+ / \d+ \|", ["transformers"], tmp_path)


@pytest.mark.slow  # about 27 s of CPU: a transformers model exported, four processes that import torch or onnxruntime
def test_public_path_issue_38_models_at_tiny_size(tmp_path):
    """benchmarks.public_path's ResNet-18 and GPT-2 LM graphs at their tiny size: every column of issue 38's bound
    (our step against the model's own forward, the FLOPs of both) is there and positive."""
    _run("public_path", [["--models", "resnet18-tiny,gpt2s-tiny", "--steps", "3", "--warmup", "1", "--rounds", "1",
                          "--kinds", "ours,torch", "--out", "{tmp}"]],
         r"\| step / forward \(target <= 3.5\) \| step FLOPs / forward FLOPs \|(.*\n)*"
         r"\| tiny GPT-2 LM [^|]*\| [\d.]+ \|",
         ["torch", "transformers"], tmp_path)
    with open(tmp_path / "public_path.json") as f:
        results = json.load(f)["results"]
    assert [r["model"] for r in results] == ["resnet18-tiny", "gpt2s-tiny"]
    for r in results:
        ours = r["systems"]["ours"]
        assert ours["forward_ms"] > 0 and ours["step_vs_forward"] > 0 and ours["flops_ratio"] > 0, r["model"]
        for side in ("forward", "step"):
            flops = ours["flops"][side]
            assert flops["unknown"] == 0 and flops["total"] == sum(flops["by_op"].values()) > 0, (r["model"], side)
        assert "step_vs_forward" not in r["systems"]["torch"]
        assert r["systems"]["torch"]["loss_diff"] < 1e-4, r["model"]  # the same module, weights and batch
    cnn, lm = results
    assert "Conv" in cnn["systems"]["ours"]["flops"]["forward"]["by_op"]
    # the GPT-2 LM: every product's input gradient is needed but the token embedding's (a Gather): 3x exactly
    assert lm["systems"]["ours"]["flops_ratio"] == pytest.approx(3.0)


def _run(name: str, commands: list, pattern: str, needs: list, tmp_path) -> None:
    for module in needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               BENCH_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONWARNINGS="ignore,default::DeprecationWarning")  # ours shown: a benchmark uses no deprecated form
    for args in commands:
        argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
        p = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *argv], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"benchmarks.{name} {' '.join(argv)}: exit {p.returncode}\n{p.stderr[-3000:]}"
        assert "goes in the release after next" not in p.stderr, f"benchmarks.{name} uses a deprecated form:\n" \
            + "\n".join(line for line in p.stderr.splitlines() if "deprecated" in line)
    assert re.search(pattern, p.stdout), f"benchmarks.{name} printed no result table:\n{p.stdout[-3000:]}"


def test_quick_waits_a_bounded_time_and_says_so(monkeypatch, capsys):
    """On a machine whose load never drops, a row waits --settle at most, saying what it waits for, then times
    anyway; --quick's defaults bound the whole run's waiting (--max-wait), --tiny never waits."""
    import time

    from benchmarks import run

    quick = run.parse_args(["--quick"])
    assert (quick.settle, quick.retries, quick.max_wait, quick.wait_left) == (20.0, 0, 60.0, 60.0)
    full = run.parse_args([])
    assert (full.settle, full.retries, full.max_wait) == (90.0, 2, float("inf"))
    tiny = run.parse_args(["--tiny"])
    assert (tiny.wait_left, tiny.names, tiny.thread_counts, tiny.quick) == (0.0, ["mlp"], [1], True)
    assert run.parse_args(["--quick", "--settle", "5", "--max-wait", "7"]).wait_left == 7.0

    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    start = time.monotonic()
    waited = run.wait_quiet(1.0, 0.3, "[mlp x2] ")
    assert 0.25 <= waited and time.monotonic() - start < 3.0
    err = capsys.readouterr().err
    assert "[mlp x2] load 9.00 > --max-load 1.0: waiting up to 0 s (--settle)" in err
    assert "timing anyway; the row will be marked noisy" in err
    assert run.wait_quiet(1.0, 0.0) == 0.0  # no time left: no wait, no line
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    assert run.wait_quiet(1.0, 30.0) == 0.0  # quiet already
