"""Node.js, onnxruntime-node/-web and Chromium for the JavaScript driver's tests (tests/js/ holds the JS side).

A piece that is missing skips the test with what to install, unless ``ONNX_AUTODIFF_REQUIRE_JS=1`` (.ci/run sets
it), where it fails: CI must run these tests, not skip them.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

JS_DIR = Path(__file__).resolve().parent / "js"
NODE_MODULES = JS_DIR / "node_modules"
ORT_WEB_DIST = NODE_MODULES / "onnxruntime-web" / "dist"
INSTALL = f"cd {JS_DIR} && ONNXRUNTIME_NODE_INSTALL=skip npm ci"


def _missing(reason: str):
    if os.environ.get("ONNX_AUTODIFF_REQUIRE_JS") == "1":
        pytest.fail(f"{reason} (ONNX_AUTODIFF_REQUIRE_JS=1: CI must run the JavaScript tests)")
    pytest.skip(reason)


def node() -> str:
    """The node executable with tests/js's packages installed, or a skip saying what to do."""
    exe = shutil.which("node")
    if exe is None:
        _missing("Node.js is not installed (apt-get install -y nodejs npm)")
    if not (NODE_MODULES / "onnxruntime-node").is_dir() or not ORT_WEB_DIST.is_dir():
        _missing(f"the JavaScript test packages are not installed: {INSTALL}")
    return exe


def chromium() -> str:
    exe = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        _missing("Chromium is not installed (apt-get install -y chromium)")
    if not (NODE_MODULES / "playwright-core").is_dir():
        _missing(f"playwright-core is not installed: {INSTALL}")
    return exe


def run_node(args: list[str], timeout: float = 600, env: dict | None = None, cwd=JS_DIR) -> subprocess.CompletedProcess:
    """Run node (in tests/js unless ``cwd``); a failure shows its output."""
    p = subprocess.run([node(), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    assert p.returncode == 0, f"node {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p


def write_batches(folder: Path, steps: list[dict[str, np.ndarray]], hyper: dict[str, list[float]]) -> Path:
    """Write ``steps`` (one feed dict per step) and per-step hyper-parameters as tests/js/tensor_files.mjs reads."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = []
    for k, feeds in enumerate(steps):
        entry = {}
        for name, a in feeds.items():
            a = np.ascontiguousarray(a)
            file = f"{k}_{len(entry)}.bin"
            (folder / file).write_bytes(a.tobytes())
            entry[name] = {"dtype": a.dtype.name, "shape": list(a.shape), "file": file}
        spec.append(entry)
    (folder / "batches.json").write_text(json.dumps({"steps": spec, "hyper": hyper}))
    return folder


def read_result(path: Path) -> tuple[list[float], dict[str, np.ndarray]]:
    """(losses, state) written by tests/js/run_bundles.mjs (``read_backend``: the backend it trained on)."""
    got = json.loads(path.read_text())
    state = {name: np.frombuffer(base64.b64decode(t["base64"]), dtype=t["dtype"]).reshape(t["shape"])
             for name, t in got["state"].items()}
    return got["losses"], state


def train_bundles(runtime: str, jobs: list[dict], origin: str | None = None, timeout: float = 600) -> None:
    """Train each job's bundle on its batches with onnx_autodiff/web/train.js: ``runtime`` "node"
    (onnxruntime-node), "web" (onnxruntime-web, wasm, in headless Chromium; paths relative to ``origin``) or
    "webgpu" (onnxruntime-web's WebGPU EP in headless Chromium, SwiftShader's software adapter)."""
    in_browser = runtime in ("web", "webgpu")
    if in_browser:
        chromium_exe = chromium()
    jobs_file = Path(jobs[0]["out"]).with_name(f"jobs-{runtime}.json")
    jobs_file.write_text(json.dumps({"origin": origin, "jobs": jobs}))
    env = {"CHROMIUM": chromium_exe} if in_browser else None
    run_node(["run_bundles.mjs", runtime, str(jobs_file)], timeout=timeout, env=env)


def read_backend(path: Path) -> str:
    return json.loads(path.read_text()).get("backend", "")


def web_routes(work: Path) -> dict[str, Path]:
    """What the browser tests serve: onnxruntime-web, onnx_autodiff/web, tests/js and a work folder."""
    from onnx_autodiff.web.serve import WEB_DIR

    return {"/ort/": ORT_WEB_DIST, "/web/": WEB_DIR, "/harness/": JS_DIR, "/work/": work}


def relative(got: np.ndarray, want: np.ndarray) -> float:
    """The largest difference between ``got`` and ``want`` relative to ``want``'s largest magnitude (absolute
    when ``want`` is all zero)."""
    scale = float(np.abs(want).max()) if want.size else 0.0
    diff = float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max()) if want.size else 0.0
    return diff / scale if scale else diff
