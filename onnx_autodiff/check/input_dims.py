"""Sizes of a model's symbolic input dims that its own shapes allow, for the inputs ``check`` and ``gradcheck`` make.

A name says little of an image's dims (``num_channels``, ``height``, ``width``): sized by name they would be 2, and a
patch embedding's Conv of weight [64, 3, 8, 8] refuses a [2, 2, 2, 2] input. The graph says more: a Conv reading the
input (directly or through elementwise ops) fixes its channel dim (the weight's input channels times ``group``), and
its kernel, stride, dilation and pads give the spatial sizes it takes (the kernel's extent, then steps of the
stride). Which of those the rest of the model takes (a ViT's position embeddings fix the count of patches) the graph
tells only by running: ``fitted_dims`` runs the model on the sizes of that ladder, smallest first, and keeps the
first it runs on (the smallest when none runs: the check then says what failed). Sizes given by the user
(``--dim NAME=N``) are taken as they are.

``probe_feeds`` is the one place the checks make a batch as the training driver feeds it: ``check`` (gradcheck of a
decoder reading its past through an attention op) and ``check --target`` (the probe step or model run on each
runtime) take its feeds, so a check never runs the model on inputs the run would not give it.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper

from ..driver.kv_cache import cache_inputs, cache_names, cache_switches, derived_inputs, empty_caches
from ..graph import infer_tensor_info
from .llm_files import check_feeds

# ops whose output keeps the layout of their (first) input: a Conv behind them reads the graph input's dims
_KEEPS_LAYOUT = {"Cast", "Identity", "Sub", "Div", "Mul", "Add", "Relu", "Clip", "Sigmoid", "Tanh"}
TRIES = 32  # sizes of a ladder tried before the names' sizes are kept


def _conv_readers(model: onnx.ModelProto) -> list[tuple[onnx.ValueInfoProto, onnx.NodeProto]]:
    """(graph input, Conv node) for each Conv whose data input is a graph input, through layout-keeping ops."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input[:1]:
            readers.setdefault(i, []).append(n)
    inits = {t.name for t in model.graph.initializer}
    found = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        todo, seen = [vi.name], set()
        while todo:
            t = todo.pop()
            if t in seen:
                continue
            seen.add(t)
            for n in readers.get(t, []):
                if n.op_type == "Conv" and n.domain in ("", "ai.onnx"):
                    found.append((vi, n))
                elif n.op_type in _KEEPS_LAYOUT and n.output:
                    todo.append(n.output[0])
    return found


def _weight_shape(model: onnx.ModelProto, name: str, info) -> list[int] | None:
    for t in model.graph.initializer:
        if t.name == name:
            return list(t.dims)
    i = info.get(name)
    return list(i.shape) if i is not None and i.shape and all(isinstance(d, int) for d in i.shape) else None


def conv_dims(model: onnx.ModelProto) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
    """``({channel dim: size}, {spatial dim: (smallest size, step)})`` of the symbolic dims of graph inputs that a
    Conv reads (module docstring)."""
    channels: dict[str, int] = {}
    ladders: dict[str, tuple[int, int]] = {}
    info = None
    for vi, conv in _conv_readers(model):
        info = info if info is not None else infer_tensor_info(model)
        w = _weight_shape(model, conv.input[1], info)
        dims = vi.type.tensor_type.shape.dim
        if w is None or len(dims) != len(w):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in conv.attribute}
        spatial = len(w) - 2
        if dims[1].dim_param:
            channels.setdefault(dims[1].dim_param, w[1] * int(attrs.get("group", 1)))
        strides = attrs.get("strides") or [1] * spatial
        dilations = attrs.get("dilations") or [1] * spatial
        pads = attrs.get("pads") or [0] * (2 * spatial)
        for k in range(spatial):
            name = dims[2 + k].dim_param
            if not name:
                continue
            extent = (w[2 + k] - 1) * dilations[k] + 1
            first = max(extent - pads[k] - pads[k + spatial], 1)
            ladders.setdefault(name, (first, int(strides[k])))
    return channels, ladders


