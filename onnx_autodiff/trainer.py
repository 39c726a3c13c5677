"""Train an ONNX model with a loop in Python: forward, loss, backward, penalty, update.

onnxruntime does every tensor operation. The model's forward and backward come from
:func:`onnx_autodiff.vjp.build_vjp`; the loss, the penalty and the learning-rate rule are pluggable
pieces, each of which builds its own small ONNX graph (``build_onnx_function``) and runs it in its
own session:

- a loss maps (prediction Y, target T) to (loss, dLoss/dY);
- a penalty maps the weights and their gradients to (penalty, gradients + dPenalty/dW);
- a learning rate maps (weights, gradients, optimizer state, step) to (new weights, new state).

Everything crosses between sessions as numpy arrays on CPU (onnxruntime reads contiguous arrays in
place).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .errors import OnnxAutodiffError
from .graph import FLOAT_TYPES
from .io import save_model_atomic
from .vjp import build_vjp, grad_name, inference_model

_OPSET = 17
_IR = 8


def _session(model: onnx.ModelProto, providers=None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=providers or ["CPUExecutionProvider"])


def _model(nodes, inputs, outputs, name: str) -> onnx.ModelProto:
    m = helper.make_model(helper.make_graph(nodes, name, inputs, outputs),
                          opset_imports=[helper.make_opsetid("", _OPSET)], producer_name="onnx-autodiff")
    m.ir_version = _IR
    onnx.checker.check_model(m, full_check=True)
    return m


class _Graph:
    """Node-list helper for the small graphs below: ``op`` returns the output name."""

    def __init__(self, prefix: str, dtype: int):
        self.nodes: list[onnx.NodeProto] = []
        self.prefix = prefix
        self.dtype = dtype
        self._n = 0

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        self._n += 1
        out = out or f"{self.prefix}/{op_type}_{self._n}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def const(self, value: float) -> str:
        arr = np.array(value, dtype=helper.tensor_dtype_to_np_dtype(self.dtype))
        return self.op("Constant", value=numpy_helper.from_array(arr))


def _dims(shape) -> list:
    return [d if isinstance(d, int) else f"d{k}" for k, d in enumerate(shape)]


class _Piece:
    """A piece of the training loop that owns one ONNX graph and the session running it."""

    model: onnx.ModelProto | None = None
    _sess = None

    def build(self, *args, providers=None) -> None:
        self.model = self.build_onnx_function(*args)
        self._sess = _session(self.model, providers) if self.model is not None else None

    def build_onnx_function(self, *args) -> onnx.ModelProto | None:
        raise NotImplementedError

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self._sess.run(None, feeds)


# ---- losses -----------------------------------------------------------------------------------------
class _Loss(_Piece):
    """loss = mean over every element of f(Y - T); Y_grad = f'(Y - T) / size(Y)."""

    def build_onnx_function(self, dtype: int, shape) -> onnx.ModelProto:
        g = _Graph("loss", dtype)
        d = g.op("Sub", "Y", "T")
        n = g.op("Cast", g.op("Size", "Y"), to=dtype)
        value, slope = self._terms(g, d)
        g.op("Div", g.op("ReduceSum", value, keepdims=0), n, out="loss")
        g.op("Div", slope, n, out="Y_grad")
        dims = _dims(shape)
        return _model(g.nodes,
                      [helper.make_tensor_value_info("Y", dtype, dims), helper.make_tensor_value_info("T", dtype, dims)],
                      [helper.make_tensor_value_info("loss", dtype, []), helper.make_tensor_value_info("Y_grad", dtype, dims)],
                      type(self).__name__)

    def _terms(self, g: _Graph, d: str) -> tuple[str, str]:
        """(f(d), f'(d)) elementwise."""
        raise NotImplementedError

    def __call__(self, y: np.ndarray, t: np.ndarray) -> tuple[float, np.ndarray]:
        loss, dy = self.run({"Y": y, "T": t})
        return float(loss), dy


class SquareLoss(_Loss):
    """Mean squared error, as ``torch.nn.MSELoss()``: mean((Y - T)^2)."""

    def _terms(self, g, d):
        return g.op("Mul", d, d), g.op("Mul", d, g.const(2.0))


