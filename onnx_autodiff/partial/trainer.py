"""Train an ONNX model with a loop in Python: forward, loss, backward, penalty, update.

onnxruntime does every tensor operation. The model's forward and backward come from
:func:`onnx_autodiff.partial.vjp.build_vjp`; the loss, the penalty and the optimizer are pluggable pieces,
each of which builds its own small ONNX graph (``build_onnx_function``) and runs it in its own session:

- a loss maps (prediction Y, target T) to (loss, dLoss/dY): a loss of ``training/losses.py`` (the table
  ``make_training_model`` uses) and a ``Gradient`` node, lowered like any other;
- a penalty maps the weights and their gradients to (penalty, gradients + dPenalty/dW);
- an optimizer maps (weights, gradients, optimizer state, step) to (new weights, new state): an optimizer
  of ``training/optimizers.py``, the same emission ``make_training_model`` uses.

Everything crosses between sessions as numpy arrays on CPU (onnxruntime reads contiguous arrays in
place).
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import OnnxAutodiffError, TrainingBuilderError
from ..graph import FLOAT_TYPES
from ..model.carrier import open_model
from ..model.io import save_model_atomic
from ..ort_options import session_options
from ..passes.pipeline import lower
from ..training.losses import LOSSES, find_loss
from ..training.nodes import GraphBuilder
from ..training.optimizers import OPTIMIZERS, PREVIEW, Param, emit_optimizer, resolve_optimizer
from .vjp import build_vjp, grad_name, inference_model

_OPSET = 17
_IR = 8


def _session(model: onnx.ModelProto, providers=None):
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), session_options(),
                                providers=providers or ["CPUExecutionProvider"])


def _model(b: GraphBuilder, inputs, outputs, name: str) -> onnx.ModelProto:
    """A model of the builder's nodes; training ops (Gradient, the spec's optimizers) lowered to plain ONNX."""
    training = any(n.domain == PREVIEW for n in b.nodes)
    opsets = [helper.make_opsetid("", _OPSET)] + ([helper.make_opsetid(PREVIEW, 1)] if training else [])
    m = helper.make_model(helper.make_graph(b.nodes, name, inputs, outputs, b.inits), opset_imports=opsets,
                          producer_name="onnx-autodiff")
    m.ir_version = _IR
    if training:
        m = lower(m)
    onnx.checker.check_model(m, full_check=True)
    return m


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


# ---- losses: the table of onnx_autodiff.training.losses, differentiated by the library -------------
class Loss(_Piece):
    """A loss of ``onnx_autodiff.training.LOSSES`` by name (``Loss("mse")``, ``Loss("elastic", l1=0.1)``):
    its graph maps (prediction Y, target T) to (loss, dLoss/dY), the gradient from a lowered Gradient node."""

    def __init__(self, name: str, **options):
        entry = find_loss(name) if isinstance(name, str) else None
        if entry is None:
            raise OnnxAutodiffError(f"unknown loss {name!r}; choose one of {', '.join(LOSSES)}")
        unknown = sorted(set(options) - set(entry.options))
        if unknown:
            raise OnnxAutodiffError(f"loss {entry.name} has no option {unknown[0]!r}; it takes {sorted(entry.options)}")
        self.name = entry.name
        self.entry = entry
        self.options = {k: float(v) if isinstance(entry.options[k], float) else v
                        for k, v in {**entry.options, **options}.items()}

    @property
    def label_type(self) -> int | None:
        """The element type the targets need (int64 class indices), or None for the prediction's type."""
        return TensorProto.INT64 if self.entry.label in ("class", "tokens") else None

    def build_onnx_function(self, dtype: int, shape) -> onnx.ModelProto:
        b = GraphBuilder({"Y", "T", "loss", "Y_grad"}, "loss")
        value = self.entry.emit(b, "Y", "T", dtype, **self.options)
        b.Identity(value, outputs=["loss"])
        b.Gradient("Y", domain=PREVIEW, outputs=["Y_grad"], xs=["Y"], y="loss")
        dims = _dims(shape)
        label_dims = dims[:2] if self.entry.label == "tokens" else dims[:1] + dims[2:]
        label = (helper.make_tensor_value_info("T", TensorProto.INT64, label_dims) if self.label_type
                 else helper.make_tensor_value_info("T", dtype, dims))
        return _model(b, [helper.make_tensor_value_info("Y", dtype, dims), label],
                      [helper.make_tensor_value_info("loss", dtype, []),
                       helper.make_tensor_value_info("Y_grad", dtype, dims)],
                      type(self).__name__)

    def __call__(self, y: np.ndarray, t: np.ndarray) -> tuple[float, np.ndarray]:
        loss, dy = self.run({"Y": y, "T": t})
        return float(loss), dy

    def __repr__(self):
        opts = "".join(f", {k}={v}" for k, v in self.options.items())
        return f"Loss({self.name!r}{opts})"


