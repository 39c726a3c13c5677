"""``check`` on the language-model files people hold (Optimum and transformers.js exports, onnxruntime-genai's
model builder): inputs that satisfy how their dims relate, and a float reference of their quantized ops.

Feeds (``check_feeds``): symbolic dims get sizes by their names (a batch 2, a sequence 3, a past 2) and a dim
written as a sum (``past_sequence_length + sequence_length``, Optimum's attention mask and presents) gets the sum;
an attention mask spans past and sequence (a merged decoder declares it over the sequence only); token ids fall
inside the vocabulary (the rows of the embedding their Gather reads); position ids count from the past length; a
mask has no fully masked row unless ``padding`` asks for left or right padding. A merged decoder (an ``If`` on a
boolean input such as ``use_cache_branch``) is fed twice: with the cache (a past of 2) and without (an empty one).

Reference (``dequantized``): onnxruntime's quantized ops have no float64 kernels (DequantizeLinear takes float
scales only, DynamicQuantizeLinear float input, MatMulNBits float32/16), so the check's float64 models run them
dequantized: DequantizeLinear of a constant becomes its float value (of a computed tensor, ``(x - zero) * scale``
in standard ops), MatMulNBits and the dynamically quantized int8 product become a MatMul by the dequantized
weight, GatherBlockQuantized (a tied int4 embedding) a Gather of the dequantized table (``quantized_gather.py``).
The gradients are the ones the rules built for the quantized model (a straight-through estimate for the dynamic
product, exact for the weight-only ones), so finite differences of the dequantized forward check them.
"""
from __future__ import annotations

import ast

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..driver.kv_cache import cache_switches
from ..graph import infer_tensor_info, walk_graphs
from ..training.lora.quantized import (
    MS_DOMAIN,
    dequantize_int8,
    dequantize_linear,
    dequantize_nbits,
    dynamic_product,
)
from .quantized_gather import expand_gather_block_quantized

BATCH, SEQUENCE, PAST = 2, 3, 2
_THROUGH = {"Reshape", "Unsqueeze", "Squeeze", "Cast", "Identity", "Flatten"}  # ids keep their values through these


def _size(name: str, past: int) -> int:
    low = name.lower()
    if "past" in low:
        return past
    if "total" in low:
        return past + SEQUENCE
    if "seq" in low or "length" in low:
        return SEQUENCE
    return BATCH


def dim_size(dim: str, past: int = PAST, sizes: dict[str, int] | None = None) -> int:
    """The size of symbolic dim ``dim``: ``sizes[dim]`` when given, else by its name, or the value of an expression
    of names and integers (``past_sequence_length + sequence_length``)."""
    sizes = sizes or {}
    if dim in sizes:
        return sizes[dim]
    try:
        tree = ast.parse(dim, mode="eval").body
    except SyntaxError:
        return _size(dim, past)

    def value(node) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return sizes[node.id] if node.id in sizes else _size(node.id, past)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv)):
            a, b = value(node.left), value(node.right)
            return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b, ast.FloorDiv: a // max(b, 1)}[type(node.op)]
        raise ValueError(dim)

    try:
        return max(value(tree), 0)
    except (ValueError, KeyError):
        return _size(dim, past)


def _vocabulary(model: onnx.ModelProto, name: str, info) -> int | None:
    """The rows of the table token input ``name`` indexes (through reshapes and casts), if static."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for g in walk_graphs(model):
        for n in g.node:
            for i in n.input:
                readers.setdefault(i, []).append(n)
    todo, seen, sizes = [name], set(), []
    while todo:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        for n in readers.get(t, []):
            if n.op_type in _THROUGH and n.input[0] == t:
                todo.append(n.output[0])
            elif n.op_type in ("Gather", "GatherBlockQuantized") and len(n.input) > 1 and n.input[1] == t:
                data = info.get(n.input[0])
                axis = next((a.i for a in n.attribute if a.name in ("axis", "gather_axis")), 0)
                if data is not None and data.shape is not None and isinstance(data.shape[axis], int):
                    sizes.append(int(data.shape[axis]))
    return min(sizes) if sizes else None


def _mask(shape: list[int], padding: str | None) -> np.ndarray:
    """Ones; with ``padding`` the first row padded (left: its first half masked, so some queries see no key;
    right: its last position)."""
    mask = np.ones(shape, np.int64)
    if padding == "left":
        mask[0, :max(shape[1] // 2, 1)] = 0
    elif padding == "right":
        mask[0, -1] = 0
    elif padding is not None:
        raise ValueError(f"padding must be None, 'left' or 'right', not {padding!r}")
    return mask


def _positions(mask: np.ndarray, length: int) -> np.ndarray:
    """transformers' position ids from a mask: the count of real tokens before, 1 at padding; the last ``length``."""
    pos = np.where(mask == 0, 1, np.cumsum(mask, axis=1) - 1)
    return pos[:, pos.shape[1] - length:].astype(np.int64)


