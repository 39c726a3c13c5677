"""The inference form of a model with LoRA adapters (``rewrite.py`` writes them and records
what it did in ``metadata_props[metadata.LORA]``): the adapters merged into their weights, or kept
as graph inputs that default to zero for onnxruntime's adapter files."""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...errors import TrainingBuilderError
from ...graph import nested_graphs, walk_graph
from ...model import metadata
from ...model.weights import is_detached
from .quantized import drop_unread, merge_quantized


def lora_record(model: onnx.ModelProto) -> dict | None:
    """What ``add_lora`` recorded, or None for a model without adapters."""
    return metadata.read_json(model, metadata.LORA)


def lora_delta(layer: dict, record: dict, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The change of the weight as the node reads it: (B @ A)^T for [in, out], B @ A for [out, in], times
    alpha / rank (and over Gemm's alpha, which scales the node's product)."""
    delta = (b @ a) * (record["alpha"] / record["rank"]) / layer.get("gemm_alpha", 1.0)
    return delta.T if layer["layout"] == "in_out" else delta


class MergedWeights(Mapping):
    """A weights mapping whose merged entries replace the base ones; the rest is read through."""

    def __init__(self, base: Mapping, merged: dict):
        self.base, self.merged = base, merged

    def __getitem__(self, name: str) -> np.ndarray:
        return self.merged[name] if name in self.merged else self.base[name]

    def __iter__(self) -> Iterator[str]:
        yield from self.merged
        yield from (k for k in self.base if k not in self.merged)

    def __len__(self) -> int:
        return len(self.merged) + sum(1 for k in self.base if k not in self.merged)


def lora_inference(model: onnx.ModelProto, weights: Mapping, record: dict, adapters: str) -> Mapping:
    """The inference form of a LoRA model (in place; returns its weights): ``merged`` folds the adapters into
    the weights, ``inputs`` keeps the branches and makes the adapters graph inputs that default to zero."""
    if adapters == "merged":
        return merge_lora(model, weights, record)
    if adapters != "inputs":
        raise TrainingBuilderError("adapters", f"'merged' or 'inputs', got {adapters!r}")
    g = model.graph
    names = {layer[k] for layer in record["layers"] for k in ("lora_A", "lora_B")}
    for t in g.initializer:
        if t.name in names:
            arr = np.zeros(list(t.dims), helper.tensor_dtype_to_np_dtype(t.data_type))
            t.CopyFrom(numpy_helper.from_array(arr, t.name))
            g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    _drop_branch_dropout(model, record)
    return weights


def _drop_branch_dropout(model: onnx.ModelProto, record: dict) -> None:
    """The adapters' Dropout (training only: at inference it passes its input through) out of each branch, with
    the ratio and training-mode constants only it read, which onnxruntime would warn about at load."""
    graphs = {place.path: place.graph for place in nested_graphs(model.graph)}
    for layer in record["layers"]:
        for site in _sites(layer):
            sg = graphs[site.get("graph", "")]
            branch = set(site["nodes"])
            for n in [n for n in sg.node if n.name in branch and n.op_type == "Dropout"]:
                for other in sg.node:
                    other.input[:] = [n.input[0] if i == n.output[0] else i for i in other.input]
                sg.node.remove(n)
    _drop_unused(model.graph, set(record.get("int8_backward", [])))  # base_backward="int8"'s training-only weights


def _sites(layer: dict) -> list[dict]:
    """The layer's sites: its node (in the main graph or a subgraph) and the ones in other If branches."""
    return [layer] + [{**layer, **site} for site in layer.get("also", [])]


def merge_lora(model: onnx.ModelProto, weights: Mapping, record: dict | None = None) -> Mapping:
    """Fold the adapters into their weights (W + delta) and drop the branches, in place on the graph of
    (light) ``model`` and its subgraphs; returns the weights mapping with the merged arrays. A model without
    adapters is left as it is."""
    record = record or lora_record(model)
    if record is None:
        return weights
    g = model.graph
    graphs = {place.path: place.graph for place in nested_graphs(g)}
    inits = {t.name: t for t in g.initializer}

    def value(name):
        t = inits[name]
        return np.asarray(weights[name]) if is_detached(t) else numpy_helper.to_array(t)

    merged = {}
    drop_nodes: dict[str, set[str]] = {}
    drop_inits, quantized = set(record.get("int8_backward", [])), set()  # base_backward="int8": training only
    for layer in record["layers"]:
        delta = lora_delta(layer, record, value(layer["lora_A"]).astype(np.float64),
                           value(layer["lora_B"]).astype(np.float64))
        drop_inits.update((layer["lora_A"], layer["lora_B"]))
        if not layer.get("quant"):
            w = value(layer["weight"])
            new = (w.astype(np.float64) + delta).astype(w.dtype)
            t = inits[layer["weight"]]
            if is_detached(t):
                merged[layer["weight"]] = new
            else:
                t.CopyFrom(numpy_helper.from_array(new, t.name))
        for site in _sites(layer):
            sg = graphs[site.get("graph", "")]
            dropped = drop_nodes.setdefault(site.get("graph", ""), set())
            dropped.update(site["nodes"])
            if layer.get("quant"):  # a quantized base: the layer becomes a float MatMul of dequant(W) + delta
                dropped.update(merge_quantized(sg, site, delta, value, is_detached(inits[layer["weight"]]), merged))
                quantized.update(i for n in sg.node if n.name in dropped for i in n.input)
                continue
            for n in sg.node:
                if n.output and n.output[0] == site["base_output"]:  # names may have changed since (name_nodes)
                    n.output[0] = site["output"]
    for path, names in drop_nodes.items():
        sg = graphs[path]
        keep = [n for n in sg.node if n.name not in names]
        del sg.node[:]
        sg.node.extend(keep)
    _drop_unused(g, drop_inits)
    for sg in graphs.values():
        drop_unread(sg, quantized - drop_inits)
    props = [p for p in model.metadata_props if p.key != metadata.LORA]
    del model.metadata_props[:]
    model.metadata_props.extend(props)
    return MergedWeights(weights, merged)


def _drop_unused(g: onnx.GraphProto, adapters: set[str]) -> None:
    """Remove the adapters and the branch constants nothing reads any more (in ``g`` or its subgraphs)."""
    read = {i for sg in walk_graph(g) for n in sg.node for i in n.input} | {o.name for o in g.output}
    keep = [t for t in g.initializer if t.name in read or (t.name not in adapters and "lora/" not in t.name)]
    del g.initializer[:]
    g.initializer.extend(keep)
    inputs = [i for i in g.input if i.name in read or i.name not in adapters]
    del g.input[:]
    g.input.extend(inputs)


__all__ = ["MergedWeights", "lora_delta", "lora_inference", "lora_record", "merge_lora"]
