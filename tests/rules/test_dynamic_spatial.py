"""A Conv network exported with dynamic_axes {0: 'N', 2: 'H', 3: 'W'} trains at two image sizes with
one training model: Conv, MaxPool and GlobalAveragePool gradients without static spatial dims."""
from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import torch

import onnx_autodiff as oa

from tests.torch_export import assert_close, float_initializers, lowered_gradients

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