def check_feeds(model: onnx.ModelProto, seed: int = 0, padding: str | None = None, past: int = PAST,
                switches: dict[str, bool] | None = None, dims: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Inputs for every graph input that is not an initializer (see the module docstring); ``switches``: values
    of a merged decoder's boolean If inputs (True: with the cache, a past of ``past``; False: an empty past);
    ``dims``: sizes of symbolic dims, over those their names give (``input_dims.fitted_dims``, ``--dim``)."""
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    switches = dict(switches or {})
    for name in cache_switches(model.graph):
        switches.setdefault(name, True)
    sizes = dict(dims or {})
    names = {d.dim_param for vi in model.graph.input for d in vi.type.tensor_type.shape.dim}
    if (switches and not all(switches.values())) or not any("past" in d.lower() for d in names):
        past = 0
    info = None
    specs = [vi for vi in model.graph.input if vi.name not in inits]
    shapes = {}
    for vi in specs:
        shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else dim_size(d.dim_param, past, sizes)
                           for d in vi.type.tensor_type.shape.dim]
    sequence = next((shapes[n][1] for n in ("input_ids", "inputs_embeds") if n in shapes and len(shapes[n]) > 1),
                    SEQUENCE)
    feeds: dict[str, np.ndarray] = {}
    mask = None
    for vi in specs:
        tt = vi.type.tensor_type
        shape = shapes[vi.name]
        dt = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        low = vi.name.lower()
        if vi.name in switches:
            feeds[vi.name] = np.full(shape or [1], switches[vi.name])
        elif np.issubdtype(dt, np.floating):
            feeds[vi.name] = rng.standard_normal(shape).astype(dt)
        elif dt == np.bool_:
            feeds[vi.name] = rng.integers(0, 2, shape).astype(bool)
        elif "mask" in low and len(shape) == 2:
            shape[1] = past + sequence
            mask = feeds[vi.name] = _mask(shape, padding).astype(dt)
        elif "position" in low:
            continue  # from the mask, below
        else:
            info = info if info is not None else infer_tensor_info(model)
            vocab = _vocabulary(model, vi.name, info)
            feeds[vi.name] = rng.integers(0, vocab or 2, shape).astype(dt)
    for vi in specs:
        if vi.name not in feeds:
            shape = shapes[vi.name]
            dt = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
            full = mask if mask is not None else np.ones([shape[0], past + shape[-1]], np.int64)
            pos = _positions(full, shape[-1])
            feeds[vi.name] = np.broadcast_to(pos.reshape([shape[0]] + [1] * (len(shape) - 2) + [shape[-1]]),
                                             shape).astype(dt) if len(shape) >= 2 else pos[0].astype(dt)
    return feeds


def feed_sets(model: onnx.ModelProto, seed: int = 0, padding: str | None = None,
              dims: dict[str, int] | None = None) -> list[tuple[str, dict]]:
    """(label, feeds) to check ``model`` with: one set, or one per branch of a merged decoder."""
    switches = cache_switches(model.graph)
    if not switches:
        return [("", check_feeds(model, seed, padding, dims=dims))]
    out = []
    for value in (True, False):
        label = ", ".join(f"{s}={value}" for s in switches)
        out.append((label, check_feeds(model, seed, padding, switches={s: value for s in switches}, dims=dims)))
    return out


# ---- the float reference of quantized ops ----------------------------------------------------------------

def has_quantized_ops(model: onnx.ModelProto) -> bool:
    ops = {(n.domain or "", n.op_type) for g in walk_graphs(model) for n in g.node}
    return bool(ops & {("", "DequantizeLinear"), ("", "DynamicQuantizeLinear"), (MS_DOMAIN, "MatMulNBits"),
                       (MS_DOMAIN, "DynamicQuantizeMatMul"), (MS_DOMAIN, "GatherBlockQuantized")})


def dequantized(model: onnx.ModelProto, computed: bool = True) -> onnx.ModelProto:
    """A copy of ``model`` whose quantized ops compute in float (module docstring); what is not quantized stays.
    ``computed=False`` keeps DequantizeLinear of computed tensors (a float32 check: onnxruntime runs them, and a
    backward in float32 dequantizes weights with them, per axis)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = {}
    for g in walk_graphs(out):
        inits.update({t.name: t for t in g.initializer})
    for g in walk_graphs(out):
        _dequantize_graph(g, inits, computed)
    return expand_gather_block_quantized(out)


def _dequantize_graph(g: onnx.GraphProto, inits: dict, computed: bool = True) -> None:
    def value(name):
        return numpy_helper.to_array(inits[name])

    producers = {o: n for n in g.node for o in n.output}
    new_inits, replaced = [], {}
    for n in g.node:
        product = dynamic_product(n, inits, producers)
        if product is not None:
            w = numpy_helper.from_array(dequantize_int8(product, value), f"{product['weight']}/dequantized")
            new_inits.append(w)
            replaced[n.name] = [helper.make_node("MatMul", [product["quantize"].input[0], w.name], [n.output[0]],
                                                 name=f"{n.name}/dequantized")]
            replaced.update({product[k].name: [] for k in ("matmul", "cast", "scales")})
        elif n.op_type == "MatMulNBits" and n.domain == MS_DOMAIN and all(i in inits for i in n.input[1:4] if i):
            w = numpy_helper.from_array(np.ascontiguousarray(dequantize_nbits(n, value).T), f"{n.name}/dequantized")
            new_inits.append(w)
            bias = n.input[5] if len(n.input) > 5 else ""
            mm = helper.make_node("MatMul", [n.input[0], w.name], [f"{n.output[0]}/mm" if bias else n.output[0]],
                                  name=f"{n.name}/dequantized")
            replaced[n.name] = [mm] + ([helper.make_node("Add", [mm.output[0], bias], [n.output[0]],
                                                         name=f"{n.name}/bias")] if bias else [])
        elif n.op_type == "DequantizeLinear" and n.domain in ("", "ai.onnx"):
            if all(i in inits for i in n.input if i):
                t = numpy_helper.from_array(dequantize_linear(n, value), n.output[0])
                new_inits.append(t)
                replaced[n.name] = []
            elif computed:
                replaced[n.name] = _dequantize_nodes(n, inits)
    if not replaced:
        return
    nodes = [m for n in g.node for m in replaced.get(n.name, [n])]
    read = {i for m in nodes for i in m.input}
    nodes = [m for m in nodes if m.op_type != "DynamicQuantizeLinear" or set(m.output) & read]
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend(new_inits)


def _dequantize_nodes(n: onnx.NodeProto, inits: dict) -> list[onnx.NodeProto]:
    """(Cast(x) - Cast(zero point)) * scale for DequantizeLinear of a computed tensor, the scale per tensor."""
    scale = inits.get(n.input[1])
    if scale is None or int(np.prod(scale.dims)) != 1:
        raise ValueError(f"DequantizeLinear {n.name!r}: the float reference takes a constant per-tensor scale of a "
                         "computed input")
    to = scale.data_type
    x = helper.make_node("Cast", [n.input[0]], [f"{n.output[0]}/x"], name=f"{n.name}/x", to=to)
    nodes = [x]
    centred = x.output[0]
    if len(n.input) > 2 and n.input[2]:
        z = helper.make_node("Cast", [n.input[2]], [f"{n.output[0]}/zero"], name=f"{n.name}/zero", to=to)
        sub = helper.make_node("Sub", [centred, z.output[0]], [f"{n.output[0]}/centred"], name=f"{n.name}/centred")
        nodes += [z, sub]
        centred = sub.output[0]
    nodes.append(helper.make_node("Mul", [centred, n.input[1]], [n.output[0]], name=f"{n.name}/scaled"))
    return nodes
