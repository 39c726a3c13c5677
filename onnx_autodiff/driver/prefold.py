"""Constant integer arithmetic on frozen weights, done once in numpy before onnxruntime sees the step.

The MatMulNBits gradient unpacks the int4 codes of the frozen packed weight with ``Unsqueeze`` -> ``BitShift`` ->
``Mod`` -> ``Reshape`` (gradient_rules/quantized.py), constants onnxruntime folds while it makes the session. Its
constant folding runs each kernel on one thread and copies every result into a new initializer: at
Qwen2.5-0.5B's shape (121 MatMulNBits, 494 M codes) the gradient session's creation took 9.5 CPU s with the
folding and 2.4 without (docs/benchmarks.md). numpy does the same arithmetic in a fraction of that, and the
codes then reach onnxruntime as an array bound to a graph input (no copy), while the packed weight is read by
MatMulNBits alone (onnxruntime prepacks it and may drop its own copy).

Only chains rooted in a detached initializer that is no graph input (a frozen weight whose bytes are in the
arrays; not the state a step updates, nor an input a caller may feed) are folded, through
``FOLDED`` ops whose other inputs are constants; what the graph reads of such a chain becomes a detached
initializer of the same name and dtype with the array computed here, bit for bit what onnxruntime would fold.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..model.weights import is_detached, placeholder


def _unsqueeze(x, axes):
    out = x
    rank = x.ndim + len(axes)
    for a in sorted(int(a) % rank for a in axes):
        out = np.expand_dims(out, a)
    return out


def _reshape(x, shape, allowzero=0):
    dims = [int(d) for d in shape]
    if not allowzero:
        dims = [x.shape[k] if d == 0 else d for k, d in enumerate(dims)]
    return x.reshape(dims)


def _by_slices(fn, x, c):
    """``fn(x, c)`` with numpy broadcasting, computed one value of ``c`` at a time when ``c`` is a few values along
    one axis (the shifts of a byte's codes: numpy's broadcast loop over a trailing axis of 2 runs 2 elements a
    call, about 20x slower than whole slices)."""
    c = np.asarray(c)
    shape = np.broadcast_shapes(x.shape, c.shape)
    varying = [k for k, d in enumerate(c.shape) if d > 1]
    if c.size == 1 or c.size > 16 or len(varying) != 1:
        return fn(x, c)
    axis = len(shape) - c.ndim + varying[0]
    out = np.empty(shape, np.result_type(x, c))
    xb, values = np.broadcast_to(x, shape), c.reshape(-1)
    for j, v in enumerate(values):
        at = (slice(None),) * axis + (j,)
        out[at] = fn(xb[at], v)
    return out


def _bitshift(x, shift, direction):
    return _by_slices(np.right_shift if direction == b"RIGHT" else np.left_shift, x, shift)


def _mod(x, m, fmod=0):
    if fmod or x.dtype.kind not in "ui":
        return None  # float or C-style remainder: left to onnxruntime
    m = np.asarray(m)
    v = int(m.reshape(-1)[0]) if m.size == 1 else 0
    if x.dtype.kind == "u" and m.dtype == x.dtype and v > 0 and not v & (v - 1):
        mask = np.full(m.shape, v - 1, m.dtype)  # a power of two: the low bits
        owned = x.flags.writeable and x.flags.owndata and x.flags.c_contiguous and not isinstance(x, np.memmap)
        return np.bitwise_and(x, mask, out=x) if owned and x.shape == np.broadcast_shapes(x.shape, m.shape) else \
            np.bitwise_and(x, mask)
    return _by_slices(np.mod, x, m)


# op -> (numpy form, attribute defaults); each returns the output array (None: not folded)
FOLDED = {
    "Unsqueeze": lambda x, axes, **_: _unsqueeze(x, axes),
    "Reshape": lambda x, shape, allowzero=0, **_: _reshape(x, shape, allowzero),
    "BitShift": lambda x, s, direction=b"RIGHT", **_: _bitshift(x, s, direction),
    "Mod": lambda x, m, fmod=0, **_: _mod(x, m, fmod),
}
ARITHMETIC = {"BitShift", "Mod"}
_SMALL = 1 << 16  # a constant operand (shift, modulus, shape) is at most this many elements


def _read_only(arr) -> np.ndarray:
    """A view of a stored array that no folded op writes into."""
    view = np.asarray(arr).view()
    view.flags.writeable = False
    return view


def _operand(name: str, values: dict, arrays: Mapping, left: dict) -> np.ndarray:
    """The array a folded node reads: writable (the op may overwrite it: Mod into the shifted codes, one array
    and not two) only when it is a value we computed that no other node reads and no other value views."""
    if name not in values:
        return _read_only(arrays[name])
    x = values[name]
    alone = left[name] == 1 and not any(k != name and np.may_share_memory(x, v) for k, v in values.items())
    return x if alone else _read_only(x)


def _constants(g: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Values of the Constant nodes' ``value`` tensors and of the inline initializers, when small."""
    out = {}
    for n in g.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            value = next((a.t for a in n.attribute if a.name == "value"), None)
            if value is not None and np.prod(value.dims, dtype=np.int64) <= _SMALL:
                out[n.output[0]] = numpy_helper.to_array(value)
    for t in g.initializer:
        if not is_detached(t) and t.data_location != onnx.TensorProto.EXTERNAL and \
                np.prod(t.dims, dtype=np.int64) <= _SMALL:
            out.setdefault(t.name, numpy_helper.to_array(t))
    return out


