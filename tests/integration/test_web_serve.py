"""onnx_autodiff/web/serve.py: only the routed folders, on 127.0.0.1, with the headers onnxruntime-web needs."""
from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from onnx_autodiff.errors import MissingRuntimeError
from onnx_autodiff.web.serve import find_ort_web, start_server


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {}, b""


def test_serves_routed_files_with_isolation_headers_and_nothing_else(tmp_path):
    (tmp_path / "site" / "sub").mkdir(parents=True)
    (tmp_path / "site" / "a.mjs").write_text("export default 1;")
    (tmp_path / "site" / "sub" / "b.wasm").write_bytes(b"\0asm")
    (tmp_path / "secret.txt").write_text("no")
    server = start_server({"/x/": tmp_path / "site"})
    host, port = server.server_address
    base = f"http://127.0.0.1:{port}"
    try:
        assert host == "127.0.0.1"
        status, headers, body = _get(f"{base}/x/a.mjs")
        assert (status, body) == (200, b"export default 1;")
        assert headers["content-type"] == "text/javascript"
        assert headers["cross-origin-opener-policy"] == "same-origin"
        assert headers["cross-origin-embedder-policy"] == "require-corp"
        status, headers, _ = _get(f"{base}/x/sub/b.wasm")
        assert (status, headers["content-type"]) == (200, "application/wasm")
        for path in ("/x/../secret.txt", "/x/%2e%2e/secret.txt", "/secret.txt", "/x/sub/", "/x/"):
            assert _get(base + path)[0] == 404, path
    finally:
        server.shutdown()


def test_find_ort_web_looks_in_node_modules_above(tmp_path):
    dist = tmp_path / "node_modules" / "onnxruntime-web" / "dist"
    dist.mkdir(parents=True)
    with pytest.raises(MissingRuntimeError, match="onnxruntime-web is not installed") as e:
        find_ort_web(start=tmp_path / "deeper")
    assert "npm install onnxruntime-web" in e.value.hint
    (dist / "ort.wasm.min.mjs").write_text("")
    (tmp_path / "deeper").mkdir()
    assert find_ort_web(start=tmp_path / "deeper") == dist.resolve()
    assert find_ort_web(dist) == dist.resolve()
