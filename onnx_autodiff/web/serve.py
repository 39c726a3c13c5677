"""A static file server on 127.0.0.1 for the browser pages (``onnx-autodiff demo --web``, the JS tests).

Routes map URL prefixes to folders (``{"/": web/, "/ort/": onnxruntime-web's dist, ...}``); nothing outside
them is served. Every answer carries the two cross-origin-isolation headers, so onnxruntime-web's wasm can use
threads (SharedArrayBuffer), and ``no-store``, so a re-exported bundle is never read from a cache.
"""
from __future__ import annotations

import os
import posixpath
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ..errors import MissingRuntimeError

WEB_DIR = Path(__file__).resolve().parent
ORT_WEB_FILE = "ort.wasm.min.mjs"  # what the page imports: onnxruntime-web's wasm build as an ES module
NPM_HINT = "run `npm install onnxruntime-web` in this directory (or pass --ort-web DIR, its dist folder)"


def find_ort_web(given: str | os.PathLike | None = None, start: str | os.PathLike = ".") -> Path:
    """The dist folder of onnxruntime-web: ``given``, else node_modules/onnxruntime-web/dist in ``start`` or a
    folder above it (where npm would have put it). Raises MissingRuntimeError saying what to run."""
    if given is not None:
        candidates = [Path(given)]
    else:
        here = Path(start).resolve()
        candidates = [p / "node_modules" / "onnxruntime-web" / "dist" for p in (here, *here.parents)]
    for dist in candidates:
        if (dist / ORT_WEB_FILE).is_file():
            return dist.resolve()
    if given is not None:
        raise MissingRuntimeError(f"--ort-web {str(given)!r} has no {ORT_WEB_FILE}: it is not onnxruntime-web's "
                                  "dist folder", hint=NPM_HINT)
    raise MissingRuntimeError(f"onnxruntime-web is not installed: no node_modules/onnxruntime-web/dist in "
                              f"{Path(start).resolve()} or a folder above it (the page loads it from this "
                              "machine, not from a CDN)", hint=NPM_HINT)


def _handler(routes: dict[str, Path]):
    prefixes = sorted(routes, key=len, reverse=True)

    class Handler(SimpleHTTPRequestHandler):
        extensions_map = {**SimpleHTTPRequestHandler.extensions_map, ".mjs": "text/javascript",
                          ".js": "text/javascript", ".wasm": "application/wasm", ".json": "application/json",
                          ".onnx": "application/octet-stream", ".bin": "application/octet-stream"}

        def translate_path(self, path: str) -> str:
            path = unquote(urlsplit(path).path)
            for prefix in prefixes:
                if path == prefix.rstrip("/") or path.startswith(prefix):
                    rest = posixpath.normpath("/" + path[len(prefix):]).lstrip("/")
                    return str(routes[prefix] / rest) if rest != "." else str(routes[prefix])
            return str(WEB_DIR / "no such route")  # a 404

        def end_headers(self) -> None:
            self.send_header("Cross-Origin-Opener-Policy", "same-origin")
            self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
            self.send_header("Cache-Control", "no-store")
            super().end_headers()

        def list_directory(self, path):
            self.send_error(404, "no directory listings")

        def log_message(self, format, *args) -> None:  # quiet: the command prints its own lines
            pass

    return Handler


def start_server(routes: dict[str, str | os.PathLike], port: int = 0) -> ThreadingHTTPServer:
    """Serve ``routes`` (URL prefix -> folder) on 127.0.0.1:``port`` (0: a free one) from a daemon thread;
    ``server.server_address[1]`` is the port, ``server.shutdown()`` stops it."""
    fixed = {("/" + p.strip("/") + "/").replace("//", "/"): Path(d).resolve() for p, d in routes.items()}
    server = ThreadingHTTPServer(("127.0.0.1", port), _handler(fixed))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


__all__ = ["start_server", "find_ort_web", "WEB_DIR", "ORT_WEB_FILE"]