class SquareLoss(Loss):
    """Mean squared error, as ``torch.nn.MSELoss()``: mean((Y - T)^2) (the table's ``mse``)."""

    def __init__(self):
        super().__init__("mse")

    def __repr__(self):
        return "SquareLoss()"


class AbsoluteLoss(Loss):
    """Mean absolute error, as ``torch.nn.L1Loss()``: mean(|Y - T|) (the table's ``l1``; slope 0 where Y = T)."""

    def __init__(self):
        super().__init__("l1")

    def __repr__(self):
        return "AbsoluteLoss()"


class ElasticLoss(Loss):
    """mean(l1 |Y - T| + l2 (Y - T)^2) (the table's ``elastic``)."""

    def __init__(self, l1: float = 0.5, l2: float = 0.5):
        super().__init__("elastic", l1=l1, l2=l2)
        self.l1, self.l2 = self.options["l1"], self.options["l2"]

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
        outs = ["penalty"] + [f"G{k}_out" for k in range(len(names))]
        b = GraphBuilder({f"{p}{k}" for k in range(len(names)) for p in "WG"} | set(outs), "penalty")
        l1, l2 = b.initializer(self.l1, dtype, "l1"), b.initializer(self.l2, dtype, "l2")
        l2x2 = b.initializer(2 * self.l2, dtype, "l2x2")
        terms = []
        inputs, outputs = [], [helper.make_tensor_value_info("penalty", dtype, [])]
        for k, (dt, shape) in enumerate(zip(dtypes, shapes)):
            w, gr = f"W{k}", f"G{k}"
            inputs += [helper.make_tensor_value_info(w, dt, list(shape)),
                       helper.make_tensor_value_info(gr, dt, list(shape))]
            outputs.append(helper.make_tensor_value_info(f"G{k}_out", dt, list(shape)))
            g = b.under(w)
            abs_sum = g.ReduceSum(g.Abs(w), keepdims=0)
            sq_sum = g.ReduceSum(g.Mul(w, w), keepdims=0)
            terms.append(g.Add(g.Mul(l1, abs_sum), g.Mul(l2, sq_sum)))
            extra = g.Add(g.Mul(l1, g.Sign(w)), g.Mul(l2x2, w))
            g.Add(gr, extra, outputs=[f"G{k}_out"])
        b.Sum(*terms, outputs=["penalty"])
        return _model(b, inputs, outputs, "ElasticPenalty")

    def __call__(self, weights: list[np.ndarray], grads: list[np.ndarray]):
        feeds = {}
        for k, (w, gr) in enumerate(zip(weights, grads)):
            feeds[f"W{k}"], feeds[f"G{k}"] = w, gr
        penalty, *new = self.run(feeds)
        return float(penalty), new

    def __repr__(self):
        return f"ElasticPenalty(l1={self.l1}, l2={self.l2})"


# ---- optimizers: the table of onnx_autodiff.training.optimizers ---------------------------------------
class Optimizer(_Piece):
    """An optimizer of ``onnx_autodiff.training.OPTIMIZERS`` by name, with torch's defaults:
    ``Optimizer("adam", lr=0.01, betas=(0.9, 0.99))``. One graph updates every weight: inputs the
    learning rate, the counter T (finished steps), then per weight W, G and the state slots."""

    slots: tuple[str, ...] = ()  # names of the state slots in get_state (default: the table's)

    def __init__(self, name: str, lr: float = 1e-3, **options):
        try:
            self.name, self.options = resolve_optimizer(name, options)
        except TrainingBuilderError as e:
            raise OnnxAutodiffError(str(e).split(": ", 1)[1]) from None
        self.lr = float(lr)
        self._table_slots = OPTIMIZERS[self.name].slots
        if not self.slots:
            self.slots = self._table_slots

    def build_onnx_function(self, names, dtypes, shapes):
        b = GraphBuilder({"learning_rate", "T"}, "update")
        inputs = [helper.make_tensor_value_info("learning_rate", TensorProto.FLOAT, []),
                  helper.make_tensor_value_info("T", TensorProto.INT64, [])]
        params = []
        self._state_names: dict[tuple[int, str], str] = {}
        for k, (dt, shape) in enumerate(zip(dtypes, shapes)):
            p = Param(f"W{k}", dt, list(shape), grad=f"G{k}")
            b.taken.update((p.name, p.grad))
            inputs += [helper.make_tensor_value_info(n, dt, list(shape)) for n in (p.name, p.grad)]
            params.append(p)

        def state(p: Param, slot: str) -> str:
            name = b.name(f"{p.name}.{slot}")
            inputs.append(helper.make_tensor_value_info(name, p.dtype, p.dims))
            self._state_names[params.index(p), slot] = name
            return name

        new_state = {s: s_new for s, _, s_new in emit_optimizer(b, self.name, self.options, params, "learning_rate",
                                                                   "T", state)}
        outputs = []
        for k, p in enumerate(params):
            outs = [p.new] + [new_state[self._state_names[k, s]] for s in self._table_slots]
            outputs += [helper.make_tensor_value_info(n, p.dtype, p.dims) for n in outs]
        return _model(b, inputs, outputs, type(self).__name__)

    def init_state(self, weights: list[np.ndarray]) -> list[list[np.ndarray]]:
        return [[np.zeros_like(w) for _ in self._table_slots] for w in weights]

    def __call__(self, step: int, weights, grads, state):
        """Step ``step`` (1 for the first): new weights and new state."""
        feeds = {"learning_rate": np.array(self.lr, np.float32), "T": np.array(step - 1, np.int64)}
        for k, (w, gr, st) in enumerate(zip(weights, grads, state)):
            feeds[f"W{k}"], feeds[f"G{k}"] = w, gr
            feeds.update({self._state_names[k, s]: v for s, v in zip(self._table_slots, st)})
        out = self.run(feeds)
        per = 1 + len(self._table_slots)
        return ([out[k * per] for k in range(len(weights))],
                [list(out[k * per + 1:(k + 1) * per]) for k in range(len(weights))])

    def __repr__(self):
        opts = "".join(f", {k}={v}" for k, v in self.options.items())
        return f"Optimizer({self.name!r}, lr={self.lr}{opts})"


