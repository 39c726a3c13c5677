"""ForwardBackwardTrainer: least squares, an MLP against the same MLP in PyTorch, the pieces, the state."""
import copy
import io
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnx_autodiff.partial.trainer import (
    SGD,
    AbsoluteLoss,
    Adam,
    ElasticLoss,
    ElasticPenalty,
    ForwardBackwardTrainer,
    NoPenalty,
    SGDNesterov,
    SquareLoss,
)

D, F = TensorProto.DOUBLE, TensorProto.FLOAT


def linear_model(d, dtype=D):
    """y = X @ coef + intercept, zero-initialized."""
    np_dt = helper.tensor_dtype_to_np_dtype(dtype)
    nodes = [helper.make_node("MatMul", ["X", "coef"], ["xw"]), helper.make_node("Add", ["xw", "intercept"], ["Y"])]
    g = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("X", dtype, ["N", d])],
                          [helper.make_tensor_value_info("Y", dtype, ["N", 1])],
                          initializer=[numpy_helper.from_array(np.zeros((d, 1), np_dt), "coef"),
                                       numpy_helper.from_array(np.zeros(1, np_dt), "intercept")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def regression_data(n=200, d=3, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    y = X @ np.array([1.5, -2.0, 0.5]) + 0.7 + 0.3 * rng.standard_normal(n)
    A = np.hstack([X, np.ones((n, 1))])
    solution = np.linalg.lstsq(A, y, rcond=None)[0]
    return X, y, solution


@pytest.mark.parametrize("lr", [SGD(0.1), SGDNesterov(0.05, 0.9)], ids=repr)
def test_linear_regression_reaches_the_least_squares_solution(lr):
    X, y, solution = regression_data()
    tr = ForwardBackwardTrainer(linear_model(3), ["coef", "intercept"], optimizer=lr)
    tr.fit(X, y, epochs=300)
    state = tr.get_state()["weights"]
    got = np.concatenate([state["coef"].ravel(), state["intercept"]])
    np.testing.assert_allclose(got, solution, rtol=0, atol=1e-8)
    assert tr.train_losses_[-1] < tr.train_losses_[0] / 10
    np.testing.assert_allclose(tr.predict(X).ravel(), np.hstack([X, np.ones((len(X), 1))]) @ solution, atol=1e-7)


def test_minibatches_get_close_in_float32():
    X, y, solution = regression_data(n=256)
    tr = ForwardBackwardTrainer(linear_model(3, F), optimizer=SGD(0.02))
    tr.fit(X, y, epochs=30, batch_size=16, shuffle=True, seed=1)
    assert len(tr.train_losses_) == 30
    w = tr.get_state()["weights"]
    assert w["coef"].dtype == np.float32
    got = np.concatenate([w["coef"].ravel(), w["intercept"]])
    np.testing.assert_allclose(got, solution, atol=3e-2)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(4, 8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))


def export(module) -> onnx.ModelProto:
    buf = io.BytesIO()
    torch.onnx.export(module, (torch.zeros(2, 4),), buf, dynamo=False, opset_version=17, input_names=["X"],
                      output_names=["Y"], dynamic_axes={"X": {0: "N"}, "Y": {0: "N"}})
    return onnx.load_from_string(buf.getvalue())


OPTIMIZERS = [
    ("sgd", lambda: SGD(0.1), lambda p: torch.optim.SGD(p, lr=0.1), NoPenalty),
    ("nesterov", lambda: SGDNesterov(0.05, 0.9), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
     NoPenalty),
    ("adam", lambda: Adam(0.01), lambda p: torch.optim.Adam(p, lr=0.01), NoPenalty),
    ("sgd+l2", lambda: SGD(0.1), lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.02),
     lambda: ElasticPenalty(0.0, 0.01)),
]


