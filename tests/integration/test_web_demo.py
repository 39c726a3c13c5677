"""``onnx-autodiff demo --web``: the page trains the digits CNN in headless Chromium (onnxruntime-web, wasm) to at
least 95% test accuracy, read from the page (#accuracy's data-accuracy); where the browser has WebGPU (SwiftShader's
software adapter) the page trains on WebGPU, says so, and reaches 95% too (6 epochs: software WebGPU takes about
0.65 s a step here, 12 epochs would take 6 minutes); and without onnxruntime-web the command stops with what to
run."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from onnx_autodiff.cli import main
from tests.js_runtime import ORT_WEB_DIST, chromium, run_node


def _url(proc: subprocess.Popen, timeout: float = 180) -> str:
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        found = re.search(r"http://127\.0\.0\.1:\d+/", line)
        if found:
            return found.group(0)
    proc.kill()
    raise AssertionError("demo --web printed no URL:\n" + "".join(lines) + proc.stderr.read())


@pytest.mark.slow
def test_demo_web_trains_to_95_percent_in_chromium(tmp_path):
    chromium()
    run_node(["--version"])
    proc = subprocess.Popen([sys.executable, "-m", "onnx_autodiff", "demo", "--web", "--port", "0", "--out",
                             str(tmp_path), "--ort-web", str(ORT_WEB_DIST)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        url = _url(proc)
        page = json.loads(run_node(["web_demo.mjs", url, "400"], timeout=500).stdout)
        gpu = json.loads(run_node(["web_demo.mjs", url + "?epochs=6", "560", "webgpu"], timeout=600).stdout)
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"\ndemo --web in Chromium: {page}")
    assert page["status"] == "done", page
    assert page["pageErrors"] == [], page
    assert page["accuracy"] >= 0.95, page
    # the chart has an axis of each kind: round loss values up from 0, and the epochs 0..12 at their ends
    y_ticks = [float(v) for v in page["yTicks"].split()]
    assert len(y_ticks) >= 4 and y_ticks[0] == 0 and y_ticks == sorted(y_ticks), page
    assert page["xTicks"].split() == [str(e) for e in range(13)], page
    # with a (software) WebGPU adapter the page trains on WebGPU (the bundle's MaxPool gradient reads no Indices)
    print(f"demo --web in Chromium with WebGPU: {gpu['backend']}; {gpu['summary']}; {gpu['accuracy']:.2%}")
    assert gpu["status"] == "done" and gpu["pageErrors"] == [], gpu
    assert gpu["backend"].endswith(", webgpu"), gpu  # not "wasm (webgpu failed: ...)"
    assert gpu["accuracy"] >= 0.95, gpu


def test_demo_web_without_onnxruntime_web_says_what_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--web", "--port", "0", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "onnxruntime-web is not installed" in err and "npm install onnxruntime-web" in err, err
    assert not (tmp_path / "out").exists()  # it stops before writing anything
    assert main(["demo", "--web", "--ort-web", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert f"--ort-web {str(tmp_path)!r} has no ort.wasm.min.mjs" in capsys.readouterr().err