class SGD(Optimizer):
    """W <- W - lr G (``torch.optim.SGD(lr=lr)``; the table's ``sgd``)."""

    def __init__(self, lr: float = 0.01):
        super().__init__("sgd", lr)

    def __repr__(self):
        return f"SGD(lr={self.lr})"


class SGDNesterov(Optimizer):
    """Nesterov momentum as ``torch.optim.SGD(lr, momentum, nesterov=True)`` (the table's ``nesterov``):
    v <- momentum v + G; W <- W - lr (G + momentum v)."""

    slots = ("velocity",)

    def __init__(self, lr: float = 0.01, momentum: float = 0.9):
        super().__init__("nesterov", lr, momentum=float(momentum))
        self.momentum = float(momentum)

    def __repr__(self):
        return f"SGDNesterov(lr={self.lr}, momentum={self.momentum})"


class Adam(Optimizer):
    """Adam as ``torch.optim.Adam`` (the table's ``adam``: the spec's Adam op, whose epsilon sits after the bias
    correction, see docs/training.md)."""

    slots = ("m", "v")

    def __init__(self, lr: float = 0.001, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8):
        super().__init__("adam", lr, betas=(float(beta1), float(beta2)), eps=float(eps))
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)

    def __repr__(self):
        return f"Adam(lr={self.lr}, beta1={self.beta1}, beta2={self.beta2}, eps={self.eps})"


# ---- the trainer ------------------------------------------------------------------------------------

def _optimizer(optimizer, lr, options, learning_rate):
    """The optimizer object from ``optimizer=`` (a name or an object) or the deprecated ``learning_rate=``."""
    if learning_rate is not None:
        if optimizer is not None:
            raise TypeError("pass optimizer= only (learning_rate= is its old name)")
        warnings.warn("ForwardBackwardTrainer(learning_rate=...) is now optimizer=...", DeprecationWarning,
                      stacklevel=3)
        optimizer = learning_rate
    if isinstance(optimizer, str):
        return Optimizer(optimizer, 1e-3 if lr is None else lr, **(options or {}))
    if lr is not None or options:
        raise TypeError("lr= and optimizer_options= go with an optimizer name; an Optimizer object carries its own")
    return optimizer


def _trainable(inits: dict, trainable) -> list[str]:
    """The names to train (default: every float initializer), each checked to be a float initializer."""
    names = [n for n, t in inits.items() if t.data_type in FLOAT_TYPES] if trainable is None else list(trainable)
    if not names:
        raise OnnxAutodiffError("nothing to train: the model has no float initializer; pass trainable=...")
    for name in names:
        if name not in inits or inits[name].data_type not in FLOAT_TYPES:
            raise OnnxAutodiffError(f"trainable names {name!r}, which is not a float initializer of the model")
    return names