@pytest.mark.parametrize("name, ours, theirs, penalty", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_mlp_matches_pytorch_after_full_batch_steps(name, ours, theirs, penalty):
    torch.manual_seed(0)
    net = MLP()
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 4)).astype(np.float32)
    y = (np.sin(X[:, 0]) + X[:, 1] * X[:, 2]).astype(np.float32)
    tr = ForwardBackwardTrainer(export(copy.deepcopy(net)), loss=SquareLoss(), penalty=penalty(),
                                optimizer=ours())
    steps = 25
    tr.fit(X, y, epochs=steps, shuffle=False)

    opt = theirs(net.parameters())
    xt, yt = torch.from_numpy(X), torch.from_numpy(y).reshape(-1, 1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(xt), yt)
        losses.append(loss.item())
        loss.backward()
        opt.step()
    w = tr.get_state()["weights"]
    assert sorted(w) == sorted(n for n, _ in net.named_parameters())
    for n, p in net.named_parameters():
        np.testing.assert_allclose(w[n], p.detach().numpy(), rtol=0, atol=1e-4, err_msg=n)
    if penalty is NoPenalty:
        np.testing.assert_allclose(tr.train_losses_, losses, rtol=1e-4)
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize("loss, f, df", [
    (SquareLoss(), lambda d: d * d, lambda d: 2 * d),
    (AbsoluteLoss(), np.abs, np.sign),
    (ElasticLoss(0.3, 0.7), lambda d: 0.3 * np.abs(d) + 0.7 * d * d, lambda d: 0.3 * np.sign(d) + 1.4 * d),
], ids=["square", "absolute", "elastic"])
def test_loss_graphs(loss, f, df):
    loss.build(D, [None, 2])
    onnx.checker.check_model(loss.model, full_check=True)
    rng = np.random.default_rng(0)
    Y, T = rng.standard_normal((5, 2)), rng.standard_normal((5, 2))
    value, grad = loss(Y, T)
    np.testing.assert_allclose(value, np.mean(f(Y - T)), rtol=1e-12)
    np.testing.assert_allclose(grad, df(Y - T) / Y.size, rtol=1e-12)
    # the gradient is the loss's gradient: central differences in a random direction
    u = rng.standard_normal(Y.shape)
    eps = 1e-6
    numeric = (loss(Y + eps * u, T)[0] - loss(Y - eps * u, T)[0]) / (2 * eps)
    assert abs(numeric - np.sum(grad * u)) < 1e-7


def test_elastic_penalty_graph():
    pen = ElasticPenalty(0.2, 0.5)
    pen.build(["a", "b"], [D, D], [(2, 2), (3,)])
    W = [np.array([[1.0, -2.0], [0.5, 0.0]]), np.array([3.0, -1.0, 2.0])]
    G = [np.ones((2, 2)), np.zeros(3)]
    value, new = pen(W, G)
    assert value == pytest.approx(sum(0.2 * np.abs(w).sum() + 0.5 * (w * w).sum() for w in W))
    for w, g, n in zip(W, G, new):
        np.testing.assert_allclose(n, g + 0.2 * np.sign(w) + w)


def test_state_round_trip_resumes_training_exactly():
    X, y, _ = regression_data()
    tr = ForwardBackwardTrainer(linear_model(3), optimizer=Adam(0.05))
    tr.fit(X, y, epochs=5, shuffle=False)
    saved = tr.get_state()
    assert saved["step"] == 5 and set(saved["optimizer"]) == {"m/coef", "v/coef", "m/intercept", "v/intercept"}
    tr.fit(X, y, epochs=5, shuffle=False)
    first = tr.get_state()
    tr.set_state(saved)
    tr.fit(X, y, epochs=5, shuffle=False)
    second = tr.get_state()
    for n in first["weights"]:
        np.testing.assert_array_equal(first["weights"][n], second["weights"][n])
        assert not np.array_equal(first["weights"][n], saved["weights"][n])
    # get_state returns copies: training on does not change them
    tr.fit(X, y, epochs=1)
    np.testing.assert_array_equal(second["weights"]["coef"], first["weights"]["coef"])


def test_set_state_rejects_a_wrong_shape():
    tr = ForwardBackwardTrainer(linear_model(3))
    with pytest.raises(ValueError, match="shape"):
        tr.set_state({"weights": {"coef": np.zeros((2, 1)), "intercept": np.zeros(1)}})


