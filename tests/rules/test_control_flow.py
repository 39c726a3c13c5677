"""Scan and Loop gradients by float64 finite differences through onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnx_autodiff.check.gradcheck import gradcheck

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


def outer_w_scan_model(with_state_w=False):
    """An RNN Scan whose body reads W from the outer scope: h = tanh(h W + x_t), y_t = h^2. With
    ``with_state_w`` the body also carries W as a state (read under its outer name, the Scan's input W)."""
    body = rnn_body()
    if not with_state_w:
        body.node[0].input[1] = "W"
        del body.node[3]
        del body.input[1]
        del body.output[1]
        scan = helper.make_node("Scan", ["h0", "xs"], ["h_T", "ys"], body=body, num_scan_inputs=1)
        outs = [vi("h_T", [B, H]), vi("ys", [T, B, H])]
    else:
        body.node[0].input[1] = "W0"  # the outer W0, which is also the state entering as "W"
        body.node[1].input[1] = "xw"
        body.node.insert(1, helper.make_node("MatMul", ["x_t", "W"], ["xw"]))
        scan = helper.make_node("Scan", ["h0", "W0", "xs"], ["h_T", "W_T", "ys"], body=body, num_scan_inputs=1)
        outs = [vi("h_T", [B, H]), vi("W_T", [H, H]), vi("ys", [T, B, H])]
    w = "W0" if with_state_w else "W"
    return model_of([scan], [vi("h0", [B, H]), vi(w, [H, H]), vi("xs", [T, B, H])], outs)


def test_scan_outer_weight_gradcheck():
    model = outer_w_scan_model()
    report = gradcheck(model, feeds_for(model), wrt=["h0", "xs"])
    assert report.ok and len(report.checks) == 2, str(report)


def test_scan_outer_read_of_an_input_adds_to_its_gradient():
    model = outer_w_scan_model(with_state_w=True)
    report = gradcheck(model, feeds_for(model), wrt=["h0", "W0", "xs"])
    assert report.ok and len(report.checks) == 3, str(report)


def gradient_values(model, wrt, of, feeds, seed=1):
    """d sum_k <of_k, v_k> / d wrt by the lowered model on onnxruntime, and the random cotangents v."""
    import onnxruntime as ort

    from onnx_autodiff import lower

    rng = np.random.default_rng(seed)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    vs = {}
    terms = []
    for k, o in enumerate(of):
        shape = [d.dim_value for d in next(x for x in g.output if x.name == o).type.tensor_type.shape.dim]
        vs[f"v{k}"] = rng.standard_normal(shape)
        g.input.append(vi(f"v{k}", shape))
        g.node.extend([helper.make_node("Mul", [o, f"v{k}"], [f"p{k}"]),
                       helper.make_node("ReduceSum", [f"p{k}"], [f"s{k}"], keepdims=0)])
        terms.append(f"s{k}")
    g.node.append(helper.make_node("Sum", terms, ["s"]))
    grads = [f"{w}_grad" for w in wrt]
    g.node.append(helper.make_node("Gradient", list(wrt), grads, domain="ai.onnx.preview.training", xs=list(wrt),
                                   y="s"))
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in g.input}
    g.output.extend(vi(n, shapes[w]) for n, w in zip(grads, wrt))
    m.opset_import.append(helper.make_opsetid("ai.onnx.preview.training", 1))
    sess = ort.InferenceSession(lower(m).SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(wrt, sess.run(grads, {**feeds, **vs}))), [vs[f"v{k}"] for k in range(len(of))]


