"""The KV cache of a decoder model in training: its past inputs fed empty by the library, its present outputs
left out of what a step returns.

A decoder exported for generation (onnxruntime-genai's model builder, Optimum) takes the keys and values of
the tokens before as inputs (``past_key_values.N.key`` [batch, kv heads, past length, head size]) and returns
them extended (``present.N.key``). Training reads a whole sequence at once, so the past is empty: the user
gives token data only and ``empty_caches`` makes the zero-length arrays. Their shapes come from the model's
declared input shapes: a static dim as declared (kv heads), a symbolic dim shared with a data input from that
feed (the batch), a symbolic dim the matching present output has static after shape inference (a head size the
builder declares as ``kv_cache_dim``), and the one dim left, the past length, 0. A GroupQueryAttention with a
window-sized cache (``sliding_window_cache=1``, the model builder's default for Gemma2/Gemma3's sliding-window
layers) reads a buffer of a capacity of at least its ``local_window_size`` W whatever the tokens in it: its past
is W zero rows, none of them valid (the op counts the tokens known from ``seqlens_k``, the mask, and with no more
than the sequence's it reads no past row). onnxruntime runs such a node over a fresh sequence for whole rows only
(seqlens_k = S - 1): a fed ``attention_mask`` with padding is a ``DataError`` naming the node, before the run.

A cache input is one read as the past of an attention op (``ATTENTION_PAST``), or named ``past_key_values.*``
(Optimum's exports, whose past is a Concat); its present output is the same op's output, or ``present.*``.

Such a decoder (Optimum's and transformers.js's with-past Llama, Qwen2/Qwen3, Mistral, Phi-3) may also take
``position_ids``: unless fed, they are made as transformers makes them for a prompt, from ``attention_mask``
(cumsum(mask) - 1, and 1 where the mask is 0), so a left-padded row's first token is at position 0
(``PositionInput``; ``derived_inputs`` names what the driver makes besides the caches).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from ..errors import DataError, TrainingSpecError
from ..graph import infer_tensor_info, model_shell, normalize_domain

# (domain, op) -> ((past input position, present output position), ...)
ATTENTION_PAST = {("com.microsoft", "GroupQueryAttention"): ((3, 1), (4, 2)),
                  ("com.microsoft", "MultiHeadAttention"): ((6, 1), (7, 2)),
                  ("com.microsoft", "Attention"): ((4, 1),),
                  ("", "Attention"): ((4, 1), (5, 2))}
PAST_PREFIX, PRESENT_PREFIX = "past_key_values.", "present."


@dataclass
class CacheInput:
    """How to make one empty cache input: ``dims`` holds an int (a static size, 0 for the past length) or
    ``(input, axis)`` (the size of that axis of a feed)."""

    name: str
    dtype: np.dtype
    dims: list
    window_node: str = ""  # the GroupQueryAttention that reads it as a window-sized cache, if one does

    def empty(self, feeds: dict) -> np.ndarray:
        if self.window_node and MASK in feeds:
            _whole_rows(_array(feeds[MASK]), self.window_node)
        shape = []
        for d in self.dims:
            if isinstance(d, int):
                shape.append(d)
                continue
            source, axis = d
            if source not in feeds:
                raise TrainingSpecError(f"the empty KV cache {self.name!r} takes its size from the feed {source!r}, "
                                        "which is missing", hint=f"feed {source!r} (the token data)")
            value = feeds[source]
            shape.append(int((value.shape() if isinstance(value, ort.OrtValue) else np.shape(value))[axis]))
        return np.zeros(shape, self.dtype)


POSITIONS, MASK, TOKENS = "position_ids", "attention_mask", "input_ids"


def _whole_rows(mask: np.ndarray, node: str) -> None:
    """DataError unless every row of ``mask`` is whole (no 0): a windowed cache's node runs over a fresh sequence
    only then (onnxruntime: "seqlens_k[b] = .. is too small for sequence_length")."""
    padded = np.flatnonzero((mask.reshape(mask.shape[0], -1) == 0).any(axis=1)) if mask.ndim else []
    if len(padded):
        raise DataError(f"{MASK!r} masks tokens in row(s) {padded.tolist()[:8]}: node {node!r} keeps a window-sized "
                        "KV cache (sliding_window_cache=1), which onnxruntime runs over a fresh sequence for whole "
                        "rows only", hint="train on rows without padding (text packed into whole rows; a packed "
                        "corpus pads its last row only), or rebuild the model with a full-length cache (model "
                        "builder: --extra_options windowed_kv_cache=false; the same weights, and padding works)")


@dataclass
class PositionInput:
    """How to make a decoder's ``position_ids`` [batch, sequence] over an empty past: transformers' positions of a
    prompt, from the ``attention_mask`` feed (cumsum - 1, 1 where masked), else 0..S-1 for each row of the tokens."""

    name: str
    dtype: np.dtype

    def empty(self, feeds: dict) -> np.ndarray:
        if MASK in feeds:
            mask = _array(feeds[MASK]) != 0
            return np.where(mask, np.cumsum(mask, axis=-1) - 1, 1).astype(self.dtype)
        if TOKENS not in feeds:
            raise TrainingSpecError(f"the model's {self.name!r} is made from {MASK!r} or {TOKENS!r}, and neither is "
                                    "fed", hint=f"feed {MASK!r} (or {self.name!r} yourself)")
        b, s = np.shape(_array(feeds[TOKENS]))[:2]
        return np.broadcast_to(np.arange(s, dtype=self.dtype), (b, s)).copy()


def _array(value) -> np.ndarray:
    return value.numpy() if isinstance(value, ort.OrtValue) else np.asarray(value)


def derived_inputs(graph: onnx.GraphProto) -> list[str]:
    """The inputs besides the caches that the driver makes for a decoder whose past it feeds empty: its integer
    ``position_ids`` of rank 2."""
    if not cache_names(graph)[0]:
        return []
    for i in graph.input:
        tt = i.type.tensor_type
        if i.name == POSITIONS and tt.elem_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) \
                and tt.HasField("shape") and len(tt.shape.dim) == 2:
            return [POSITIONS]
    return []


def _pairs(graph: onnx.GraphProto) -> dict[str, str]:
    """Past input -> present output of each attention node that reads a graph input as its past."""
    inputs = {i.name for i in graph.input}
    out = {}
    for n in graph.node:
        for i, o in ATTENTION_PAST.get((normalize_domain(n.domain), n.op_type), ()):
            if i < len(n.input) and n.input[i] in inputs:
                out[n.input[i]] = n.output[o] if o < len(n.output) else ""
    return out


def _window_capacities(graph: onnx.GraphProto) -> dict[str, tuple[int, str]]:
    """Past input -> (the capacity its windowed GroupQueryAttention needs, ``local_window_size``; that node's name):
    the past of a ``sliding_window_cache=1`` node is a buffer of that many rows, not a past length."""
    out: dict[str, tuple[int, str]] = {}
    for n in graph.node:
        if (normalize_domain(n.domain), n.op_type) != ("com.microsoft", "GroupQueryAttention"):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if attrs.get("sliding_window_cache", 0) and attrs.get("local_window_size", -1) > 0:
            for i in (3, 4):
                if i < len(n.input) and n.input[i]:
                    size = max(out.get(n.input[i], (0, ""))[0], int(attrs["local_window_size"]))
                    out[n.input[i]] = (size, n.name or n.output[0])
    return out


def cache_names(graph: onnx.GraphProto) -> tuple[dict[str, str], list[str]]:
    """({past input: its present output or ""}, [present outputs]) of ``graph``."""
    pairs = _pairs(graph)
    outputs = {o.name for o in graph.output}
    for i in graph.input:
        if i.name.startswith(PAST_PREFIX) and i.name not in pairs:
            present = PRESENT_PREFIX + i.name[len(PAST_PREFIX):]
            pairs[i.name] = present if present in outputs else ""
    presents = [o.name for o in graph.output if o.name in set(pairs.values())
                or (pairs and o.name.startswith(PRESENT_PREFIX))]
    return pairs, presents


def cache_inputs(model: onnx.ModelProto, data_inputs: list[str]) -> list[CacheInput]:
    """How to make each cache input of ``model``'s graph empty (see the module docstring); ``data_inputs``: the
    inputs the user feeds. TrainingSpecError for a cache input whose shape the model does not tell."""
    g = model.graph
    pairs, _ = cache_names(g)
    if not pairs:
        return []
    declared = {i.name: i for i in g.input}
    by_param = {}
    for name in data_inputs:
        vi = declared.get(name)
        for axis, d in enumerate(vi.type.tensor_type.shape.dim if vi is not None else []):
            if d.dim_param:
                by_param.setdefault(d.dim_param, (name, axis))
    inferred = None
    out = []
    capacity = _window_capacities(g)
    for name, present in pairs.items():
        tt = declared[name].type.tensor_type
        if not tt.HasField("shape"):
            raise TrainingSpecError(f"the KV cache input {name!r} declares no shape",
                                    hint=f"feed {name!r} yourself (an empty past, length 0 on its sequence axis)")
        dims, past = [], None
        for axis, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value"):
                dims.append(d.dim_value)
            elif d.dim_param in by_param:
                dims.append(by_param[d.dim_param])
            else:
                if inferred is None:
                    shell = model_shell(model)
                    shell.graph.CopyFrom(g)
                    inferred = infer_tensor_info(shell)
                info = inferred.get(present) if present else None
                size = info.shape[axis] if info is not None and info.shape and len(info.shape) > axis else None
                if isinstance(size, int):
                    dims.append(size)
                elif past is None:
                    past = axis
                    dims.append(capacity.get(name, (0, ""))[0])
                else:
                    raise TrainingSpecError(
                        f"the KV cache input {name!r} has the dims {_shown(tt)}: which is the past length and what "
                        "size the others take is not told by the model",
                        hint=f"feed {name!r} yourself (an empty past, length 0 on its sequence axis)")
        out.append(CacheInput(name, helper.tensor_dtype_to_np_dtype(tt.elem_type), dims,
                              capacity.get(name, (0, ""))[1]))
    for name in derived_inputs(g):
        out.append(PositionInput(name, helper.tensor_dtype_to_np_dtype(declared[name].type.tensor_type.elem_type)))
    return out


@dataclass
class MadeInputs:
    """What a loop makes for a decoder's step unless the batch gives it: ``caches`` (``CacheInput`` and
    ``PositionInput``), ``switches`` (fed False) and ``names``, all of them."""

    caches: list
    switches: list[str]

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.caches] + list(self.switches)

    def fill(self, feeds: dict) -> dict:
        return empty_caches(self.caches, feeds, self.switches)

    def spec(self) -> dict:
        """The JSON form bundle.json keeps as ``made`` (docs/runtimes.md), for a loop without the training model."""
        out: dict = {"caches": [], "switches": list(self.switches)}
        for c in self.caches:
            if isinstance(c, PositionInput):
                out["positions"] = {"name": c.name, "dtype": np.dtype(c.dtype).name, "mask": MASK, "tokens": TOKENS}
            else:
                out["caches"].append({"name": c.name, "dtype": np.dtype(c.dtype).name, "window_node": c.window_node,
                                      "dims": [list(d) if isinstance(d, tuple) else d for d in c.dims]})
        return out

    @classmethod
    def from_spec(cls, spec: dict) -> MadeInputs:
        caches: list = [CacheInput(c["name"], np.dtype(c["dtype"]), [tuple(d) if isinstance(d, list) else d
                                                                     for d in c["dims"]], c.get("window_node", ""))
                        for c in spec.get("caches", [])]
        if spec.get("positions"):
            caches.append(PositionInput(spec["positions"]["name"], np.dtype(spec["positions"]["dtype"])))
        return cls(caches, list(spec.get("switches", [])))


def made_inputs(model: onnx.ModelProto, feeds: list[str]) -> MadeInputs:
    """Of a step's ``feeds`` (input names), what the loop makes for ``model`` (the training model): the empty KV
    cache, the positions and the cache switches."""
    g = model.graph
    switches = cache_switches(g)
    made = set(cache_names(g)[0]) | set(switches) | set(derived_inputs(g))
    if not any(f in made for f in feeds):
        return MadeInputs([], [])
    caches = [c for c in cache_inputs(model, [f for f in feeds if f not in made]) if c.name in feeds]
    return MadeInputs(caches, [s for s in switches if s in feeds])


def _shown(tt) -> str:
    return "[" + ", ".join(d.dim_param or str(d.dim_value) for d in tt.shape.dim) + "]"


def empty_caches(caches: list[CacheInput | PositionInput], feeds: dict, switches: list[str] = ()) -> dict:
    """``feeds`` with an empty array for each cache input it does not hold (and the positions of
    ``PositionInput``), and False for each cache switch
    (``cache_switches``: a merged decoder's ``use_cache_branch``) it does not hold (the same dict when none is
    missing)."""
    missing = [c for c in caches if c.name not in feeds]
    off = [s for s in switches if s not in feeds]
    if not missing and not off:
        return feeds
    return {**feeds, **{c.name: c.empty(feeds) for c in missing}, **{s: np.array([False]) for s in off}}


def cache_switches(graph: onnx.GraphProto) -> list[str]:
    """The boolean graph inputs an ``If`` branches on directly: a merged decoder's ``use_cache_branch`` (Optimum's
    ``decoder_model_merged.onnx``), which training feeds False (a whole sequence, no cache) unless given."""
    inputs = {i.name for i in graph.input if i.type.tensor_type.elem_type == TensorProto.BOOL}
    return sorted({n.input[0] for n in graph.node if n.op_type == "If" and n.input and n.input[0] in inputs})


__all__ = ["ATTENTION_PAST", "CacheInput", "MadeInputs", "PositionInput", "cache_inputs", "cache_names",
           "cache_switches", "derived_inputs", "empty_caches", "made_inputs"]
