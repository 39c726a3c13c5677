"""ReduceMean's gradient divides dy while it has the reduced size, then spreads it (issue 38): every form of the
node (axes as attribute / constant input / run-time input / none, keepdims 0 and 1, noop_with_empty_axes, negative
axes, a symbolic dim) against numpy's ``broadcast(dy) / count``, and the order of the emitted nodes checked."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff import build_vjp
from tests.models import run_ort


def _model(x_shape, opset, axes_input, attrs, y_rank=None):
    """One ReduceMean of x (``axes_input``: None, a list for a constant input, or "feed" for a run-time input; then
    ``y_rank`` is y's rank)."""
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))]
    inits, names = [], ["x"]
    if axes_input == "feed":
        inputs.append(helper.make_tensor_value_info("axes", TensorProto.INT64, [None]))
        names.append("axes")
    elif axes_input is not None:
        inits.append(numpy_helper.from_array(np.asarray(axes_input, np.int64), "axes"))
        names.append("axes")
    node = helper.make_node("ReduceMean", names, ["y"], **attrs)
    if y_rank is None:
        axes = attrs.get("axes", axes_input)
        noop = attrs.get("noop_with_empty_axes", 0) and not axes
        axes = [] if noop else list(range(len(x_shape))) if not axes else axes
        y_shape = list(np.mean(np.zeros(x_shape), axis=tuple(axes), keepdims=bool(attrs.get("keepdims", 1))).shape)
    else:
        y_shape = [f"y{k}" for k in range(y_rank)]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)
    graph = helper.make_graph([node], "m", inputs, [y], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _expected(x, dy, axes, keepdims, noop):
    """numpy's gradient of mean(x, axes): dy broadcast back over the reduced axes, over their count."""
    if axes is None or len(axes) == 0:
        if noop:
            return dy
        axes = list(range(x.ndim))
    axes = sorted(a % x.ndim for a in axes)
    d = dy if keepdims else np.expand_dims(dy, axes)
    return np.broadcast_to(d, x.shape) / np.prod([x.shape[a] for a in axes])


FORMS = [  # (opset, axes input, attributes, the axes the test feeds at run time)
    (13, None, {"axes": [1, 2], "keepdims": 0}, None),
    (13, None, {"axes": [-1]}, None),
    (13, None, {"keepdims": 0}, None),
    (17, None, {"axes": [0, -2], "keepdims": 1}, None),
    (18, [1], {"keepdims": 0}, None),
    (18, [-1, 0], {}, None),
    (18, None, {"keepdims": 0}, None),
    (18, None, {"keepdims": 1}, None),
    (18, None, {"noop_with_empty_axes": 1}, None),
    (18, [], {"noop_with_empty_axes": 1}, None),
    (18, [], {"keepdims": 0}, None),
    (18, "feed", {"keepdims": 0}, [2, 0]),
    (18, "feed", {"keepdims": 1}, [-1]),
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("opset,axes_input,attrs,fed", FORMS)
def test_reduce_mean_gradient_matches_numpy_on_every_form(opset, axes_input, attrs, fed, seed):
    rng = np.random.default_rng(seed)
    shape = tuple(int(d) for d in rng.integers(2, 6, size=3))
    x = rng.standard_normal(shape).astype(np.float32)
    y_rank = None if fed is None else 3 - (0 if attrs.get("keepdims", 1) else len(fed))
    model = _model(shape, opset, axes_input, attrs, y_rank)
    v = build_vjp(model, wrt=["x"])
    feeds = {"x": x} if fed is None else {"x": x, "axes": np.asarray(fed, np.int64)}
    fwd = run_ort(v.forward, feeds)
    dy = rng.standard_normal(fwd["y"].shape).astype(np.float32)
    dx = run_ort(v.backward, {**feeds, **fwd, "y_grad": dy})["x_grad"]
    axes = fed if fed is not None else attrs.get("axes", axes_input if isinstance(axes_input, list) else None)
    want = _expected(x, dy, axes, attrs.get("keepdims", 1), attrs.get("noop_with_empty_axes", 0))
    np.testing.assert_allclose(dx, want, rtol=1e-6, atol=0)


def _order(backward):
    """Op types on the path from y_grad to x_grad, in the order the backward computes them."""
    made = {o: n for n in backward.graph.node for o in n.output}
    path, name = [], "x_grad"
    while name in made:
        n = made[name]
        path.append(n.op_type)
        name = next((i for i in n.input if i in made and made[i].op_type not in ("Constant", "Shape")), "")
    return path[::-1]


@pytest.mark.parametrize("opset,axes_input,attrs", [(13, None, {"axes": [1], "keepdims": 0}),
                                                    (18, [-1], {"keepdims": 1}), (18, None, {})])
def test_reduce_mean_gradient_divides_before_the_expand(opset, axes_input, attrs):
    """The one full-size node of the backward is the Expand: the Div reads dy at the reduced size."""
    v = build_vjp(_model((4, 5, 6), opset, axes_input, attrs), wrt=["x"])
    ops = [op for op in _order(v.backward) if op != "Identity"]
    assert ops[-1] == "Expand" and "Div" in ops, ops


def test_reduce_mean_over_no_axis_passes_dy_through():
    """noop_with_empty_axes with no axes: the node is the identity, and so is its gradient (no Div by 1)."""
    v = build_vjp(_model((3, 4), 18, None, {"noop_with_empty_axes": 1}), wrt=["x"])
    assert not any(n.op_type in ("Div", "Expand") for n in v.backward.graph.node)