def test_scan_outer_weight_matches_torch():
    torch = pytest.importorskip("torch")
    model = outer_w_scan_model()
    feeds = feeds_for(model, seed=3)
    got, (v_h, v_y) = gradient_values(model, ["h0", "W", "xs"], ["h_T", "ys"], feeds)
    t = {k: torch.tensor(v, requires_grad=True) for k, v in feeds.items()}
    h, ys = t["h0"], []
    for x_t in t["xs"]:
        h = torch.tanh(h @ t["W"] + x_t)
        ys.append(h * h)
    s = (h * torch.tensor(v_h)).sum() + (torch.stack(ys) * torch.tensor(v_y)).sum()
    s.backward()
    for k in ("h0", "W", "xs"):
        np.testing.assert_allclose(got[k], t[k].grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=k)


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


def loop_outer_model(with_cond=False):
    """A Loop carrying only h: the body reads W and xs[iter_num] from the outer scope, y = h^2; with
    ``with_cond`` the body stops after iteration 1."""
    nodes = [helper.make_node("Gather", ["xs", "i"], ["x_t"], axis=0),
             helper.make_node("MatMul", ["h", "W"], ["hw"]),
             helper.make_node("Add", ["hw", "x_t"], ["a"]),
             helper.make_node("Tanh", ["a"], ["h_new"]),
             helper.make_node("Mul", ["h_new", "h_new"], ["y_t"]),
             helper.make_node("Less", ["i", "stop"], ["c_out"]) if with_cond else
             helper.make_node("Identity", ["c"], ["c_out"])]
    lb = helper.make_graph(nodes, "lb",
                           [vi("i", [], TensorProto.INT64), vi("c", [], TensorProto.BOOL), vi("h", [B, H])],
                           [vi("c_out", [], TensorProto.BOOL), vi("h_new", [B, H]), vi("y_t", [B, H])])
    inits = [helper.make_tensor("M", TensorProto.INT64, [], [T]),
             helper.make_tensor("c0", TensorProto.BOOL, [], [True]),
             helper.make_tensor("stop", TensorProto.INT64, [], [1])]
    loop = helper.make_node("Loop", ["M", "c0", "h0"], ["h_T", "ys"], body=lb)
    return model_of([loop], [vi("h0", [B, H]), vi("W", [H, H]), vi("xs", [T, B, H])],
                    [vi("h_T", [B, H]), vi("ys", [None, B, H])], 17, inits)


@pytest.mark.parametrize("with_cond", [False, True], ids=["full", "early-stop"])
def test_loop_outer_weight_and_inputs_gradcheck(with_cond):
    model = loop_outer_model(with_cond)
    report = gradcheck(model, feeds_for(model), wrt=["h0", "xs"])
    assert report.ok and len(report.checks) == 2, str(report)


def test_loop_outer_weight_matches_torch():
    torch = pytest.importorskip("torch")
    model = loop_outer_model()
    feeds = feeds_for(model, seed=4)
    got, (v_h,) = gradient_values(model, ["h0", "W", "xs"], ["h_T"], feeds)
    t = {k: torch.tensor(v, requires_grad=True) for k, v in feeds.items()}
    h = t["h0"]
    for x_t in t["xs"]:
        h = torch.tanh(h @ t["W"] + x_t)
    (h * torch.tensor(v_h)).sum().backward()
    for k in ("h0", "W", "xs"):
        np.testing.assert_allclose(got[k], t[k].grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=k)


# ---- If ---------------------------------------------------------------------------------------------
def if_branches():
    """then: (tanh(a) b, a + b); else: (a^2 + c, c): the branches read different outer tensors."""
    then_g = helper.make_graph([helper.make_node("Tanh", ["a"], ["t"]), helper.make_node("Mul", ["t", "b"], ["y_then"]),
                                helper.make_node("Add", ["a", "b"], ["z_then"])],
                               "then", [], [vi("y_then", [B, H]), vi("z_then", [B, H])])
    else_g = helper.make_graph([helper.make_node("Mul", ["a", "a"], ["aa"]),
                                helper.make_node("Add", ["aa", "c"], ["y_else"]),
                                helper.make_node("Identity", ["c"], ["z_else"])],
                               "else", [], [vi("y_else", [B, H]), vi("z_else", [B, H])])
    return then_g, else_g