class ForwardBackwardTrainer:
    """Fits the ``trainable`` initializers of ``model`` (one data input, one output) by gradient descent.

    ``trainable``: initializer names (default: every float initializer). The loss compares the model's
    output with the targets; the penalty regularizes the weights; the optimizer updates them.
    ``loss``: a name of ``onnx_autodiff.training.LOSSES`` (``"mse"``, ``"l1"``, ``"elastic"``,
    ``"cross_entropy"``, ...) or a ``Loss`` (default ``SquareLoss()``). ``optimizer``: a name of
    ``onnx_autodiff.training.OPTIMIZERS`` (``"sgd"``, ``"adam"``, ...) with ``lr`` and
    ``optimizer_options`` (torch's defaults otherwise), or an ``Optimizer`` such as ``Adam(0.01)``
    (default ``SGD()``): the same vocabulary as ``make_training_model``. ``learning_rate=`` is the old
    name of ``optimizer=`` (deprecated). After ``fit``, ``train_losses_`` holds one loss per epoch (the
    mean of the batch losses weighted by batch size, penalty included).
    """

    def __init__(self, model, trainable: Sequence[str] | None = None, *, loss=None, penalty=None,
                 optimizer=None, lr: float | None = None, optimizer_options: dict | None = None,
                 output: str | None = None, providers=None, learning_rate=None):
        optimizer = _optimizer(optimizer, lr, optimizer_options, learning_rate)
        model = open_model(model).whole()
        inits = {t.name: t for t in model.graph.initializer}
        self.trainable = _trainable(inits, trainable)
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

        self.loss = Loss(loss) if isinstance(loss, str) else (loss if loss is not None else SquareLoss())
        self.penalty = penalty if penalty is not None else NoPenalty()
        self.optimizer = optimizer if optimizer is not None else SGD()
        weights = [numpy_helper.to_array(inits[n]).copy() for n in self.trainable]
        dtypes = [inits[n].data_type for n in self.trainable]
        if len(set(dtypes)) != 1:
            raise OnnxAutodiffError("the trainable initializers must share one element type")
        shapes = [w.shape for w in weights]
        out_dims = [d.dim_value if d.HasField("dim_value") else None for d in out.type.tensor_type.shape.dim]
        self._out_dims = out_dims
        self.loss.build(out.type.tensor_type.elem_type, out_dims, providers=providers)
        self.penalty.build(self.trainable, dtypes, shapes, providers=providers)
        self.optimizer.build(self.trainable, dtypes, shapes, providers=providers)

        self._forward = _session(self.vjp.forward, providers)
        self._backward = _session(self.vjp.backward, providers)
        self._predict = _session(inference_model(self.vjp), providers)
        self._forward_outputs = [o.name for o in self.vjp.forward.graph.output]
        self.weights = weights
        self.state = self.optimizer.init_state(weights)
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
        self.weights, self.state = self.optimizer(self.step_count, self.weights, grads, self.state)
        return loss + penalty

    # ---- the loop ---------------------------------------------------------------------------------
    def _targets(self, y: np.ndarray) -> np.ndarray:
        if getattr(self.loss, "label_type", None) == TensorProto.INT64:  # class indices
            return np.ascontiguousarray(y, dtype=np.int64)
        y = np.asarray(y, dtype=self.weights[0].dtype)
        if y.ndim == len(self._out_dims) - 1 and self._out_dims and self._out_dims[-1] == 1:
            y = y.reshape(*y.shape, 1)
        return np.ascontiguousarray(y)

    def fit(self, X, y, *, epochs: int = 10, batch_size: int | None = None, shuffle: bool = True,
            seed: int | None = 0) -> ForwardBackwardTrainer:
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
                          for s, v in zip(self.optimizer.slots, st)},
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
            self.state = self.optimizer.init_state(self.weights)
            self.step_count = 0
        else:
            self.state = [[np.array(opt[f"{s}/{n}"], dtype=w.dtype) for s in self.optimizer.slots]
                          for n, w in zip(self.trainable, self.weights)]
            self.step_count = int(state.get("step", 0))

    # ---- export -----------------------------------------------------------------------------------
    def to_onnx(self) -> onnx.ModelProto:
        """The model with the trained weights as its initializers."""
        return inference_model(self.vjp, dict(zip(self.trainable, self.weights)))

    def onnx_graphs(self) -> dict[str, onnx.ModelProto | None]:
        """Every graph the loop runs, by role."""
        return {"forward": self.vjp.forward, "backward": self.vjp.backward, "loss": self.loss.model,
                "penalty": self.penalty.model, "optimizer": self.optimizer.model}

    def save_onnx_graph(self, path) -> None:
        """Write the trained model to ``path`` atomically (a temporary file, then ``os.replace``)."""
        save_model_atomic(self.to_onnx(), path)


__all__ = ["ForwardBackwardTrainer", "Loss", "Optimizer", "SquareLoss", "AbsoluteLoss", "ElasticLoss", "NoPenalty",
           "ElasticPenalty", "SGD", "SGDNesterov", "Adam"]