def test_save_onnx_graph_writes_the_trained_model_atomically(tmp_path, monkeypatch):
    X, y, _ = regression_data()
    tr = ForwardBackwardTrainer(linear_model(3), optimizer=SGD(0.1)).fit(X, y, epochs=20)
    path = tmp_path / "model.onnx"
    tr.save_onnx_graph(path)
    m = onnx.load(path)
    onnx.checker.check_model(m, full_check=True)
    assert [i.name for i in m.graph.input] == ["X"]
    got = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": X})[0]
    np.testing.assert_allclose(got, tr.predict(X))
    before = path.read_bytes()

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    tr.fit(X, y, epochs=1)
    with pytest.raises(OSError, match="disk full"):
        tr.save_onnx_graph(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.onnx"]


def test_all_graphs_are_plain_onnx():
    tr = ForwardBackwardTrainer(linear_model(3), penalty=ElasticPenalty(0.1, 0.1), optimizer=Adam())
    graphs = tr.onnx_graphs()
    assert set(graphs) == {"forward", "backward", "loss", "penalty", "optimizer"}
    for m in graphs.values():
        onnx.checker.check_model(m, full_check=True)
    assert ForwardBackwardTrainer(linear_model(3)).onnx_graphs()["penalty"] is None


def test_bad_trainable_name():
    with pytest.raises(Exception, match="not a float initializer"):
        ForwardBackwardTrainer(linear_model(3), ["nope"])


def test_losses_and_optimizers_by_name_are_the_builder_tables():
    X, y, _ = regression_data()
    by_name = ForwardBackwardTrainer(linear_model(3), loss="mse", optimizer="adam", lr=0.05)
    by_object = ForwardBackwardTrainer(linear_model(3), loss=SquareLoss(), optimizer=Adam(0.05))
    adam = Adam(0.05)
    with pytest.warns(DeprecationWarning, match="optimizer="):
        old_keyword = ForwardBackwardTrainer(linear_model(3), learning_rate=adam)
    assert old_keyword.optimizer is adam
    for tr in (by_name, by_object, old_keyword):
        tr.fit(X, y, epochs=5, shuffle=False)
    for tr in (by_object, old_keyword):
        for n, w in by_name.get_state()["weights"].items():
            np.testing.assert_array_equal(tr.get_state()["weights"][n], w)
    assert set(by_name.get_state()["optimizer"]) == {"exp_avg/coef", "exp_avg_sq/coef", "exp_avg/intercept",
                                                     "exp_avg_sq/intercept"}
    with pytest.raises(Exception, match="unknown optimizer 'adamax'"):
        ForwardBackwardTrainer(linear_model(3), optimizer="adamax")
    with pytest.raises(Exception, match="unknown loss 'hinge'"):
        ForwardBackwardTrainer(linear_model(3), loss="hinge")
    with pytest.raises(TypeError, match="optimizer name"):
        ForwardBackwardTrainer(linear_model(3), optimizer=SGD(0.1), lr=0.5)


def test_cross_entropy_by_name_matches_torch():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((40, 3))
    labels = rng.integers(0, 3, 40)
    w = rng.standard_normal((3, 3))
    nodes = [helper.make_node("MatMul", ["X", "W"], ["Y"])]
    g = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("X", D, ["N", 3])],
                          [helper.make_tensor_value_info("Y", D, ["N", 3])], [numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    tr = ForwardBackwardTrainer(m, loss="cross_entropy", optimizer="sgd", lr=0.5).fit(X, labels, epochs=2,
                                                                                        shuffle=False)
    wt = torch.tensor(w, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(torch.tensor(X) @ wt, torch.tensor(labels))
    loss.backward()
    assert tr.train_losses_[0] == pytest.approx(loss.item(), rel=1e-12)
    np.testing.assert_allclose(tr.train_losses_[1], torch.nn.functional.cross_entropy(
        torch.tensor(X) @ (wt - 0.5 * wt.grad), torch.tensor(labels)).item(), rtol=1e-12)
