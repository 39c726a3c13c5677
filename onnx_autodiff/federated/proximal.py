"""FedProx's proximal term inside the step, and a client's local epochs.

``with_proximal_term(model, params)`` adds ``mu/2 * sum_p ||p - p_anchor||^2`` to the loss the Gradient nodes
differentiate (the reported loss stays the model's own). ``p_anchor`` (``<p>.fedprox_anchor``) and ``mu``
(``fedprox.mu``) are state tensors the step carries unchanged, so the round's global weights and mu are fed
to the step by setting its state, on every runtime; with mu = 0 the step is the model's own.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..driver.fit import fit
from ..graph import TRAINING_DOMAINS, attr_value

MU = "fedprox.mu"


def anchor_name(param: str) -> str:
    return f"{param}.fedprox_anchor"


def with_proximal_term(model: onnx.ModelProto, params: Sequence[str]) -> onnx.ModelProto:
    """A copy of the training model whose Gradient nodes differentiate ``loss + mu/2 * sum ||p - anchor||^2``."""
    out = copy.deepcopy(model)
    g, alg = out.graph, out.training_info[0].algorithm
    inits = {t.name: t for t in g.initializer}
    grads = [n for n in alg.node if n.op_type == "Gradient" and n.domain in TRAINING_DOMAINS]
    y = attr_value(grads[0], "y")
    f32 = onnx.TensorProto.FLOAT
    g.initializer.append(numpy_helper.from_array(np.array(0.0, np.float32), MU))
    nodes, squares = [], []
    for p in params:
        t = inits[p]
        dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
        g.initializer.append(numpy_helper.from_array(np.zeros(tuple(t.dims), dtype), anchor_name(p)))
        d, sq, s = f"{p}/fedprox/diff", f"{p}/fedprox/square", f"{p}/fedprox/sum"
        nodes += [helper.make_node("Sub", [p, anchor_name(p)], [d]),
                  helper.make_node("Mul", [d, d], [sq]),
                  helper.make_node("ReduceSum", [sq], [s], keepdims=0)]
        if t.data_type != f32:
            nodes.append(helper.make_node("Cast", [s], [s + "/f32"], to=f32))
            s += "/f32"
        squares.append(s)
    half = "fedprox/half"
    alg.initializer.append(numpy_helper.from_array(np.array(0.5, np.float32), half))
    nodes += [helper.make_node("Sum", squares, ["fedprox/total"]),
              helper.make_node("Mul", [MU, half], ["fedprox/half_mu"]),
              helper.make_node("Mul", ["fedprox/half_mu", "fedprox/total"], ["fedprox/term"]),
              helper.make_node("Add", [y, "fedprox/term"], ["fedprox/objective"])]
    types = {t.name: t.data_type for t in g.initializer}
    for name in [MU] + [anchor_name(p) for p in params]:  # carried unchanged from step to step
        nodes.append(helper.make_node("Identity", [name], [name + ".next"]))
        alg.output.append(helper.make_tensor_value_info(name + ".next", types[name], None))
        out.training_info[0].update_binding.append(onnx.StringStringEntryProto(key=name, value=name + ".next"))
    for n in grads:
        for a in n.attribute:
            if a.name == "y":
                a.s = b"fedprox/objective"
    first = list(alg.node).index(grads[0])
    rest = list(alg.node)
    del alg.node[:]
    alg.node.extend(rest[:first] + nodes + rest[first:])  # the term before the first Gradient node
    return out


def local_fit(local, arrays: Mapping[str, np.ndarray], *, epochs: int, batch_size: int, seed, lr=None,
              mu: float = 0.0, anchor: Mapping[str, np.ndarray] | None = None) -> tuple[float, int]:
    """Train ``local`` (a ``LocalTrainer``) for ``epochs`` epochs on ``arrays``; returns (mean loss of the last
    epoch, samples). ``mu`` > 0: the proximal term pulls towards ``anchor`` (the round's global tensors)."""
    if local.proximal:
        local.set({MU: np.array(mu, np.float32)})
        local.set({anchor_name(p): anchor[p] for p in local.params})
    n = len(next(iter(arrays.values())))
    seed = int(np.random.SeedSequence([abs(int(s)) for s in seed]).generate_state(1)[0])
    state = fit(local.trainer, arrays, batch_size, epochs, seed=seed, lr=lr, progress=False, log=lambda s: None)
    return float(state.losses[-1]), n