def _runner(model: onnx.ModelProto):
    """``run(feeds)`` of ``model``: onnxruntime (quiet: a size it refuses is an answer here), else onnx.reference."""
    try:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 4
        sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return lambda feeds: sess.run(None, feeds)
    except Exception:  # onnxruntime raises several unrelated types; the reference evaluator takes what it lacks
        from ..runtimes.reference_ops import Float64Evaluator

        ev = Float64Evaluator(model)
        return lambda feeds: ev.run(None, feeds)


def fitted_dims(model: onnx.ModelProto, given: Mapping[str, int] | None = None, seed: int = 0) -> dict[str, int]:
    """Sizes of ``model``'s symbolic input dims from its graph, ``given`` over them (module docstring); dims the
    graph says nothing of are left out (``check_feeds`` sizes them by name)."""
    channels, ladders = conv_dims(model)
    sizes = {**channels, **dict(given or {})}
    ladders = {n: ladder for n, ladder in ladders.items() if n not in sizes}
    if not ladders:
        return sizes
    smallest = {**sizes, **{n: first for n, (first, _) in ladders.items()}}
    try:
        run = _runner(model)
    except Exception:  # neither evaluator loads it: the check says why
        return smallest
    for step in range(TRIES):
        trial = {**sizes, **{n: first + stride * step for n, (first, stride) in ladders.items()}}
        try:
            run(check_feeds(model, seed, dims=trial))
        except Exception:  # a size the model refuses, whatever raised it
            continue
        return trial
    return smallest


def symbolic_dims(model: onnx.ModelProto) -> set[str]:
    """The names of the symbolic dims of ``model``'s graph inputs."""
    return {d.dim_param for vi in model.graph.input for d in vi.type.tensor_type.shape.dim if d.dim_param}


def _token_rows(model: onnx.ModelProto, feeds: dict) -> dict[str, int]:
    """Integer feed -> the fewest rows of the initializer tables a Gather (or GatherBlockQuantized) indexes by it."""
    inits = {t.name: t for t in model.graph.initializer}
    rows: dict[str, int] = {}
    for n in model.graph.node:
        if n.op_type in ("Gather", "GatherBlockQuantized") and len(n.input) > 1 and n.input[1] in feeds \
                and n.input[0] in inits and feeds[n.input[1]].dtype.kind in "iu":
            axis = next((a.i for a in n.attribute if a.name in ("axis", "gather_axis")), 0)
            dims = inits[n.input[0]].dims
            rows[n.input[1]] = min(rows.get(n.input[1], dims[axis % len(dims)]), dims[axis % len(dims)])
    return rows


def probe_feeds(model: onnx.ModelProto, seed: int = 0, dims: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """One batch for ``model``'s graph inputs as the training driver gives it: the data a user feeds made at
    random (``check_feeds``: symbolic dims as ``dims`` gives them, else by name; masks all ones, an all-zero row
    being no sequence at all), token ids drawn over the vocabulary (the rows of the embedding their Gather reads,
    not {0, 1}: equal tokens make attention blind to its queries and keys), and then what the driver makes itself
    (``driver/kv_cache.py``, the same code ``TrainingSession`` runs): the KV cache empty (a window-sized cache at
    its window's capacity, a head size the model declares symbolically from its present), ``position_ids`` from
    the mask, a merged decoder's ``use_cache_branch`` False. ``model``: the inference model or a training model
    (its main graph)."""
    switches = cache_switches(model.graph)
    feeds = check_feeds(model, seed, past=0, switches={s: False for s in switches}, dims=dict(dims or {}))
    rng = np.random.default_rng(seed)
    for name, count in _token_rows(model, feeds).items():
        feeds[name] = rng.integers(0, count, feeds[name].shape).astype(feeds[name].dtype)
    pasts, _ = cache_names(model.graph)
    if not pasts:
        return feeds
    made = set(pasts) | set(derived_inputs(model.graph))
    data = {k: v for k, v in feeds.items() if k not in made}
    for k, v in data.items():
        if "mask" in k.lower() and v.dtype.kind in "iub":
            data[k] = np.ones_like(v)
    return empty_caches(cache_inputs(model, list(data)), data, switches)


__all__ = ["conv_dims", "fitted_dims", "probe_feeds", "symbolic_dims", "TRIES"]
