"""The NaN/Inf check of a step's run (driver/runs.py, ``add_sum_of_squares``): one float scalar, the sum of the
squares of the checked tensors, made of one reduction per tensor and scalar Adds (a Cast first for a tensor that is
not float32). Non-finite exactly when one of them is, whichever tensor and whatever its type."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnx_autodiff.driver.runs import add_sum_of_squares

TYPES = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16, np.float64: TensorProto.DOUBLE}


def _checked(arrays: list[np.ndarray]) -> tuple[onnx.ModelProto, float]:
    """A model whose outputs are its inputs (each through Identity, as a step's gradients are node outputs) plus
    their check sum; and the check's value on ``arrays``."""
    g = helper.make_graph(
        [helper.make_node("Identity", [f"x{k}"], [f"y{k}"]) for k in range(len(arrays))], "g",
        [helper.make_tensor_value_info(f"x{k}", TYPES[a.dtype.type], a.shape) for k, a in enumerate(arrays)],
        [helper.make_tensor_value_info(f"y{k}", TYPES[a.dtype.type], a.shape) for k, a in enumerate(arrays)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    out = add_sum_of_squares(m, [f"y{k}" for k in range(len(arrays))], "check")
    onnx.checker.check_model(m, full_check=True)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    value = sess.run([out], {f"x{k}": a for k, a in enumerate(arrays)})[0]
    assert value.dtype == np.float32 and value.shape == ()
    return m, float(value)


@pytest.mark.parametrize("dtypes", [[np.float32], [np.float32] * 2, [np.float32] * 5, [np.float16],
                                    [np.float64, np.float32, np.float16], [np.float32, np.float64]])
def test_the_check_is_the_sum_of_squares_and_non_finite_where_any_tensor_is(dtypes):
    rng = np.random.default_rng(len(dtypes))
    shapes = [(3, 4), (5,), (), (2, 3, 2), (7,)]
    arrays = [rng.standard_normal(shapes[k % len(shapes)]).astype(t) for k, t in enumerate(dtypes)]
    m, value = _checked(arrays)
    want = sum(float(np.sum(a.astype(np.float64) ** 2)) for a in arrays)
    assert value == pytest.approx(want, rel=1e-3)
    casts = sum(t is not np.float32 for t in dtypes)
    # one reduction a tensor, n - 1 Adds, a Cast for each tensor not in float32 (and the model's own Identities)
    ops = [n.op_type for n in m.graph.node if n.op_type != "Identity"]
    assert sorted(ops) == sorted(["ReduceSumSquare"] * len(dtypes) + ["Add"] * (len(dtypes) - 1) + ["Cast"] * casts)
    for k in range(len(arrays)):
        for bad in (np.nan, np.inf, -np.inf):
            spoilt = [a.copy() for a in arrays]
            spoilt[k].reshape(-1)[-1] = bad
            assert not np.isfinite(_checked(spoilt)[1]), (k, bad)


def test_no_tensor_no_check():
    m = helper.make_model(helper.make_graph([], "g", [], []))
    assert add_sum_of_squares(m, [], "check") is None and not m.graph.node
