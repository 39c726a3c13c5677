"""A Conv network exported with dynamic_axes {0: 'N', 2: 'H', 3: 'W'} trains at two image sizes with
one training model: Conv (grouped, auto_pad SAME_UPPER / SAME_LOWER), MaxPool, AveragePool and
GlobalAveragePool gradients without static spatial dims."""
from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
import torch

import onnx_autodiff as oa
from tests.torch_export import assert_close, float_initializers, lowered_gradients, session

SIZES = [(2, 3, 12, 10), (1, 3, 17, 9)]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.c2 = torch.nn.Conv2d(4, 6, 3, stride=2, padding=1)
        self.c3 = torch.nn.Conv2d(6, 5, 1)
        self.fc = torch.nn.Linear(5, 3)

    def forward(self, x):
        h = torch.nn.functional.max_pool2d(torch.relu(self.c1(x)), 3, stride=2, padding=1)
        h = torch.relu(self.c3(torch.relu(self.c2(h))))
        return self.fc(h.mean(dim=(2, 3)))


class Loss(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, v):
        return (self.net(x) * v).sum()


def _export(module, args, names, outputs, axes):
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, buf, dynamo=False, opset_version=17, input_names=names,
                          output_names=outputs, dynamic_axes=axes, do_constant_folding=False)
    return onnx.load_from_string(buf.getvalue())


def test_conv_net_with_dynamic_height_and_width_matches_torch_at_two_sizes():
    torch.manual_seed(0)
    net = Loss(Net())
    model = _export(net, (torch.randn(*SIZES[0]), torch.randn(SIZES[0][0], 3)), ["x", "v"], ["loss"],
                    {"x": {0: "N", 2: "H", 3: "W"}, "v": {0: "N"}})
    assert [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim] == ["N", "", "H", "W"]
    params = sorted(float_initializers(model))
    for size in SIZES:
        rng = np.random.default_rng(size[2])
        x, v = rng.standard_normal(size).astype(np.float32), rng.standard_normal((size[0], 3)).astype(np.float32)
        ours = lowered_gradients(model, "loss", params, {"x": x, "v": v})
        net.zero_grad()
        net(torch.from_numpy(x), torch.from_numpy(v)).backward()
        ref = {n: p.grad.numpy() for n, p in net.named_parameters()}
        assert_close(ours, {n: ref[n] for n in params}, rtol=1e-5)


def test_one_training_model_steps_at_two_image_sizes():
    torch.manual_seed(0)
    model = _export(Net(), (torch.randn(*SIZES[0]),), ["x"], ["y"], {"x": {0: "N", 2: "H", 3: "W"}, "y": {0: "N"}})
    sess = oa.TrainingSession(oa.make_training_model(model, loss="mse", optimizer="sgd", lr=0.1))
    for size in SIZES:
        rng = np.random.default_rng(size[3])
        feeds = {"x": rng.standard_normal(size).astype(np.float32),
                 "labels": rng.standard_normal((size[0], 3)).astype(np.float32)}
        before = sess.get_state("c1.weight")
        out = sess.step(feeds)
        assert all(np.isfinite(np.asarray(v)).all() for v in out.values()), out
        assert not np.allclose(before, sess.get_state("c1.weight"))


def _windows_model():
    """x [N, 4, H, W] -> grouped Conv (auto_pad SAME_UPPER, stride 2) -> Relu -> AveragePool (pads,
    ceil_mode, count_include_pad=0) -> Conv (SAME_LOWER, even kernel) -> AveragePool (SAME_UPPER,
    count_include_pad=1) -> y; loss = sum(y * v). H and W symbolic."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((6, 2, 3, 3)) * 0.4).astype(np.float32)
    b1 = (rng.standard_normal(6) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((5, 6, 2, 2)) * 0.4).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], group=2, auto_pad="SAME_UPPER", strides=[2, 2]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("AveragePool", ["r1"], ["p1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 0, 1, 1],
                         ceil_mode=1),
        helper.make_node("Conv", ["p1", "w2"], ["c2"], auto_pad="SAME_LOWER"),
        helper.make_node("AveragePool", ["c2"], ["y"], kernel_shape=[2, 3], auto_pad="SAME_UPPER",
                         count_include_pad=1),
        helper.make_node("Mul", ["y", "v"], ["yv"]),
        helper.make_node("ReduceSum", ["yv"], ["loss"], keepdims=0),
    ]
    dims = ["N", 4, "H", "W"]
    g = helper.make_graph(nodes, "windows", [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims),
                                             helper.make_tensor_value_info("v", TensorProto.FLOAT, ["N", 5, "P", "Q"])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("size", [(2, 4, 11, 8), (1, 4, 6, 13)])
def test_grouped_same_padded_conv_and_average_pools_with_dynamic_dims_match_torch(size):
    """Grouped Conv, auto_pad SAME_UPPER / SAME_LOWER and AveragePool (ceil_mode, both count_include_pad)
    with symbolic H and W: one model, two sizes, gradients of x and the weights against float64 autograd."""
    from tests.onnx_torch import run as torch_run
    model = _windows_model()
    rng = np.random.default_rng(size[2])
    x = rng.standard_normal(size)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    leaves = {"x": torch.tensor(x, requires_grad=True),
              **{n: torch.tensor(a, dtype=torch.float64, requires_grad=True) for n, a in inits.items()}}
    y = torch_run(onnx.ModelProto(graph=_truncated(model)), leaves)["y"]
    v = rng.standard_normal(tuple(y.shape))
    (y * torch.from_numpy(v)).sum().backward()
    ref = {n: t.grad.numpy() for n, t in leaves.items()}
    ours = lowered_gradients(model, "loss", list(leaves), {"x": x.astype(np.float32), "v": v.astype(np.float32)})
    assert_close(ours, ref, rtol=1e-5)


def _truncated(model):
    g = onnx.GraphProto()
    g.CopyFrom(model.graph)
    del g.node[-2:]
    return g


def test_one_training_model_with_grouped_same_conv_and_average_pool_steps_at_two_sizes():
    model = _windows_model()
    g = model.graph
    del g.node[-2:]
    del g.input[1:]
    del g.output[:]
    g.output.append(onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 5, "P", "Q"]))
    loss = oa.LossSpec("mse", label_shape=["N", 5, "P", "Q"])
    sess = oa.TrainingSession(oa.make_training_model(model, loss, optimizer="sgd", lr=0.1))
    for size in [(2, 4, 11, 8), (1, 4, 6, 13)]:
        rng = np.random.default_rng(size[3])
        x = rng.standard_normal(size).astype(np.float32)
        y_shape = session(model).run(["y"], {"x": x})[0].shape
        feeds = {"x": x, "labels": rng.standard_normal(y_shape).astype(np.float32)}
        before = [sess.get_state(n) for n in ("w1", "w2")]
        out = sess.step(feeds)
        assert all(np.isfinite(np.asarray(v)).all() for v in out.values()), out
        assert all(not np.allclose(b, sess.get_state(n)) for b, n in zip(before, ("w1", "w2")))