class AbsoluteLoss(_Loss):
    """Mean absolute error, as ``torch.nn.L1Loss()``: mean(|Y - T|) (slope 0 where Y = T)."""

    def _terms(self, g, d):
        return g.op("Abs", d), g.op("Sign", d)


class ElasticLoss(_Loss):
    """mean(l1 |Y - T| + l2 (Y - T)^2)."""

    def __init__(self, l1: float = 0.5, l2: float = 0.5):
        self.l1, self.l2 = float(l1), float(l2)

    def _terms(self, g, d):
        l1, l2 = g.const(self.l1), g.const(self.l2)
        value = g.op("Add", g.op("Mul", l1, g.op("Abs", d)), g.op("Mul", l2, g.op("Mul", d, d)))
        slope = g.op("Add", g.op("Mul", l1, g.op("Sign", d)), g.op("Mul", g.const(2 * self.l2), d))
        return value, slope

    def __repr__(self):
        return f"ElasticLoss(l1={self.l1}, l2={self.l2})"


# ---- penalties --------------------------------------------------------------------------------------
class NoPenalty(_Piece):
    """No regularization: the gradients pass through untouched (no graph, no session)."""

    def build_onnx_function(self, names, dtypes, shapes):
        return None

    def __call__(self, weights, grads):
        return 0.0, grads


class ElasticPenalty(_Piece):
    """penalty = sum over weights of l1 sum|W| + l2 sum W^2; adds l1 sign(W) + 2 l2 W to each gradient.

    It applies to every trainable tensor, biases included.

    ``ElasticPenalty(0, wd / 2)`` is torch SGD's ``weight_decay=wd``.
    """

    def __init__(self, l1: float = 0.5, l2: float = 0.5):
        self.l1, self.l2 = float(l1), float(l2)

    def build_onnx_function(self, names, dtypes, shapes):
        dtype = dtypes[0]
        g = _Graph("penalty", dtype)
        l1, l2, l2x2 = g.const(self.l1), g.const(self.l2), g.const(2 * self.l2)
        terms = []
        inputs, outputs = [], [helper.make_tensor_value_info("penalty", dtype, [])]
        for k, (dt, shape) in enumerate(zip(dtypes, shapes)):
            w, gr = f"W{k}", f"G{k}"
            inputs += [helper.make_tensor_value_info(w, dt, list(shape)), helper.make_tensor_value_info(gr, dt, list(shape))]
            outputs.append(helper.make_tensor_value_info(f"G{k}_out", dt, list(shape)))
            terms.append(g.op("Add", g.op("Mul", l1, g.op("ReduceSum", g.op("Abs", w), keepdims=0)),
                              g.op("Mul", l2, g.op("ReduceSum", g.op("Mul", w, w), keepdims=0))))
            extra = g.op("Add", g.op("Mul", l1, g.op("Sign", w)), g.op("Mul", l2x2, w))
            g.op("Add", gr, extra, out=f"G{k}_out")
        g.op("Sum", *terms, out="penalty")
        return _model(g.nodes, inputs, outputs, "ElasticPenalty")

    def __call__(self, weights: list[np.ndarray], grads: list[np.ndarray]):
        feeds = {}
        for k, (w, gr) in enumerate(zip(weights, grads)):
            feeds[f"W{k}"], feeds[f"G{k}"] = w, gr
        penalty, *new = self.run(feeds)
        return float(penalty), new

    def __repr__(self):
        return f"ElasticPenalty(l1={self.l1}, l2={self.l2})"