def if_model(cond: bool | None, opset=17):
    """An If on ``cond``: a constant initializer, or a graph input when None."""
    then_g, else_g = if_branches()
    node = helper.make_node("If", ["cond"], ["y", "z"], then_branch=then_g, else_branch=else_g, name="if")
    inputs = [vi("a", [B, H]), vi("b", [B, H]), vi("c", [B, H])]
    inits = []
    if cond is None:
        inputs.append(vi("cond", [], TensorProto.BOOL))
    else:
        inits.append(helper.make_tensor("cond", TensorProto.BOOL, [], [cond]))
    return model_of([node], inputs, [vi("y", [B, H]), vi("z", [B, H])], opset, inits)


def if_feeds(model, **conds):
    return {**feeds_for(model), **{k: np.array(v) for k, v in conds.items()}}


@pytest.mark.parametrize("taken", [True, False], ids=["then", "else"])
@pytest.mark.parametrize("kind", ["constant", "dynamic"])
@pytest.mark.parametrize("of", [None, "y", "z"])
def test_if_gradcheck(kind, taken, of):
    model = if_model(taken if kind == "constant" else None)
    feeds = if_feeds(model) if kind == "constant" else if_feeds(model, cond=taken)
    report = gradcheck(model, feeds, wrt=["a", "b", "c"], of=of)
    assert report.ok and len(report.checks) == 3, str(report)
    unread = "c" if taken else "b"
    assert next(c for c in report.checks if c.name == unread).analytic == 0.0


@pytest.mark.parametrize("taken", [True, False], ids=["then", "else"])
@pytest.mark.parametrize("cond", [True, None], ids=["constant", "dynamic"])
@pytest.mark.parametrize("opset", [8, 11])
def test_if_old_opset_gradcheck(opset, cond, taken):
    """If-1 (before ConstantOfShape: zeros are Constants) and If-11."""
    model = if_model(taken if cond else None, opset=opset)
    report = gradcheck(model, if_feeds(model) if cond else if_feeds(model, cond=taken), wrt=["a", "b", "c"])
    assert report.ok and len(report.checks) == 3, str(report)


@pytest.mark.parametrize("kind,ifs", [("constant", 1), ("dynamic", 2)])
def test_if_constant_condition_inlines_the_taken_branch(kind, ifs):
    """A constant condition adds no If (the taken branch's backward is inlined); a dynamic one adds one,
    and the result passes the full checker."""
    from onnx_autodiff import lower

    model = if_model(True if kind == "constant" else None)
    grads = ["a_grad", "b_grad", "c_grad"]
    model.graph.node.append(helper.make_node("Gradient", ["a", "b", "c"], grads, domain="ai.onnx.preview.training",
                                             xs=["a", "b", "c"], y="y"))
    model.graph.output.extend(vi(n, [B, H]) for n in grads)
    model.opset_import.append(helper.make_opsetid("ai.onnx.preview.training", 1))
    lowered = lower(model)
    onnx.checker.check_model(lowered, full_check=True)
    assert [n.op_type for n in lowered.graph.node].count("If") == ifs


