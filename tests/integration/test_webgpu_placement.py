"""``check --target webgpu`` lists exactly the nodes onnxruntime's WebGPU execution provider runs on the CPU (issue 35:
it named 2, Size and Shape, where the plugin EP places 4 of the demo CNN's step with a symbolic batch: Cast, Gather,
Shape, Size), and ``export-step --target webgpu`` names the ``--dim`` fix. With the plugin (and a software adapter,
tests/webgpu_runtime.py) check asks the EP; without it the list is predicted from the record, and says so."""
from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest

from onnx_autodiff import make_training_model
from onnx_autodiff.cli import main
from onnx_autodiff.cli.demo import cnn_model
from onnx_autodiff.driver.devices import FALLBACK_OFF
from onnx_autodiff.errors import MissingRuntimeError
from tests.webgpu_runtime import webgpu_device


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    path = tmp_path_factory.mktemp("placement") / "cnn.onnx"
    onnx.save(make_training_model(cnn_model(0), "cross_entropy", "adam"), path)
    return path


def _session(path, strict: bool):
    """A plain session of the plugin EP on ``path`` (its default options, as a user's own script opens it)."""
    device = webgpu_device()
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    if strict:
        options.add_session_config_entry(FALLBACK_OFF, "1")
    options.add_provider_for_devices(device.ep_devices, {})
    return ort.InferenceSession(str(path), options)


def test_check_lists_what_the_plugin_places_on_the_cpu(cnn, tmp_path, capsys):
    webgpu_device()
    assert main(["export-step", str(cnn), str(tmp_path / "b"), "--target", "webgpu"]) == 0
    assert "--dim N=SIZE" in capsys.readouterr().out
    sess = _session(tmp_path / "b" / "step.onnx", strict=False)
    on_cpu = sorted((n.op_type, n.name) for sub in sess.get_provider_graph_assignment_info() for n in sub.get_nodes()
                    if sub.ep_name == "CPUExecutionProvider")
    assert on_cpu, "the symbolic batch leaves shape arithmetic to the CPU"
    with pytest.raises(Exception, match="fallback to CPU EP has been explicitly disabled"):
        _session(tmp_path / "b" / "step.onnx", strict=True)

    from onnx_autodiff.runtimes.placement import cpu_placement, placement_lines

    placed = cpu_placement(str(cnn), "webgpu")
    assert placed.asked and sorted(placed.nodes) == on_cpu
    lines = placement_lines(str(cnn), "webgpu")  # what check --target webgpu prints
    assert f"runs {len(on_cpu)} node(s) of the step on the CPU" in lines[0]
    assert sorted((line.split()[0], line.split("'")[1]) for line in lines[1:1 + len(on_cpu)]) == on_cpu
    assert {op for op, _ in on_cpu} >= {"Shape", "Size"}

    # with the batch fixed, the EP itself takes a session with the fallback off, and check says every node is on it
    assert main(["export-step", str(cnn), str(tmp_path / "s"), "--target", "webgpu", "--dim", "N=8"]) == 0
    assert "note:" not in capsys.readouterr().out
    _session(tmp_path / "s" / "step.onnx", strict=True)
    assert cpu_placement(str(cnn), "webgpu", {"N": 8}).nodes == []


def test_without_the_plugin_the_list_is_predicted_and_says_so(cnn, monkeypatch, capsys):
    import onnx_autodiff.driver.devices as devices

    def no_plugin():
        raise MissingRuntimeError("the WebGPU execution provider is not installed", hint="pip install ...")
    monkeypatch.setattr(devices, "webgpu_ep_device", no_plugin)
    assert main(["check", str(cnn), "--target", "webgpu"]) == 0
    out = capsys.readouterr().out
    assert "webgpu is not available here: the WebGPU execution provider is not installed" in out
    assert "predicted from the webgpu record, as the WebGPU execution provider is not installed" in out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ") and "'" in line]
    # the shape ops of the symbolic batch, and the int64 arithmetic on them (onnxruntime-web has no int64 kernels)
    assert "Shape" in listed and "Size" in listed and "Cast" in listed, out
    assert "export-step --target webgpu --dim N=SIZE" in out
    assert main(["check", str(cnn), "--target", "webgpu", "--dim", "N=8"]) == 0
    assert "runs every node of the step on its webgpu execution provider (predicted" in capsys.readouterr().out


def test_export_step_says_the_dim_fix_only_where_it_applies(cnn, tmp_path, capsys):
    assert main(["export-step", str(cnn), str(tmp_path / "p")]) == 0  # portable: no execution provider to place on
    assert "note:" not in capsys.readouterr().out
    assert main(["export-step", str(cnn), str(tmp_path / "w"), "--target", "webgpu"]) == 0
    out = capsys.readouterr().out
    assert "note: the feeds have the symbolic dim(s) N" in out and "export again with --dim N=SIZE" in out