# ---- learning rates ---------------------------------------------------------------------------------
class _LearningRate(_Piece):
    """Updates every weight in one graph: inputs step, then per weight W, G and the state slots."""

    slots: tuple[str, ...] = ()

    def build_onnx_function(self, names, dtypes, shapes):
        dtype = dtypes[0]
        g = _Graph("update", dtype)
        inputs = [helper.make_tensor_value_info("step", dtype, [])]
        outputs = []
        for k, (dt, shape) in enumerate(zip(dtypes, shapes)):
            shape = list(shape)
            ins = [f"W{k}", f"G{k}"] + [f"{s}{k}" for s in self.slots]
            inputs += [helper.make_tensor_value_info(n, dt, shape) for n in ins]
            outs = [f"W{k}_out"] + [f"{s}{k}_out" for s in self.slots]
            outputs += [helper.make_tensor_value_info(n, dt, shape) for n in outs]
            self._update(g, "step", *ins, *outs)
        return _model(g.nodes, inputs, outputs, type(self).__name__)

    def _update(self, g: _Graph, step: str, *names: str) -> None:
        raise NotImplementedError

    def init_state(self, weights: list[np.ndarray]) -> list[list[np.ndarray]]:
        return [[np.zeros_like(w) for _ in self.slots] for w in weights]

    def __call__(self, step: int, weights, grads, state):
        dtype = weights[0].dtype
        feeds = {"step": np.array(step, dtype=dtype)}
        for k, (w, gr, st) in enumerate(zip(weights, grads, state)):
            feeds[f"W{k}"], feeds[f"G{k}"] = w, gr
            feeds.update({f"{s}{k}": v for s, v in zip(self.slots, st)})
        out = self.run(feeds)
        per = 1 + len(self.slots)
        return ([out[k * per] for k in range(len(weights))],
                [list(out[k * per + 1:(k + 1) * per]) for k in range(len(weights))])


class SGD(_LearningRate):
    """W <- W - lr G (``torch.optim.SGD(lr=lr)``)."""

    def __init__(self, lr: float = 0.01):
        self.lr = float(lr)

    def _update(self, g, step, w, gr, w_out):
        g.op("Sub", w, g.op("Mul", g.const(self.lr), gr), out=w_out)

    def __repr__(self):
        return f"SGD(lr={self.lr})"


class SGDNesterov(_LearningRate):
    """Nesterov momentum as ``torch.optim.SGD(lr, momentum, nesterov=True)``:
    v <- momentum v + G; W <- W - lr (G + momentum v)."""

    slots = ("velocity",)

    def __init__(self, lr: float = 0.01, momentum: float = 0.9):
        self.lr, self.momentum = float(lr), float(momentum)

    def _update(self, g, step, w, gr, v, w_out, v_out):
        mu = g.const(self.momentum)
        v_new = g.op("Add", g.op("Mul", mu, v), gr, out=v_out)
        g.op("Sub", w, g.op("Mul", g.const(self.lr), g.op("Add", gr, g.op("Mul", mu, v_new))), out=w_out)

    def __repr__(self):
        return f"SGDNesterov(lr={self.lr}, momentum={self.momentum})"


class Adam(_LearningRate):
    """Adam as ``torch.optim.Adam``: bias-corrected moments, W <- W - lr m_hat / (sqrt(v_hat) + eps)."""

    slots = ("m", "v")

    def __init__(self, lr: float = 0.001, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8):
        self.lr, self.beta1, self.beta2, self.eps = float(lr), float(beta1), float(beta2), float(eps)

    def _update(self, g, step, w, gr, m, v, w_out, m_out, v_out):
        b1, b2, one = g.const(self.beta1), g.const(self.beta2), g.const(1.0)
        m_new = g.op("Add", g.op("Mul", b1, m), g.op("Mul", g.const(1 - self.beta1), gr), out=m_out)
        v_new = g.op("Add", g.op("Mul", b2, v), g.op("Mul", g.const(1 - self.beta2), g.op("Mul", gr, gr)), out=v_out)
        c1 = g.op("Sub", one, g.op("Pow", b1, step))
        c2 = g.op("Sub", one, g.op("Pow", b2, step))
        denom = g.op("Add", g.op("Sqrt", g.op("Div", v_new, c2)), g.const(self.eps))
        g.op("Sub", w, g.op("Mul", g.const(self.lr), g.op("Div", g.op("Div", m_new, c1), denom)), out=w_out)

    def __repr__(self):
        return f"Adam(lr={self.lr}, beta1={self.beta1}, beta2={self.beta2}, eps={self.eps})"