def nested_if_model(outer_cond: bool | None):
    """then: t = tanh(a); u = If(cond2, t b, t + c^2); y = u a. else: y = b c. cond2 is a graph input;
    cond a constant or (None) a graph input."""
    inner_then = helper.make_graph([helper.make_node("Mul", ["t", "b"], ["u_then"])], "inner_then", [],
                                   [vi("u_then", [B, H])])
    inner_else = helper.make_graph([helper.make_node("Mul", ["c", "c"], ["cc"]),
                                    helper.make_node("Add", ["t", "cc"], ["u_else"])],
                                   "inner_else", [], [vi("u_else", [B, H])])
    then_g = helper.make_graph([helper.make_node("Tanh", ["a"], ["t"]),
                                helper.make_node("If", ["cond2"], ["u"], then_branch=inner_then,
                                                 else_branch=inner_else),
                                helper.make_node("Mul", ["u", "a"], ["y_then"])],
                               "then", [], [vi("y_then", [B, H])])
    else_g = helper.make_graph([helper.make_node("Mul", ["b", "c"], ["y_else"])], "else", [], [vi("y_else", [B, H])])
    node = helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g, name="if")
    inputs = [vi("a", [B, H]), vi("b", [B, H]), vi("c", [B, H]), vi("cond2", [], TensorProto.BOOL)]
    inits = []
    if outer_cond is None:
        inputs.append(vi("cond", [], TensorProto.BOOL))
    else:
        inits.append(helper.make_tensor("cond", TensorProto.BOOL, [], [outer_cond]))
    return model_of([node], inputs, [vi("y", [B, H])], 17, inits)


@pytest.mark.parametrize("cond,cond2", [(True, True), (True, False), (False, True), (None, True), (None, False)],
                         ids=["const-then-then", "const-then-else", "const-else", "dyn-then-then", "dyn-then-else"])
def test_nested_if_gradcheck(cond, cond2):
    model = nested_if_model(cond)
    conds = {"cond2": cond2} if cond is not None else {"cond": True, "cond2": cond2}
    report = gradcheck(model, if_feeds(model, **conds), wrt=["a", "b", "c"])
    assert report.ok and len(report.checks) == 3, str(report)


def test_nested_if_dynamic_else_gradcheck():
    model = nested_if_model(None)
    report = gradcheck(model, if_feeds(model, cond=False, cond2=True), wrt=["a", "b", "c"])
    assert report.ok and len(report.checks) == 3, str(report)


@pytest.mark.parametrize("taken", [True, False], ids=["then", "else"])
@pytest.mark.parametrize("kind", ["constant", "dynamic"])
def test_if_second_order_gradcheck(kind, taken):
    """The gradient of an If (an If again when the condition is dynamic) differentiated once more."""
    model = if_model(taken if kind == "constant" else None)
    model.graph.node.append(helper.make_node("Mul", ["y", "y"], ["y2"]))
    grads = ["a_grad", "b_grad", "c_grad"]
    model.graph.node.append(helper.make_node("Gradient", ["a", "b", "c"], grads, domain="ai.onnx.preview.training",
                                             xs=["a", "b", "c"], y="y2", name="inner"))
    del model.graph.output[:]
    model.graph.output.extend(vi(n, [B, H]) for n in grads)
    model.opset_import.append(helper.make_opsetid("ai.onnx.preview.training", 1))
    feeds = if_feeds(model) if kind == "constant" else if_feeds(model, cond=taken)
    report = gradcheck(model, feeds, wrt=["a", "b", "c"])
    live = {"a", "b"} if taken else {"a", "c"}
    assert report.ok and all(c.analytic != 0.0 for c in report.checks if c.name in live), str(report)


def test_scan_body_with_if_gradcheck():
    """A Scan whose body branches on a graph input: h = tanh(h W + x_t) or h * x_t, W read from outside."""
    then_g = helper.make_graph([helper.make_node("MatMul", ["h", "W"], ["hw"]),
                                helper.make_node("Add", ["hw", "x_t"], ["a"]),
                                helper.make_node("Tanh", ["a"], ["h_then"])], "then", [], [vi("h_then", [B, H])])
    else_g = helper.make_graph([helper.make_node("Mul", ["h", "x_t"], ["h_else"])], "else", [], [vi("h_else", [B, H])])
    body = helper.make_graph([helper.make_node("If", ["flag"], ["h_new"], then_branch=then_g, else_branch=else_g),
                              helper.make_node("Identity", ["h_new"], ["y_t"])],
                             "cell", [vi("h", [B, H]), vi("x_t", [B, H])], [vi("h_new", [B, H]), vi("y_t", [B, H])])
    scan = helper.make_node("Scan", ["h0", "xs"], ["h_T", "ys"], body=body, num_scan_inputs=1)
    model = model_of([scan], [vi("h0", [B, H]), vi("W", [H, H]), vi("xs", [T, B, H]), vi("flag", [], TensorProto.BOOL)],
                     [vi("h_T", [B, H]), vi("ys", [T, B, H])])
    for flag in (True, False):
        report = gradcheck(model, if_feeds(model, flag=flag), wrt=["h0", "W", "xs"])
        assert report.ok and len(report.checks) == 3, str(report)