def fold_weight_arithmetic(model: onnx.ModelProto, arrays: Mapping[str, np.ndarray],
                           leave: Collection[str] = ()) -> dict[str, np.ndarray]:
    """In place: every chain of ``FOLDED`` nodes of ``model``'s graph that starts at a detached initializer (its
    array in ``arrays``; not a graph input, not in ``leave``) and whose other inputs are small constants is computed
    here; the values the rest of the graph reads become detached initializers and the folded nodes (and Constant
    nodes left unread) go. Returns the new arrays (name -> array), for the caller's weights store.

    ``leave``: weights whose chains stay onnxruntime's to fold; the driver passes those that came inline in a
    ModelProto (``LightModel.private``): a model handed back whole (under 256 MiB of tensors) stepped 4% slower
    with its codes prefolded than with onnxruntime's folded initializers (docs/benchmarks.md, third session)."""
    g = model.graph
    fed = {i.name for i in g.input} | set(leave)  # state and inputs with a default change: they are not folded
    detached = {t.name for t in g.initializer if is_detached(t) and t.name in arrays and t.name not in fed}
    if not detached:  # every chain starts at one (a trained model's weights are all fed): nothing to fold, no walk
        return {}
    consts = _constants(g)
    left: dict[str, int] = {o.name: 1 for o in g.output}  # readers of each value not folded (yet)
    for n in g.node:
        for i in n.input:
            left[i] = left.get(i, 0) + 1
    values: dict[str, np.ndarray] = {}  # folded values some reader not folded yet reads
    arith: dict[str, bool] = {}  # whether a folded value is more than a view of the weight (Unsqueeze, Reshape)
    folded = []
    for n in g.node:
        if n.op_type not in FOLDED or n.domain not in ("", "ai.onnx") or len(n.output) != 1 or not n.input:
            continue
        first, rest = n.input[0], list(n.input[1:])
        if (first not in values and first not in detached) or not all(r in consts for r in rest):
            continue
        x = _operand(first, values, arrays, left)
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        out = FOLDED[n.op_type](x, *[consts[r] for r in rest], **attrs)
        if out is None:
            continue
        folded.append(n)
        values[n.output[0]] = out
        arith[n.output[0]] = n.op_type in ARITHMETIC or arith.get(first, False)
        if first in values:
            left[first] -= 1
            if not left[first]:
                del values[first]  # no other reader: freed before the next weight's arithmetic
    folded = _views_left(folded, values, arith)
    if not folded:
        return {}
    kept = {name: np.ascontiguousarray(v) for name, v in values.items() if arith[name]}
    _replace(g, folded, kept)
    return kept


def _views_left(folded: list, values: dict, arith: dict) -> list:
    """The folded nodes less those left to onnxruntime: a chain of views only (Unsqueeze, Reshape: no
    arithmetic to save) that the rest of the graph reads, with the views it reads."""
    restored: set[int] = set()
    needed: set[str] = set()
    for n in reversed(folded):
        out = n.output[0]
        if not arith[out] and (out in values or out in needed):
            restored.add(id(n))
            needed.update(n.input)
    return [n for n in folded if id(n) not in restored]


def _replace(g: onnx.GraphProto, folded: list, kept: dict[str, np.ndarray]) -> None:
    """The folded nodes out, a detached initializer for each kept value in, Constant nodes nobody reads out."""
    gone = {id(n) for n in folded}
    nodes = [n for n in g.node if id(n) not in gone]
    read = {i for n in nodes for i in n.input} | {o.name for o in g.output}
    nodes = [n for n in nodes if n.op_type != "Constant" or n.output[0] in read]
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend(placeholder(name, arr) for name, arr in kept.items())
    drop = set(kept)
    infos = [vi for vi in g.value_info if vi.name not in drop]
    del g.value_info[:]
    g.value_info.extend(infos)


__all__ = ["fold_weight_arithmetic", "FOLDED"]