# ---- the trainer ------------------------------------------------------------------------------------
class ForwardBackwardTrainer:
    """Fits the ``trainable`` initializers of ``model`` (one data input, one output) by gradient descent.

    ``trainable``: initializer names (default: every float initializer). The loss compares the model's
    output with the targets; the penalty regularizes the weights; the learning rate updates them.
    After ``fit``, ``train_losses_`` holds one loss per epoch (the mean of the batch losses weighted
    by batch size, penalty included).
    """

    def __init__(self, model, trainable: Sequence[str] | None = None, *, loss=None, penalty=None,
                 learning_rate=None, output: str | None = None, providers=None):
        model = model if isinstance(model, onnx.ModelProto) else onnx.load(model)
        inits = {t.name: t for t in model.graph.initializer}
        if trainable is None:
            trainable = [n for n, t in inits.items() if t.data_type in FLOAT_TYPES]
        self.trainable = list(trainable)
        if not self.trainable:
            raise OnnxAutodiffError("nothing to train: the model has no float initializer; pass trainable=...")
        for name in self.trainable:
            if name not in inits or inits[name].data_type not in FLOAT_TYPES:
                raise OnnxAutodiffError(f"trainable names {name!r}, which is not a float initializer of the model")
        data_inputs = [i for i in model.graph.input if i.name not in inits]
        if len(data_inputs) != 1:
            raise OnnxAutodiffError(
                f"the trainer feeds one data input; the model has {len(data_inputs)}: "
                f"{[i.name for i in data_inputs]}"
            )
        self.input_name = data_inputs[0].name
        self.input_dtype = helper.tensor_dtype_to_np_dtype(data_inputs[0].type.tensor_type.elem_type)
        outputs = [o for o in model.graph.output if o.type.tensor_type.elem_type in FLOAT_TYPES]
        if output is not None:
            outputs = [o for o in outputs if o.name == output]
        if not outputs:
            raise OnnxAutodiffError(f"no float graph output {output or ''} to train against")
        out = outputs[0]
        self.output_name = out.name
        self.vjp = build_vjp(model, wrt=self.trainable, outputs=[out.name], defaults=False)

        self.loss = loss if loss is not None else SquareLoss()
        self.penalty = penalty if penalty is not None else NoPenalty()
        self.learning_rate = learning_rate if learning_rate is not None else SGD()
        weights = [numpy_helper.to_array(inits[n]).copy() for n in self.trainable]
        dtypes = [inits[n].data_type for n in self.trainable]
        if len(set(dtypes)) != 1:
            raise OnnxAutodiffError("the trainable initializers must share one element type")
        shapes = [w.shape for w in weights]
        out_dims = [d.dim_value if d.HasField("dim_value") else None for d in out.type.tensor_type.shape.dim]
        self._out_dims = out_dims
        self.loss.build(out.type.tensor_type.elem_type, out_dims, providers=providers)
        self.penalty.build(self.trainable, dtypes, shapes, providers=providers)
        self.learning_rate.build(self.trainable, dtypes, shapes, providers=providers)

        self._forward = _session(self.vjp.forward, providers)
        self._backward = _session(self.vjp.backward, providers)
        self._predict = _session(inference_model(self.vjp), providers)
        self._forward_outputs = [o.name for o in self.vjp.forward.graph.output]
        self.weights = weights
        self.state = self.learning_rate.init_state(weights)
        self.step_count = 0
        self.train_losses_: list[float] = []

    # ---- one step ---------------------------------------------------------------------------------
    def _feeds(self, x: np.ndarray) -> dict[str, np.ndarray]:
        feeds = {self.input_name: x}
        feeds.update(zip(self.trainable, self.weights))
        return feeds

    def train_step(self, x: np.ndarray, t: np.ndarray) -> float:
        """One forward/backward/update on a batch; returns its loss (penalty included)."""
        feeds = self._feeds(x)
        fwd = dict(zip(self._forward_outputs, self._forward.run(None, feeds)))
        loss, dy = self.loss(fwd[self.output_name], t)
        bfeeds = {s: feeds[s] for s in self.vjp.saved_inputs}
        bfeeds.update({s: fwd[s] for s in self.vjp.saved_outputs})
        bfeeds[grad_name(self.output_name)] = dy
        grads = self._backward.run(None, bfeeds)
        penalty, grads = self.penalty(self.weights, grads)
        self.step_count += 1
        self.weights, self.state = self.learning_rate(self.step_count, self.weights, grads, self.state)
        return loss + penalty

    # ---- the loop ---------------------------------------------------------------------------------
    def _targets(self, y: np.ndarray) -> np.ndarray:
        y = np.asarray(y, dtype=self.weights[0].dtype)
        if y.ndim == len(self._out_dims) - 1 and self._out_dims and self._out_dims[-1] == 1:
            y = y.reshape(*y.shape, 1)
        return np.ascontiguousarray(y)

    def fit(self, X, y, *, epochs: int = 10, batch_size: int | None = None, shuffle: bool = True,
            seed: int | None = 0) -> "ForwardBackwardTrainer":
        """Train for ``epochs`` passes over (X, y) in batches of ``batch_size`` (default: all rows)."""
        X = np.ascontiguousarray(X, dtype=self.input_dtype)
        y = self._targets(y)
        if len(X) != len(y):
            raise ValueError(f"X has {len(X)} rows but y has {len(y)}")
        n = len(X)
        batch_size = n if batch_size is None else int(batch_size)
        rng = np.random.default_rng(seed)
        for _ in range(epochs):
            order = rng.permutation(n) if shuffle else np.arange(n)
            total = 0.0
            for start in range(0, n, batch_size):
                idx = order[start:start + batch_size]
                total += self.train_step(np.ascontiguousarray(X[idx]), np.ascontiguousarray(y[idx])) * len(idx)
            self.train_losses_.append(total / n)
        return self

    def predict(self, X) -> np.ndarray:
        X = np.ascontiguousarray(X, dtype=self.input_dtype)
        return self._predict.run([self.output_name], self._feeds(X))[0]

    # ---- state ------------------------------------------------------------------------------------
    def get_state(self) -> dict:
        """Copies of the weights, the optimizer's state slots and the step count."""
        return {
            "weights": {n: w.copy() for n, w in zip(self.trainable, self.weights)},
            "optimizer": {f"{s}/{n}": v.copy() for n, st in zip(self.trainable, self.state)
                          for s, v in zip(self.learning_rate.slots, st)},
            "step": self.step_count,
        }

    def set_state(self, state: dict) -> None:
        """Restore what ``get_state`` returned (the optimizer part is optional: omitted, it restarts)."""
        weights = state["weights"]
        missing = [n for n in self.trainable if n not in weights]
        if missing:
            raise ValueError(f"the state has no value for {missing}")
        new = []
        for n, w in zip(self.trainable, self.weights):
            v = np.array(weights[n], dtype=w.dtype)
            if v.shape != w.shape:
                raise ValueError(f"the state gives {n!r} shape {v.shape}, the model needs {w.shape}")
            new.append(v)
        self.weights = new
        opt = state.get("optimizer")
        if opt is None:
            self.state = self.learning_rate.init_state(self.weights)
            self.step_count = 0
        else:
            self.state = [[np.array(opt[f"{s}/{n}"], dtype=w.dtype) for s in self.learning_rate.slots]
                          for n, w in zip(self.trainable, self.weights)]
            self.step_count = int(state.get("step", 0))

    # ---- export -----------------------------------------------------------------------------------
    def to_onnx(self) -> onnx.ModelProto:
        """The model with the trained weights as its initializers."""
        return inference_model(self.vjp, dict(zip(self.trainable, self.weights)))

    def onnx_graphs(self) -> dict[str, onnx.ModelProto | None]:
        """Every graph the loop runs, by role."""
        return {"forward": self.vjp.forward, "backward": self.vjp.backward, "loss": self.loss.model,
                "penalty": self.penalty.model, "learning_rate": self.learning_rate.model}

    def save_onnx_graph(self, path) -> None:
        """Write the trained model to ``path`` atomically (a temporary file, then ``os.replace``)."""
        save_model_atomic(self.to_onnx(), path)


__all__ = ["ForwardBackwardTrainer", "SquareLoss", "AbsoluteLoss", "ElasticLoss", "NoPenalty",
           "ElasticPenalty", "SGD", "SGDNesterov", "Adam"]