def loop_with_if_on_iteration():
    """h = tanh(h W + x_i) for i < 2, else h * x_i: an If inside a Loop body, W and xs read from outside."""
    then_g = helper.make_graph([helper.make_node("Gather", ["xs", "i"], ["x_a"], axis=0),
                                helper.make_node("MatMul", ["h", "W"], ["hw"]),
                                helper.make_node("Add", ["hw", "x_a"], ["a"]),
                                helper.make_node("Tanh", ["a"], ["h_then"])], "then", [], [vi("h_then", [B, H])])
    else_g = helper.make_graph([helper.make_node("Gather", ["xs", "i"], ["x_b"], axis=0),
                                helper.make_node("Mul", ["h", "x_b"], ["h_else"])], "else", [], [vi("h_else", [B, H])])
    nodes = [helper.make_node("Less", ["i", "two"], ["early"]),
             helper.make_node("If", ["early"], ["h_new"], then_branch=then_g, else_branch=else_g),
             helper.make_node("Identity", ["c"], ["c_out"])]
    body = helper.make_graph(nodes, "lb", [vi("i", [], TensorProto.INT64), vi("c", [], TensorProto.BOOL),
                                           vi("h", [B, H])], [vi("c_out", [], TensorProto.BOOL), vi("h_new", [B, H])])
    inits = [helper.make_tensor("M", TensorProto.INT64, [], [T]),
             helper.make_tensor("c0", TensorProto.BOOL, [], [True]),
             helper.make_tensor("two", TensorProto.INT64, [], [2])]
    loop = helper.make_node("Loop", ["M", "c0", "h0"], ["h_T"], body=body)
    return model_of([loop], [vi("h0", [B, H]), vi("W", [H, H]), vi("xs", [T, B, H])], [vi("h_T", [B, H])], 17, inits)


def test_loop_body_with_if_on_iteration_gradcheck():
    """A Loop whose body branches on its iteration number (i < 2: tanh(h W + x_i), else h x_i), reading W
    and xs from the outer scope inside the branches."""
    model = loop_with_if_on_iteration()
    report = gradcheck(model, feeds_for(model), wrt=["h0", "xs"])
    assert report.ok and len(report.checks) == 2, str(report)


def test_scan_body_reading_a_large_outer_weight_gradcheck():
    """A constant weight of 32x32 doubles (8 KiB) read by the body from the outer scope: the lowering sees it
    detached (its type, not its bytes) and still differentiates the body."""
    n = 32
    nodes = [helper.make_node("MatMul", ["h", "W"], ["hw"]), helper.make_node("Add", ["hw", "x_t"], ["a"]),
             helper.make_node("Tanh", ["a"], ["h_new"]), helper.make_node("Identity", ["h_new"], ["y_t"])]
    body = helper.make_graph(nodes, "cell", [vi("h", [B, n]), vi("x_t", [B, n])],
                             [vi("h_new", [B, n]), vi("y_t", [B, n])])
    scan = helper.make_node("Scan", ["h0", "xs"], ["h_T", "ys"], body=body, num_scan_inputs=1)
    w = helper.make_tensor("W", D, [n, n], (np.random.default_rng(0).standard_normal(n * n) * 0.1).tolist())
    model = model_of([scan], [vi("h0", [B, n]), vi("xs", [T, B, n])], [vi("h_T", [B, n]), vi("ys", [T, B, n])],
                     initializers=[w])
    report = gradcheck(model, feeds_for(model), wrt=["h0", "xs"])
    assert report.ok and len(report.checks) == 2, str(report)


