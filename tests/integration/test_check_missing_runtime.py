"""``check --target portable`` skips a runtime that is not installed here and says so; it never turns a healthy model
into a failure (issue 35: a missing WebGPU execution provider was "MISSING", "not ok", exit 1). The runtimes are made
missing as an installation without them would be: their package cannot be imported, or the WebGPU plugin is absent."""
from __future__ import annotations

import re
import sys

import onnx
import pytest

from onnx_autodiff import make_training_model
from onnx_autodiff.cli import main
from onnx_autodiff.cli.demo import cnn_model
from onnx_autodiff.errors import MissingRuntimeError


def _without(monkeypatch, *packages: str) -> None:
    """As if ``packages`` and the WebGPU plugin were not installed: importing them fails, our runner modules that
    import them are loaded again, and the WebGPU device is refused as ``webgpu_ep_device`` refuses a missing plugin."""
    import onnx_autodiff.driver.devices as devices

    for name in packages:
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, f"onnx_autodiff.runtimes.{name}", raising=False)

    def no_plugin():
        raise MissingRuntimeError("the WebGPU execution provider is not installed",
                                  hint="pip install 'onnx-autodiff[webgpu]' (onnxruntime-ep-webgpu)")
    monkeypatch.setattr(devices, "webgpu_ep_device", no_plugin)


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    path = tmp_path_factory.mktemp("missing") / "cnn.onnx"
    onnx.save(make_training_model(cnn_model(0), "cross_entropy", "adam"), path)
    return str(path)


def test_portable_skips_what_is_not_installed(cnn, monkeypatch, capsys):
    pytest.importorskip("tract")
    _without(monkeypatch, "openvino")
    assert main(["check", cnn, "--target", "portable"]) == 0
    out = capsys.readouterr().out
    assert "openvino is not installed here, so the step was not run on it" in out
    assert ("webgpu is not available here: the WebGPU execution provider is not installed, so the step was not run "
            "on it") in out
    assert re.search(r"^tract [\d.]+: converted the step bundle .* agree with onnxruntime$", out, re.M), out
    # OpenVINO's table warns of the CNN's Conv: unconfirmed, said, and no failure under portable
    assert "WARNING: openvino's conformance table" in out
    assert "not confirmed on openvino" in out
    assert "MISSING" not in out and "not ok" not in out
    assert out.rstrip().splitlines()[-1].startswith("ok by the conformance tables: the model trains on portable")
    assert "not run on " in out.rstrip().splitlines()[-1] and "openvino" in out.rstrip().splitlines()[-1]


def test_the_runtime_asked_about_is_not_confirmed_without_it(cnn, monkeypatch, capsys):
    """``--target openvino`` without OpenVINO: its table's warnings cannot be confirmed here, which is said (not ok)."""
    _without(monkeypatch, "openvino")
    assert main(["check", cnn, "--target", "openvino"]) == 1
    out = capsys.readouterr().out
    assert "openvino is not installed here, so the step was not run on it" in out
    assert "not confirmed: openvino is not installed here to run the step" in out


def test_a_missing_runtime_without_warnings_is_only_skipped(cnn, monkeypatch, capsys):
    """tract's table warns of nothing an MLP has: without tract, --target portable is ok and says it did not run."""
    _without(monkeypatch, "tract", "openvino")
    from tests.cli_models import mlp

    path = cnn.replace("cnn.onnx", "mlp.onnx")
    onnx.save(make_training_model(mlp(hidden=8, features=4, classes=3), "cross_entropy", "sgd"), path)
    assert main(["check", path, "--target", "portable"]) == 0
    out = capsys.readouterr().out
    assert "tract is not installed here, so the step was not run on it" in out
    assert "not ok" not in out
