"""A step-model input with an initializer default (a learning rate) may be fed or left out."""
import os
import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import TrainingSession
from tests.models import model_of

TRAIN = "ai.onnx.preview.training"


def lr_default_model():
    vi = helper.make_tensor_value_info
    w = numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "w")
    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"], name="mul")], "inference",
                              [vi("x", TensorProto.FLOAT, [2])], [vi("y", TensorProto.FLOAT, [2])], [w])
    algorithm = helper.make_graph(
        [helper.make_node("Mul", ["y", "y"], ["sq"], name="sq"),
         helper.make_node("ReduceSum", ["sq"], ["loss"], name="sum", keepdims=0),
         helper.make_node("Gradient", ["w"], ["w_grad"], name="grad", domain=TRAIN, xs=["w"], y="loss"),
         helper.make_node("Mul", ["learning_rate", "w_grad"], ["step"], name="scale"),
         helper.make_node("Sub", ["w", "step"], ["w_new"], name="update")],
        "algorithm", [vi("learning_rate", TensorProto.FLOAT, [])],
        [vi("loss", TensorProto.FLOAT, []), vi("w_new", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.array(0.1, np.float32), "learning_rate")])
    m = model_of(graph, training=True)
    ti = m.training_info.add()
    ti.algorithm.CopyFrom(algorithm)
    ti.update_binding.add(key="w", value="w_new")
    return m


def test_default_learning_rate_is_used_unless_fed():
    x = np.array([1.0, 1.0], np.float32)
    s = TrainingSession(lr_default_model())
    assert s.feed_names == ["x"]
    s.step({"x": x})  # lr 0.1 by default: w - 0.1 * 2 w x^2
    np.testing.assert_allclose(s.state["w"], [0.8, 1.6], rtol=1e-6)
    s.step({"x": x, "learning_rate": np.array(0.5, np.float32)})  # fed: w - 0.5 * 2 w
    np.testing.assert_allclose(s.state["w"], [0.0, 0.0], atol=1e-6)


def test_make_training_model_learning_rate_defaults_to_lr():
    from onnx_autodiff import make_training_model

    vi = helper.make_tensor_value_info
    w = numpy_helper.from_array(np.array([[1.0], [2.0]], np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "reg",
                              [vi("x", TensorProto.FLOAT, ["N", 2])], [vi("y", TensorProto.FLOAT, ["N", 1])], [w])
    m = model_of(graph)
    training = make_training_model(m, loss="mse", optimizer="sgd", lr=0.25)
    s = TrainingSession(training)
    assert "learning_rate" not in s.feed_names
    x, label = np.array([[1.0, 0.0]], np.float32), np.array([[0.0]], np.float32)
    s.step({"x": x, "labels": label})  # mse gradient of w[0] = 2 * (1 - 0) * 1 = 2; SGD lr 0.25
    np.testing.assert_allclose(s.state["w"], [[0.5], [2.0]], rtol=1e-6)


def test_a_session_prints_no_onnxruntime_warning():
    """The learning rate's default is bound by the driver, not kept as an initializer of a graph input
    (onnxruntime warned 'Initializer learning_rate appears in graph inputs'), even at onnxruntime's
    default log level. In a fresh process: onnxruntime's logging depends on what the process made before."""
    code = ("import numpy as np, onnxruntime as ort\n"
            "from tests.driver.test_session_defaults import lr_default_model\n"
            "from onnx_autodiff import TrainingSession\n"
            "s = TrainingSession(lr_default_model(), session_options=ort.SessionOptions(), progress=False)\n"
            "s.step({'x': np.array([1.0, 1.0], np.float32)})\n"
            "np.testing.assert_allclose(s.state['w'], [0.8, 1.6], rtol=1e-6)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "[W:onnxruntime" not in done.stderr and "learning_rate" not in done.stderr, done.stderr


def test_step_sessions_do_not_spin_unless_asked():
    """The two parts of a step run one after the other in two thread pools: spin-waiting is off by default
    (a pool spinning after its run took the cores from the other part's run); the caller's setting wins."""
    import onnxruntime as ort

    s = TrainingSession(lr_default_model(), progress=False)
    assert s._options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    mine = ort.SessionOptions()
    mine.add_session_config_entry("session.intra_op.allow_spinning", "1")
    s = TrainingSession(lr_default_model(), session_options=mine, progress=False)
    assert s._options.get_session_config_entry("session.intra_op.allow_spinning") == "1"


def test_step_sessions_share_one_cpu_arena_unless_told_otherwise():
    """The gradient part and the update part allocate from one process-wide CPU arena (two arenas add up
    and neither is given back); a caller who turns the arena off, or says not to use it, is obeyed, and
    the step gives the same result every way."""
    import onnxruntime as ort

    results = []
    for setting in ("default", "no arena", "own arenas"):
        so = ort.SessionOptions()
        if setting == "no arena":
            so.enable_cpu_mem_arena = False
        if setting == "own arenas":
            so.add_session_config_entry("session.use_env_allocators", "0")
        s = TrainingSession(lr_default_model(), session_options=so, progress=False)
        want = "1" if setting == "default" else ("0" if setting == "own arenas" else None)
        if want is None:
            with pytest.raises(RuntimeError):
                s._options.get_session_config_entry("session.use_env_allocators")
        else:
            assert s._options.get_session_config_entry("session.use_env_allocators") == want
        s.step({"x": np.array([1.0, 1.0], np.float32)})
        results.append(s.state["w"])
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])