def _local_constant(name: str, shape) -> onnx.TensorProto:
    """A body's own initializer (not read from the outer scope)."""
    from onnx import numpy_helper

    return numpy_helper.from_array(np.linspace(0.5, 1.5, int(np.prod(shape))).reshape(shape), name)


@pytest.mark.parametrize("kind", ["Scan", "Loop", "If-dynamic", "If-constant"])
def test_body_with_its_own_initializer_gradcheck(kind):
    """A body whose node on the gradient path reads an initializer of the body itself: the backward body
    (recomputing the forward one) has it too (it read a name nothing made)."""
    c = _local_constant("c_local", [B, H])
    if kind in ("Scan", "Loop"):
        nodes = [helper.make_node("Mul", ["h", "c_local"], ["hc"]), helper.make_node("Add", ["hc", "x_t"], ["a"]),
                 helper.make_node("Tanh", ["a"], ["h_new"]), helper.make_node("Mul", ["h_new", "c_local"], ["y_t"])]
        if kind == "Scan":
            body = helper.make_graph(nodes, "cell", [vi("h", [B, H]), vi("x_t", [B, H])],
                                     [vi("h_new", [B, H]), vi("y_t", [B, H])], [c])
            node = helper.make_node("Scan", ["h0", "xs"], ["h_T", "ys"], body=body, num_scan_inputs=1)
            inputs = [vi("h0", [B, H]), vi("xs", [T, B, H])]
        else:
            nodes.insert(0, helper.make_node("Gather", ["xs", "i"], ["x_t"], axis=0))
            nodes.append(helper.make_node("Identity", ["cond"], ["cond_out"]))
            body = helper.make_graph(nodes, "cell", [vi("i", [], TensorProto.INT64), vi("cond", [], TensorProto.BOOL),
                                                     vi("h", [B, H])],
                                     [vi("cond_out", [], TensorProto.BOOL), vi("h_new", [B, H]), vi("y_t", [B, H])],
                                     [c])
            trip = helper.make_tensor("trip", TensorProto.INT64, [], [T])
            node = helper.make_node("Loop", ["trip", "", "h0"], ["h_T", "ys"], body=body)
            inputs = [vi("h0", [B, H]), vi("xs", [T, B, H])]
        model = model_of([node], inputs, [vi("h_T", [B, H]), vi("ys", [T, B, H])],
                         initializers=[trip] if kind == "Loop" else [])
        wrt = ["h0", "xs"]
    else:
        then = helper.make_graph([helper.make_node("Mul", ["x", "c_local"], ["xc"]),
                                  helper.make_node("Sin", ["xc"], ["y_then"])], "then", [], [vi("y_then", [B, H])],
                                 [c])
        other = helper.make_graph([helper.make_node("Cos", ["x"], ["y_else"])], "else", [], [vi("y_else", [B, H])])
        node = helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)
        constant = kind == "If-constant"
        cond = [helper.make_tensor("cond", TensorProto.BOOL, [], [True])] if constant else []
        inputs = [vi("x", [B, H])] + ([] if constant else [vi("cond", [], TensorProto.BOOL)])
        model = model_of([node], inputs, [vi("y", [B, H])], initializers=cond)
        wrt = ["x"]
    feeds = feeds_for(model)
    if kind == "If-dynamic":
        feeds["cond"] = np.array(True)
    report = gradcheck(model, feeds, wrt=wrt)
    assert report.ok and len(report.checks) == len(wrt), str(report)


