"""The models the runtime parity tests train through a step bundle: (training model, 5 batches)."""
from __future__ import annotations

import numpy as np

from onnx_autodiff.training import OptimizerSpec, make_training_model

MODELS = ("cnn", "mlp", "transformer", "bert")
OPTIMIZERS = ("adam", "sgd")


def _inference(name: str):
    """(inference model, loss, batch maker(rng) -> feeds without labels, label maker(rng, n))."""
    if name == "cnn":
        from onnx_autodiff.cli.demo import cnn_model
        return cnn_model(0), "cross_entropy", lambda r: {"image": r.random((8, 1, 8, 8), np.float32)}, \
            lambda r: r.integers(0, 10, 8)
    if name == "mlp":
        from tests.cli_models import mlp
        return mlp(hidden=32, features=16, classes=5), "cross_entropy", \
            lambda r: {"x": r.standard_normal((8, 16)).astype(np.float32)}, lambda r: r.integers(0, 5, 8)
    if name == "transformer":
        from tests.cli_models import transformer_block
        return transformer_block(), "mse", lambda r: {"x": r.standard_normal((4, 4, 16)).astype(np.float32)}, \
            lambda r: r.standard_normal((4, 5)).astype(np.float32)
    if name == "bert":
        from tests.hf_models import build, export
        module, inputs = build("bert")
        feeds = {k: v.numpy() for k, v in inputs.items()}
        return export(module, inputs, "ts17-nofold"), "mse", lambda r: dict(feeds), \
            lambda r: r.standard_normal((2, 5, 16)).astype(np.float32)
    raise KeyError(name)


# Adam's step g / (sqrt(v) + eps) is about lr * sign(g) wherever |g| is far below eps: for a gradient that
# is zero in exact arithmetic (a transformer's attention key bias: softmax ignores it) the sign is that of
# float rounding noise, which differs between runtimes, and with torch's eps = 1e-8 those weights move by
# +-lr in directions no runtime can agree on. eps = 1e-4 keeps such noise (~1e-9) from being amplified.
ADAM_EPS = {"transformer": 1e-4, "bert": 1e-4}
# BERT's attention key biases get exactly zero gradient: their Adam moments are rounding noise (~1e-12 and
# ~1e-23) on every runtime, which no relative comparison can hold; they are frozen here
FROZEN = {"bert": ["*attention.self.key.bias"]}


def training_case(name: str, optimizer: str, steps: int = 5):
    """(training model, batches): ``steps`` batches of random data with labels."""
    model, loss, make, labels = _inference(name)
    options = {"eps": ADAM_EPS[name]} if optimizer == "adam" and name in ADAM_EPS else None
    training = make_training_model(model, loss, OptimizerSpec(optimizer, options), lr=0.01, frozen=FROZEN.get(name))
    rng = np.random.default_rng(1)
    batches = [{**make(rng), "labels": labels(rng)} for _ in range(steps)]
    return training, batches
