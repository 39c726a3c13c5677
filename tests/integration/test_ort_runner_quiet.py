"""The onnxruntime bundle runner raises onnxruntime's refusals as ours, alone on stderr: onnxruntime's own
"[E:onnxruntime:...]" log line said the same thing a second time, in its words, before ours."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnx_autodiff.errors import RuntimeRefusedError
from onnx_autodiff.runtimes import ort as ort_runner


def test_a_run_refusal_is_ours_and_onnxruntime_logs_nothing(tmp_path, capfd):
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [3, 5])
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"], name="to_3x5")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [shape])
    path = tmp_path / "step.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    run = ort_runner.load(str(path))
    np.testing.assert_array_equal(run({"x": np.arange(15, dtype=np.float32)})["y"].shape, (3, 5))
    with pytest.raises(RuntimeRefusedError, match="to_3x5"):
        run({"x": np.zeros(4, np.float32)})  # 4 values cannot be 3 x 5
    assert "onnxruntime" not in capfd.readouterr().err
