"""Which initializers of an exported model are its parameters, and which are constants an exporter
stored as initializers; and undoing the TorchScript exporter's merging of equal parameters.

Exporters keep more than weights in initializers. The dynamo exporter lifts every scalar it meets
(GELU's ``Pow(x, 3.0)`` exponent, RMSNorm's epsilon, attention scales, mask fill values) and folds
input-shaped constants (the causal mask, rotary cos/sin tables) into initializers, named ``val_N``
like real (folded, transposed) weights. Training them is wrong and can diverge at once (the gradient
of a Pow exponent is NaN for negative bases), so the default trainable set leaves out, by structure:

* ``pow exponent``: anything read as a Pow exponent;
* ``scalar constant``: a tensor of one element read only by elementwise arithmetic (Add, Sub, Mul,
  Div, Where, Max, Min, Clip, comparisons), not by a layer (Conv, Gemm, MatMul, PRelu, a
  normalization, Exp ...). A learnable scalar multiplied in directly (ReZero's alpha) is left out too:
  name it in ``trainable=``;
* ``additive mask``: values that are all 0 or very negative (<= -1e4, -inf), with at least one of them;
* ``rotary table``: two tensors of one shape with cos^2 + sin^2 = 1 everywhere;
* ``shape/index input``: float tensors read only where no gradient flows (shapes, scales, ranges);
* ``quantization constant``: the scales and zero points of quantized ops (DequantizeLinear, MatMulNBits,
  onnxruntime's dynamic int8 products, ...): a quantized base is frozen (``lora/quantized.py``);
* ``group-norm decomposition``: the all-ones scale and all-zeros bias of an InstanceNormalization
  between Reshapes followed by a Mul (how exporters write GroupNorm: normalize per group, then the
  real per-channel affine); the affine after it holds the parameters;
* ``folded from the example input``: rank >= 3, leading dim the batch size of the graph inputs (> 1),
  read by no layer: a lookup or expand the exporter folded for the example batch (the dynamo exporter's
  token-type embeddings, expanded CLS tokens, zero attention masks). The parameter behind it cannot
  be recovered from the export; training the folded copy would train each batch row apart;
* ``position bias folded for the example lengths``: rank >= 3, read by no layer, added (through Adds,
  Wheres, Casts, Expands) to attention scores, i.e. a MatMul of two activations that reaches a Softmax
  through elementwise ops; its last two dims are the scores' query and key lengths (both >= 2) and its
  values depend only on key minus query position (equal along every diagonal): a relative position
  bias computed for the example lengths (the dynamo exporter's T5 ``[1, heads, T, S]`` lookups, and the
  zeros of T5's cross-attention, which has none). The table behind it cannot be recovered from the
  export; training the folded copy would train each (query, key) pair apart. A learned full-size bias
  differs along its diagonals and trains (one still all zeros, as initialised, does not: name it in
  ``trainable=``).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from ..graph import FLOAT_TYPES, infer_tensor_info
from ..model.weights import is_detached
from .lora.quantized import quantization_constants

_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Where", "Max", "Min", "Clip", "Equal", "Less", "Greater",
                "LessOrEqual", "GreaterOrEqual", "Pow", "Sum", "Mean"}
# float inputs that carry no gradient: (op, input index)
_SHAPE_LIKE = {("Resize", 1), ("Resize", 2), ("Upsample", 1), ("Range", 0), ("Range", 1), ("Range", 2),
               ("ConstantOfShape", 0), ("Reshape", 1), ("Expand", 1), ("Tile", 1), ("Slice", 1), ("Slice", 2),
               ("Slice", 3), ("Slice", 4), ("Gather", 1), ("OneHot", 1), ("OneHot", 2), ("Dropout", 1),
               ("Dropout", 2), ("Where", 0)}
MASK_FLOOR = -1e4


def _readers(graph: onnx.GraphProto) -> dict[str, list[tuple[str, int]]]:
    out: dict[str, list[tuple[str, int]]] = {}
    for n in graph.node:
        for k, i in enumerate(n.input):
            if i:
                out.setdefault(i, []).append((n.op_type, k))
    return out


# (op, input index) where an initializer is a layer's parameter
_PARAMETER_USES = {("Conv", 1), ("Conv", 2), ("ConvTranspose", 1), ("ConvTranspose", 2), ("Gemm", 0), ("Gemm", 1),
                   ("Gemm", 2), ("MatMul", 0), ("MatMul", 1), ("Gather", 0), ("PRelu", 1),
                   ("BatchNormalization", 1), ("BatchNormalization", 2), ("LayerNormalization", 1),
                   ("LayerNormalization", 2), ("InstanceNormalization", 1), ("InstanceNormalization", 2),
                   ("GroupNormalization", 1), ("GroupNormalization", 2), ("RMSNormalization", 1)}


def _batch_size(graph: onnx.GraphProto) -> int | None:
    inits = {t.name for t in graph.initializer}
    firsts = set()
    for vi in graph.input:
        if vi.name in inits:
            continue
        dims = vi.type.tensor_type.shape.dim
        if not dims or not dims[0].HasField("dim_value"):
            return None
        firsts.add(dims[0].dim_value)
    return firsts.pop() if len(firsts) == 1 else None


def constant_initializers(model: onnx.ModelProto, arrays=None) -> dict[str, str]:
    """``{name: reason}`` for the float initializers that are constants, not parameters (module doc)."""
    g = model.graph
    readers = _readers(g)
    floats = {t.name: t for t in g.initializer if t.data_type in FLOAT_TYPES}
    found: dict[str, str] = {}
    small = {}
    batch = _batch_size(g)
    quantized = quantization_constants(g)
    for name, t in floats.items():
        uses = readers.get(name, [])
        if not uses:
            continue
        if name in quantized:
            found[name] = "quantization constant"
            continue
        numel = int(np.prod(t.dims)) if len(t.dims) else 1
        if any(op == "Pow" and k == 1 for op, k in uses):
            found[name] = "pow exponent"
        elif all(u in _SHAPE_LIKE for u in uses):
            found[name] = "shape/index input"
        elif numel <= 1 and all(op in _ELEMENTWISE for op, _ in uses):
            found[name] = "scalar constant"
        elif batch and batch > 1 and len(t.dims) >= 3 and t.dims[0] == batch and not set(uses) & _PARAMETER_USES:
            found[name] = "folded from the example input"
        elif numel <= 1 << 22:
            small[name] = t
    for name in _group_norm_identities(g, floats):
        found.setdefault(name, "group-norm decomposition")
    arrays = arrays or {}  # the values of a light model's detached tensors (onnx_autodiff.model.weights)
    values = {n: np.asarray(arrays[n]) if n in arrays else numpy_helper.to_array(t) for n, t in small.items()
              if n in arrays or not is_detached(t)}
    for name, v in values.items():
        if v.size > 1 and _mask_like(v.reshape(-1)[:_HEAD]):
            neg = v <= MASK_FLOOR
            if neg.any() and np.all(neg | (v == 0)):
                found[name] = "additive mask"
    for name in _relative_position_biases(model, readers, values):
        found.setdefault(name, "position bias folded for the example lengths")
    by_shape: dict[tuple, list[str]] = {}
    for name, v in values.items():
        if name not in found and v.ndim >= 2 and v.size > 1:
            by_shape.setdefault(v.shape, []).append(name)
    for names in by_shape.values():  # pairs of same-shape tensors (BERT has 72 of 768x768)
        for a, b in _unit_pairs(names, values):
            found[a] = found[b] = "rotary table"
    return found


_HEAD = 64  # elements read first: most tensors fail a test on them, without reading the rest


def _mask_like(head: np.ndarray) -> bool:
    """Whether the first elements could be an additive mask's: each at most ``MASK_FLOOR`` or zero (a weight fails
    on its first elements, and its other pages are then never read)."""
    return bool(np.all((head <= MASK_FLOOR) | (head == 0)))


def _unit(squares: np.ndarray) -> np.ndarray:
    """Whether a sum of two float64 squares is 1 (a cos/sin table's pair), over the last axis."""
    return np.isclose(squares, 1.0, atol=1e-4).all(axis=-1)


def _squares(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, dtype=np.float64) ** 2


def _unit_pairs(names: list[str], values: dict) -> list[tuple[str, str]]:
    """The pairs ``(a, b)`` of ``names`` (same-shape tensors, a before b) whose squares sum to 1 everywhere: each
    tensor's first ``_HEAD`` elements against those of every later one at once, then only the pairs that pass on
    all their elements."""
    if len(names) < 2:
        return []
    heads = np.stack([_squares(values[n].reshape(-1)[:_HEAD]) for n in names])
    pairs = []
    for i, a in enumerate(names[:-1]):
        for j in np.flatnonzero(_unit(heads[i] + heads[i + 1:])) + i + 1:
            b = names[j]
            if _unit(_squares(values[a].reshape(-1)) + _squares(values[b].reshape(-1))):
                pairs.append((a, b))
    return pairs


# a value added to attention scores reaches the Softmax through these (op, input index)
_ADDITIVE = {("Add", 0), ("Add", 1), ("Sub", 0), ("Sub", 1), ("Where", 1), ("Where", 2), ("Cast", 0),
             ("Identity", 0), ("Expand", 0), ("Reshape", 0), ("Unsqueeze", 0), ("Squeeze", 0)}


def _score_sums(g: onnx.GraphProto) -> list[tuple[set[str], list[str]]]:
    """For each Softmax: (the tensors added to its input, the attention-score MatMuls behind it). Walks
    back from the Softmax through additive ops, and through Mul/Div (scaled scores) without collecting
    what they multiply by; a score MatMul reads two activations, no initializer (that is a layer)."""
    producer = {o: n for n in g.node for o in n.output}
    inits = {t.name for t in g.initializer}
    out = []
    for sm in g.node:
        if sm.op_type != "Softmax":
            continue
        added, scores, seen = set(), [], set()
        todo = [(sm.input[0], True)]
        while todo:
            name, additive = todo.pop()
            if (name, additive) in seen:
                continue
            seen.add((name, additive))
            if name in inits:
                if additive:
                    added.add(name)
                continue
            n = producer.get(name)
            if n is None:
                continue
            if n.op_type == "MatMul":
                if not set(n.input) & inits:
                    scores.append(n.output[0])
                continue
            for k, i in enumerate(n.input):
                if i and (n.op_type, k) in _ADDITIVE:
                    todo.append((i, additive))
                elif i and n.op_type in ("Mul", "Div"):
                    todo.append((i, False))
        if added and scores:
            out.append((added, scores))
    return out


def _relative_position_biases(model: onnx.ModelProto, readers: dict, values: dict) -> list[str]:
    """Initializers added to attention scores whose last two dims are the scores' (query, key) lengths
    and whose values are equal along each diagonal: relative position biases folded for the example."""
    g = model.graph
    sums = [(added, scores) for added, scores in _score_sums(g)
            if any(a in values and values[a].ndim >= 3 and min(values[a].shape[-2:]) >= 2 for a in added)]
    if not sums:
        return []
    shapes = {vi.name: vi.type for vi in list(g.value_info) + list(g.output)}
    info = None
    out = []
    for added, scores in sums:
        lengths = set()
        for s in scores:
            if s in shapes:
                dims = tuple(d.dim_value or None for d in shapes[s].tensor_type.shape.dim)
            else:
                info = info or infer_tensor_info(model)
                shape = info[s].shape if s in info else None
                dims = tuple(d if isinstance(d, int) else None for d in shape or ())
            if len(dims) >= 2 and None not in dims[-2:]:
                lengths.add(dims[-2:])
        for a in added:
            v = values.get(a)
            if v is None or v.ndim < 3 or tuple(v.shape[-2:]) not in lengths or min(v.shape[-2:]) < 2:
                continue
            if set(readers.get(a, [])) & _PARAMETER_USES:
                continue
            if np.array_equal(v[..., 1:, 1:], v[..., :-1, :-1]):
                out.append(a)
    return out


def _group_norm_identities(g: onnx.GraphProto, floats: dict) -> list[str]:
    """Scale (all ones) and bias (all zeros) initializers of InstanceNormalization nodes that read a
    Reshape and whose output reaches a Mul, directly or through one Reshape: GroupNorm as exported."""
    producer = {o: n for n in g.node for o in n.output}
    readers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)

    def reaches_mul(name: str) -> bool:
        nxt = readers.get(name, [])
        if len(nxt) == 1 and nxt[0].op_type == "Reshape":
            nxt = readers.get(nxt[0].output[0], [])
        return len(nxt) == 1 and nxt[0].op_type == "Mul"

    out = []
    for n in g.node:
        if n.op_type != "InstanceNormalization" or len(n.input) < 3 or not reaches_mul(n.output[0]):
            continue
        src = producer.get(n.input[0])
        if src is None or src.op_type != "Reshape":
            continue
        for name, value in ((n.input[1], 1.0), (n.input[2], 0.0)):
            t = floats.get(name)
            if t is not None and not is_detached(t) and np.all(numpy_helper.to_array(t) == value) \
                    and len(readers.get(name, [])) == 1:
                out.append(name)
    return out