@pytest.mark.parametrize("kind", ["Scan", "Loop"])
def test_one_tensor_as_two_inputs_and_an_outer_read_gradcheck(kind):
    """w is the initial state, the scanned sequence (Scan) or a second state (Loop), and read from the outer
    scope in the body: its outer-read gradient is added once, not once per input position it fills."""
    nodes = [helper.make_node("Mul", ["w", "x_t"], ["t"]), helper.make_node("Add", ["t", "h"], ["a"]),
             helper.make_node("Tanh", ["a"], ["h_new"]), helper.make_node("Sin", ["h_new"], ["y_t"])]
    if kind == "Scan":
        body = helper.make_graph(nodes, "cell", [vi("h", [1, H]), vi("x_t", [H])],
                                 [vi("h_new", [1, H]), vi("y_t", [1, H])])
        node = helper.make_node("Scan", ["w", "w"], ["h_T", "ys"], body=body, num_scan_inputs=1)
        inits = []
    else:
        nodes += [helper.make_node("Identity", ["cond"], ["cond_out"]), helper.make_node("Cos", ["x_t"], ["x_next"])]
        body = helper.make_graph(nodes, "cell", [vi("i", [], TensorProto.INT64), vi("cond", [], TensorProto.BOOL),
                                                 vi("h", [1, H]), vi("x_t", [1, H])],
                                 [vi("cond_out", [], TensorProto.BOOL), vi("h_new", [1, H]), vi("x_next", [1, H]),
                                  vi("y_t", [1, H])])
        node = helper.make_node("Loop", ["trip", "", "w", "w"], ["h_T", "x_T", "ys"], body=body)
        inits = [helper.make_tensor("trip", TensorProto.INT64, [], [2])]
    outs = [vi("h_T", [1, H]), vi("ys", [1 if kind == "Scan" else 2, 1, H])]
    if kind == "Loop":
        outs.insert(1, vi("x_T", [1, H]))
    model = model_of([node], [vi("w", [1, H])], outs, initializers=inits)
    report = gradcheck(model, feeds_for(model), wrt=["w"])
    assert report.ok and len(report.checks) == 1, str(report)


def test_scan_body_reading_a_loop_output_gradcheck():
    """A Scan body reads a Loop's output from the outer scope. onnx's shape inference gives a Loop's carried
    outputs no shape; the Scan backward's accumulator for that tensor had none either, which onnxruntime
    refuses ("Subgraph must have the shape set for all outputs"). The body's declared output shape holds."""
    loop_body = helper.make_graph(
        [helper.make_node("Tanh", ["v"], ["v_next"]), helper.make_node("Identity", ["cond"], ["cond_out"])], "lb",
        [vi("i", [], TensorProto.INT64), vi("cond", [], TensorProto.BOOL), vi("v", [1, H])],
        [vi("cond_out", [], TensorProto.BOOL), vi("v_next", [1, H])])
    loop = helper.make_node("Loop", ["trip", "keep", "w"], ["w_T"], body=loop_body)
    scan_body = helper.make_graph(
        [helper.make_node("Mul", ["x_t", "w_T"], ["m"]), helper.make_node("Add", ["m", "h"], ["a"]),
         helper.make_node("Tanh", ["a"], ["h_new"]), helper.make_node("Identity", ["h_new"], ["y_t"])], "sb",
        [vi("h", [B, H]), vi("x_t", [B, H])], [vi("h_new", [B, H]), vi("y_t", [B, H])])
    scan = helper.make_node("Scan", ["h0", "xs"], ["h_T", "ys"], body=scan_body, num_scan_inputs=1)
    model = model_of([loop, scan], [vi("w", [1, H]), vi("h0", [B, H]), vi("xs", [T, B, H])],
                     [vi("h_T", [B, H]), vi("ys", [T, B, H])],
                     initializers=[helper.make_tensor("trip", TensorProto.INT64, [], [2]),
                                   helper.make_tensor("keep", TensorProto.BOOL, [], [True])])
    report = gradcheck(model, feeds_for(model), wrt=["w", "h0", "xs"])
    assert report.ok and len(report.checks) == 3, str(report)
