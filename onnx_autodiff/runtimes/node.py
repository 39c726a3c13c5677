"""onnxruntime-node as a runner, from Python: one Node.js process (``node_server.mjs``) per Python process serves the
models loaded through it, one JSON request per line on a pipe, tensors as base64 of their bytes.

It needs ``node`` on the PATH and the npm package onnxruntime-node: in ``$ONNX_AUTODIFF_NODE_MODULES`` (a
node_modules folder), else in the ``node_modules`` of the working directory or a folder above it.
"""
from __future__ import annotations

import atexit
import base64
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from ..errors import BundleError
from .loop import check_feeds
from .refusal import refused

SERVER = Path(__file__).with_name("node_server.mjs")
INSTALL = ("npm install onnxruntime-node (here or in a folder above), or set ONNX_AUTODIFF_NODE_MODULES to a "
           "node_modules folder")


def node_modules() -> Path | None:
    """The node_modules folder that holds onnxruntime-node, or None."""
    named = os.environ.get("ONNX_AUTODIFF_NODE_MODULES")
    if named:
        folder = Path(named).resolve()  # node's createRequire takes an absolute path only
        return folder if (folder / "onnxruntime-node").is_dir() else None
    here = Path.cwd()
    for folder in [here, *here.parents]:
        if (folder / "node_modules" / "onnxruntime-node").is_dir():
            return folder / "node_modules"
    return None


class _Server:
    """The Node.js process and its pipe (requests are answered in order)."""

    def __init__(self, exe: str, modules: Path):
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([exe, str(SERVER), str(modules)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1)
        self.count = 0

    def ask(self, request: dict) -> dict:
        self.count += 1
        try:
            self.proc.stdin.write(json.dumps({"id": self.count, **request}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self.log.seek(0)
            said = self.log.read().decode(errors="replace").strip().splitlines()
            raise BundleError(f"the onnxruntime-node process ended: {said[-1] if said else 'no message'}",
                              hint=INSTALL)
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)


_servers: dict[tuple, _Server] = {}


def _server() -> _Server:
    exe = shutil.which("node")
    if exe is None:
        raise BundleError("the onnxruntime-node runtime needs Node.js, which is not installed",
                          hint="apt-get install -y nodejs npm, then " + INSTALL)
    modules = node_modules()
    if modules is None:
        raise BundleError("the onnxruntime-node runtime is not installed: no node_modules/onnxruntime-node found",
                          hint=INSTALL)
    key = (exe, str(modules))
    server = _servers.get(key)
    if server is None or server.proc.poll() is not None:
        server = _servers[key] = _Server(exe, modules)
    return server


@atexit.register
def _close_all() -> None:
    for server in _servers.values():
        server.close()


def _plain(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.name, "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}


def _array(t: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(t["data"]), dtype=t["dtype"]).reshape(t["shape"]).copy()


def version() -> str:
    modules = node_modules()
    if modules is None:
        raise BundleError("the onnxruntime-node runtime is not installed", hint=INSTALL)
    return json.loads((modules / "onnxruntime-node" / "package.json").read_text())["version"]


def load(path: str):
    server = _server()
    answer = server.ask({"load": os.path.abspath(path)})
    if "error" in answer:
        raise refused("onnxruntime-node", "convert", path, RuntimeError(answer["error"]))
    session, takes = answer["session"], set(answer["inputs"])

    def run(feeds):
        check_feeds(path, "onnxruntime-node", takes, feeds)  # it would drop them without a word (docs/runtimes.md)
        out = server.ask({"run": session, "feeds": {k: _plain(np.asarray(v)) for k, v in feeds.items()}})
        if "error" in out:
            raise refused("onnxruntime-node", "run", path, RuntimeError(out["error"]))
        return {k: _array(t) for k, t in out["outputs"].items()}
    return run


__all__ = ["load", "node_modules", "version"]