def untie_aliases(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """Give every ``Identity`` of a float initializer its own initializer (a copy under the alias's
    name), in place; returns ``(alias, source)`` pairs.

    The TorchScript exporter merges parameters that happen to be equal at export time (fresh LayerNorm
    weights of ones, zero biases) into one initializer read through Identity nodes; training that model
    would tie parameters that were separate. An initializer read directly by several nodes (tied
    embeddings) is real tying and stays.
    """
    g = model.graph
    inits = {t.name: t for t in g.initializer if t.data_type in FLOAT_TYPES}
    outputs = {o.name for o in g.output}
    keep, pairs, copies = [], [], []
    for n in g.node:
        if n.op_type == "Identity" and n.input and n.input[0] in inits and n.output[0] not in outputs \
                and n.output[0] not in inits:
            t = onnx.TensorProto()
            t.CopyFrom(inits[n.input[0]])
            t.name = n.output[0]
            copies.append(t)
            pairs.append((n.output[0], n.input[0]))
        else:
            keep.append(n)
    if pairs:
        del g.node[:]
        g.node.extend(keep)
        g.initializer.extend(copies)
        used = {i for n in g.node for i in n.input} | outputs
        gone = {src for _, src in pairs if src not in used}
        if gone:
            rest = [t for t in g.initializer if t.name not in gone]
            del g.initializer[:]
            g.initializer.extend(rest)
            names = {i.name for i in g.input}
            if names & gone:
                ins = [i for i in g.input if i.name not in gone]
                del g.input[:]
                g.input.extend(ins)
    return pairs


def describe(model: onnx.ModelProto, names) -> str:
    """``name [shape]`` lines with the total count of elements."""
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    total = sum(int(np.prod(dims[n])) if dims[n] else 1 for n in names)
    return ", ".join(f"{n} {dims[n]}" for n in names) + f" ({total} values)"


__all__ = ["constant_initializers", "untie_aliases", "describe"]
