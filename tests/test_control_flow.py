"""Scan and Loop gradients by float64 finite differences through onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnx_autodiff.errors import OnnxAutodiffError
from onnx_autodiff.gradcheck import gradcheck

D = TensorProto.DOUBLE
B, H, T = 2, 3, 4


def vi(name, shape, dt=D):
    return helper.make_tensor_value_info(name, dt, shape)


def model_of(nodes, inputs, outputs, opset=17, initializers=()):
    m = helper.make_model(helper.make_graph(nodes, "m", inputs, outputs, initializer=list(initializers)),
                          opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def rnn_body(extra_out=True):
    """(h, W, x_t) -> (tanh(h W + x_t), W, [tanh(...)^2]): an RNN cell with W carried as state."""
    nodes = [helper.make_node("MatMul", ["h", "W"], ["hw"]),
             helper.make_node("Add", ["hw", "x_t"], ["a"]),
             helper.make_node("Tanh", ["a"], ["h_new"]),
             helper.make_node("Identity", ["W"], ["W_out"])]
    outs = [vi("h_new", [B, H]), vi("W_out", [H, H])]
    if extra_out:
        nodes.append(helper.make_node("Mul", ["h_new", "h_new"], ["y_t"]))
        outs.append(vi("y_t", [B, H]))
    return helper.make_graph(nodes, "cell", [vi("h", [B, H]), vi("W", [H, H]), vi("x_t", [B, H])], outs)


def scan_model(direction=0, axis=0, out_direction=0, out_axis=0, opset=17):
    x_shape = [T, B, H] if axis == 0 else [B, T, H]
    y_shape = [T, B, H] if out_axis == 0 else [B, T, H]
    scan = helper.make_node("Scan", ["h0", "W0", "xs"], ["h_T", "W_T", "ys"], body=rnn_body(), num_scan_inputs=1,
                            scan_input_directions=[direction], scan_input_axes=[axis],
                            scan_output_directions=[out_direction], scan_output_axes=[out_axis])
    return model_of([scan], [vi("h0", [B, H]), vi("W0", [H, H]), vi("xs", x_shape)],
                    [vi("h_T", [B, H]), vi("W_T", [H, H]), vi("ys", y_shape)], opset)


def feeds_for(model, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for i in model.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        if i.type.tensor_type.elem_type == D:
            out[i.name] = rng.uniform(-0.7, 0.7, shape)
    return out


@pytest.mark.parametrize("direction,axis,out_direction,out_axis", [
    (0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 1, 0), (1, 1, 0, 1), (0, 0, 1, 1)])
def test_scan_rnn_gradcheck(direction, axis, out_direction, out_axis):
    model = scan_model(direction, axis, out_direction, out_axis)
    report = gradcheck(model, feeds_for(model), wrt=["h0", "W0", "xs"])
    assert report.ok and len(report.checks) == 3, str(report)


@pytest.mark.parametrize("of", ["h_T", "ys", "W_T"])
def test_scan_single_output_gradcheck(of):
    model = scan_model()
    report = gradcheck(model, feeds_for(model), wrt=["h0", "W0", "xs"], of=of)
    assert report.ok and len(report.checks) == 3, str(report)


def test_scan_opset11_gradcheck():
    model = scan_model(direction=1, opset=11)
    report = gradcheck(model, feeds_for(model), wrt=["h0", "W0", "xs"])
    assert report.ok, str(report)


def test_scan_body_reading_outer_tensor_is_refused():
    body = rnn_body(extra_out=False)
    body.node[0].input[1] = "W_outer"
    scan = helper.make_node("Scan", ["h0", "W0", "xs"], ["h_T", "W_T"], body=body, num_scan_inputs=1)
    model = model_of([scan], [vi("h0", [B, H]), vi("W0", [H, H]), vi("xs", [T, B, H]), vi("W_outer", [H, H])],
                     [vi("h_T", [B, H]), vi("W_T", [H, H])])
    with pytest.raises(OnnxAutodiffError, match="outer-scope"):
        gradcheck(model, feeds_for(model), wrt=["h0", "xs"])


def loop_model(trip=T, with_cond=False, opset=17):
    """Loop over a (h, W, xs) RNN cell reading xs[iter_num] (xs carried through: outer-scope reads get no
    gradient yet); scan output y = h^2; with ``with_cond`` the body stops after iteration 1."""
    body = rnn_body()
    nodes = [helper.make_node("Gather", ["xs_in", "i"], ["x_t"], axis=0),
             helper.make_node("Identity", ["xs_in"], ["xs_out"])] + list(body.node)
    nodes.append(helper.make_node("Identity", ["c"], ["c_out"]) if not with_cond else
                 helper.make_node("Less", ["i", "stop"], ["c_out"]))
    lb = helper.make_graph(nodes, "lb", [vi("i", [], TensorProto.INT64), vi("c", [], TensorProto.BOOL),
                                         vi("h", [B, H]), vi("W", [H, H]), vi("xs_in", [T, B, H])],
                           [vi("c_out", [], TensorProto.BOOL)] + list(body.output[:2]) + [vi("xs_out", [T, B, H])]
                           + list(body.output[2:]))
    inits = [helper.make_tensor("M", TensorProto.INT64, [], [trip]),
             helper.make_tensor("c0", TensorProto.BOOL, [], [True]),
             helper.make_tensor("stop", TensorProto.INT64, [], [1])]
    loop = helper.make_node("Loop", ["M", "c0", "h0", "W0", "xs"], ["h_T", "W_T", "xs_T", "ys"], body=lb)
    return model_of([loop], [vi("h0", [B, H]), vi("W0", [H, H]), vi("xs", [T, B, H])],
                    [vi("h_T", [B, H]), vi("W_T", [H, H]), vi("xs_T", [T, B, H]), vi("ys", [None, B, H])],
                    opset, inits)


@pytest.mark.parametrize("with_cond,trip", [(False, T), (False, 2), (True, T)], ids=["full", "trip2", "early-stop"])
def test_loop_rnn_gradcheck(with_cond, trip):
    model = loop_model(trip, with_cond)
    report = gradcheck(model, feeds_for(model), wrt=["h0", "W0", "xs"], of=["h_T", "W_T", "ys"])
    assert report.ok and len(report.checks) == 3, str(report)


@pytest.mark.parametrize("of", ["h_T", "ys"])
def test_loop_single_output_gradcheck(of):
    model = loop_model()
    report = gradcheck(model, feeds_for(model), wrt=["h0", "W0", "xs"], of=of)
    assert report.ok and len(report.checks) == 3, str(report)


def test_loop_opset11_gradcheck():
    model = loop_model(opset=11)
    report = gradcheck(model, feeds_for(model), wrt=["h0", "W0", "xs"], of="h_T")
    assert report.ok, str(report)
