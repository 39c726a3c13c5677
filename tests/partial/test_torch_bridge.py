"""OnnxFunction: an exported ONNX block trained as one layer of a torch model."""
import copy
import io
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.partial.torch_bridge import OnnxFunction


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 6)
        self.outer = torch.nn.Linear(6, 5)

    def forward(self, x):
        return self.outer(torch.tanh(self.inner(x)))


def export(module, example) -> onnx.ModelProto:
    buf = io.BytesIO()
    torch.onnx.export(module, (example,), buf, dynamo=False, opset_version=17, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    return onnx.load_from_string(buf.getvalue())


def torch_and_bridged(seed=0):
    torch.manual_seed(seed)
    reference = torch.nn.Sequential(torch.nn.Linear(3, 4), Block(), torch.nn.Linear(5, 2))
    block = OnnxFunction(export(copy.deepcopy(reference[1]), torch.zeros(2, 4)))
    bridged = torch.nn.Sequential(copy.deepcopy(reference[0]), block, copy.deepcopy(reference[2]))
    return reference, bridged


def test_parameters_are_the_exported_initializers():
    reference, bridged = torch_and_bridged()
    block = bridged[1]
    assert sorted(block.onnx_names.values()) == ["inner.bias", "inner.weight", "outer.bias", "outer.weight"]
    ref = dict(reference[1].named_parameters())
    for attr, name in block.onnx_names.items():
        assert torch.equal(getattr(block, attr).detach(), ref[name].detach())
    assert len(list(bridged.parameters())) == 8


def test_forward_and_gradients_match_torch():
    reference, bridged = torch_and_bridged()
    x = torch.randn(7, 3)
    target = torch.randn(7, 2)
    for net in (reference, bridged):
        torch.nn.functional.mse_loss(net(x), target).backward()
    torch.testing.assert_close(bridged(x), reference(x), rtol=1e-5, atol=1e-6)
    block = bridged[1]
    ref = dict(reference[1].named_parameters())
    for attr, name in block.onnx_names.items():
        torch.testing.assert_close(getattr(block, attr).grad, ref[name].grad, rtol=1e-5, atol=1e-6)
    # the gradient w.r.t. the block's input reached the torch layer before it
    torch.testing.assert_close(bridged[0].weight.grad, reference[0].weight.grad, rtol=1e-5, atol=1e-6)


def test_sequential_trains_like_pure_torch_for_ten_sgd_steps():
    reference, bridged = torch_and_bridged(seed=3)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 3, generator=gen)
    target = torch.randn(16, 2, generator=gen)
    opts = [torch.optim.SGD(net.parameters(), lr=0.1) for net in (reference, bridged)]
    for _ in range(10):
        for net, opt in zip((reference, bridged), opts):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), target).backward()
            opt.step()
    block = bridged[1]
    ref = dict(reference[1].named_parameters())
    moved = 0.0
    for attr, name in block.onnx_names.items():
        torch.testing.assert_close(getattr(block, attr).detach(), ref[name].detach(), rtol=0, atol=1e-5)
        moved = max(moved, float((ref[name].detach() - export_initial(name)).abs().max()))
    for k in (0, 2):
        for a, b in zip(bridged[k].parameters(), reference[k].parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-5)
    assert moved > 1e-3, "training did not move the block's weights; the comparison would prove nothing"


def export_initial(name):
    reference, _ = torch_and_bridged(seed=3)
    return dict(reference[1].named_parameters())[name].detach()


def test_several_outputs_and_an_unused_one():
    nodes = [helper.make_node("Mul", ["x", "w"], ["a"]), helper.make_node("Exp", ["a"], ["b"])]
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 2]),
                           helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", 2])],
                          initializer=[numpy_helper.from_array(np.array([2.0, -1.0], np.float32), "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    f = OnnxFunction(m)
    x = torch.tensor([[0.5, 1.0], [-1.0, 2.0]], requires_grad=True)
    a, b = f(x)
    b.sum().backward()  # a's gradient is None: the bridge feeds zeros
    w = torch.tensor([2.0, -1.0], requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    torch.exp(x2 * w).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(f.w.grad, w.grad)


def test_tensors_cross_without_copies():
    _, bridged = torch_and_bridged()
    block = bridged[1]
    runner = block._runner
    x = torch.randn(3, 4)
    (y,) = runner.run(runner.forward, ["y"], {"x": x, **{n: getattr(block, a) for a, n in block.onnx_names.items()}})
    from onnx_autodiff.partial.torch_bridge import to_ortvalue

    assert to_ortvalue(x).data_ptr() == x.data_ptr()
    assert y.shape == (3, 5)


def test_to_onnx_exports_the_trained_weights():
    _, bridged = torch_and_bridged()
    block = bridged[1]
    with torch.no_grad():
        block.inner_weight.mul_(2.0)
    m = block.to_onnx()
    onnx.checker.check_model(m, full_check=True)
    assert [o.name for o in m.graph.output] == ["y"]
    import onnxruntime as ort

    x = torch.randn(2, 4)
    got = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(got), block(x).detach())


def test_bad_trainable_name():
    _, bridged = torch_and_bridged()
    with pytest.raises(ValueError, match="not a float initializer"):
        OnnxFunction(bridged[1].to_onnx(), trainable=["nope"])


def test_the_package_does_not_import_torch():
    code = ("import sys, onnx_autodiff, onnx_autodiff.partial.vjp, onnx_autodiff.partial.trainer; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
