"""LoRA: low-rank adapters beside the weights of chosen MatMul / Gemm nodes, as a graph rewrite.

For a node ``y = x W`` (MatMul; Gemm adds its bias) the rewrite renames the node's output to
``<y>/lora_base`` and adds ``y = <y>/lora_base + (dropout(x) A^T B^T) * alpha / rank``, with adapters
``<W>.lora_A`` [rank, in] and ``<W>.lora_B`` [out, rank] (PEFT's shapes, so values move to and from PEFT
by name). A starts Kaiming-uniform with a = sqrt(5) (uniform in +-1/sqrt(in)), B at zero, as PEFT does, so
the rewritten model computes what the original did. What the rewrite did is recorded in the model's
``metadata_props[metadata.LORA]`` (JSON): ``merge_lora`` folds the adapters back into the weights
for plain inference, and ``adapters.py`` writes them out for PEFT or onnxruntime.

Targets match a node's name, its weight's name or its module path (PyTorch's ``q_proj``): the dynamo
exporter names weights ``val_N`` and folds nn.Linear's transpose into them, but keeps the module path in
the node's ``pkg.torch.onnx.name_scopes`` metadata; the TorchScript exporter keeps it in the weight name
(``model.layers.0.self_attn.q_proj.weight``), onnxruntime-genai's model builder too
(``model.layers.0.attn.qkv_proj.MatMul.weight``, ``...MatMul.weight_Q4``). A target is a glob, a name's
last dotted part(s), or a preset of ``PRESETS`` (``attention``, ``mlp``, ``all``).
"""
from __future__ import annotations

import ast
import fnmatch
import json
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ...errors import TrainingBuilderError
from ...graph import FLOAT_TYPES, Nested, nested_graphs, used_names
from ...model import metadata
from ...model.weights import is_detached, placeholder
from ..nodes import GraphBuilder
from .merge import MergedWeights, lora_delta, lora_inference, lora_record, merge_lora
from .quantized import BASE_BACKWARDS, add_int8_backward, quantized_candidate

NAME_SCOPES = "pkg.torch.onnx.name_scopes"
_log = logging.getLogger("onnx_autodiff")
# onnxruntime-genai's model builder names a layer's weight <module>.MatMul.weight (fp32) or
# <module>.MatMul.weight_Q4 (int4): the module is what precedes the op's name
_BUILDER_WEIGHT = re.compile(r"^(?P<module>.+?)(\.(MatMul|Gemm))?\.weight(_Q\d+|_quantized)?$")
# targets=["attention"|"mlp"|"all"]: the projections as the families name them (the model builder's Llama,
# Qwen2, Phi-3 and Mistral; Hugging Face exports of those; GPT-2's Conv1D layers; OPT/Phi-2's fc1/fc2).
# "all" leaves the output layer (lm_head) out, as PEFT's all-linear does
PRESETS = {
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "out_proj", "c_attn", "attn.c_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj", "gate_up_proj", "c_fc", "mlp.c_proj", "fc1", "fc2"],
}
PRESETS["all"] = PRESETS["attention"] + PRESETS["mlp"]


@dataclass
class LoraTarget:
    """One adapted weight. ``layout``: ``in_out`` when the node reads W as [in, out] (MatMul, Gemm
    transB=0), ``out_in`` when it reads W as [out, in] (Gemm transB=1, MatMul of Transpose(W))."""

    weight: str
    module: str
    node: str
    output: str
    layout: str
    n_in: int
    n_out: int
    gemm_alpha: float = 1.0
    lora_A: str = ""
    lora_B: str = ""
    base_output: str = ""
    nodes: list[str] = field(default_factory=list)
    quant: str = ""  # "nbits", "dequantize_linear" or "dynamic" for a quantized weight (quantized.py)
    dtype: int = 0  # the float type of the layer (the weight's, or a quantized weight's scales')
    input: str = ""  # the layer's input x ("": the node's first input; a dynamic int8 product's is its quantizer's)
    graph: str = ""  # where the node is: "" the main graph, else the path of a subgraph (graph.nested_graphs)
    # the same weight read in the other branch of an If (a merged decoder's two decoders share their weights):
    # one adapter pair, a branch at each site; each site {"graph", "node", "output", "input", "base_output", "nodes"}
    also: list = field(default_factory=list)


def lora_config(spec) -> dict:
    """``{"rank", "alpha", "dropout", "targets", "seed", "base_backward"}`` checked, with PEFT's defaults (alpha 8,
    dropout 0). ``base_backward``: ``"float32"`` (default) or ``"int8"``, the opt-in 8-bit input gradient through
    the frozen int4 base (``quantized.py``)."""
    if not isinstance(spec, Mapping):
        raise TrainingBuilderError("lora", f"expected a dict such as {{'rank': 8, 'alpha': 16, 'targets': "
                                           f"['q_proj', 'v_proj']}}, got {type(spec).__name__}")
    unknown = sorted(set(spec) - {"rank", "alpha", "dropout", "targets", "seed", "base_backward"})
    if unknown:
        raise TrainingBuilderError("lora", f"unknown keys {unknown}; the keys are rank, alpha, dropout, targets, seed, "
                                           "base_backward")
    base_backward = spec.get("base_backward", "float32")
    if base_backward not in BASE_BACKWARDS:
        raise TrainingBuilderError("lora", f"base_backward must be one of {', '.join(BASE_BACKWARDS)}, got "
                                           f"{base_backward!r}")
    rank, alpha, dropout = spec.get("rank", 8), spec.get("alpha", 8), spec.get("dropout", 0.0)
    if not isinstance(rank, int) or rank < 1:
        raise TrainingBuilderError("lora", f"rank must be a positive int, got {rank!r}")
    if not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise TrainingBuilderError("lora", f"alpha must be a finite number, got {alpha!r}")
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise TrainingBuilderError("lora", f"dropout must be in [0, 1), got {dropout!r}")
    targets = spec.get("targets")
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise TrainingBuilderError("lora", "targets: name the layers to adapt, e.g. ['q_proj', 'v_proj'] "
                                           "(node names, weight names or module paths; globs allowed; or a "
                                           "preset: attention, mlp, all)")
    targets = list(dict.fromkeys(p for t in targets for p in PRESETS.get(t, [t])))
    return {"rank": rank, "alpha": float(alpha), "dropout": float(dropout), "targets": list(targets),
            "seed": int(spec.get("seed", 0)), "base_backward": base_backward}


def _scopes(node: onnx.NodeProto) -> list[str]:
    for p in node.metadata_props:
        if p.key == NAME_SCOPES:
            try:
                value = ast.literal_eval(p.value)
            except (ValueError, SyntaxError):
                return []
            return [str(v) for v in value] if isinstance(value, (list, tuple)) else []
    return []


def module_path(node: onnx.NodeProto, weight: str) -> str:
    """The PyTorch module a MatMul/Gemm came from: the dynamo exporter's name scopes (the last scope is the
    op itself), else the weight's name less ``.weight`` (and less the model builder's ``.MatMul``, or its
    ``.weight_Q4``), else the node name's path (``/a/b/MatMul`` -> a.b)."""
    scopes = [s for s in _scopes(node)[:-1] if s]
    if scopes:
        return scopes[-1]
    named = _BUILDER_WEIGHT.match(weight)
    if named:
        return named.group("module")
    parts = [p for p in node.name.split("/") if p]
    return ".".join(parts[:-1]) if len(parts) > 1 else node.name


def _matches(pattern: str, names: list[str]) -> bool:
    for name in names:
        if name and (fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}")
                     or fnmatch.fnmatchcase(name, f"*/{pattern}")):
            return True
    return False


# Hugging Face's fused projections that the model builder splits (Phi-3's gate_up_proj; qkv_proj with
# fuse_qkv=false): the fused name is a target for each part, the name Phi users know
_SPLIT_BY_BUILDER = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "q_proj": "qkv_proj",
                     "k_proj": "qkv_proj", "v_proj": "qkv_proj"}


def _fused_names(module: str, weight: str) -> list[str]:
    """``model.layers.0.mlp.gate_up_proj`` for the builder's ``model.layers.0.mlp.gate_proj`` (its weight
    ``<module>.MatMul.weight...``), else none."""
    stem, _, last = module.rpartition(".")
    if last in _SPLIT_BY_BUILDER and weight.startswith(f"{module}.MatMul.weight"):
        return [f"{stem}.{_SPLIT_BY_BUILDER[last]}" if stem else _SPLIT_BY_BUILDER[last]]
    return []


def _candidate(node: onnx.NodeProto, inits: dict, producers: dict) -> tuple[str, str] | None:
    """(weight, layout) when ``node`` is a MatMul/Gemm whose B is a rank-2 float initializer (or its
    Transpose for MatMul), else None."""
    if node.domain not in ("", "ai.onnx") or len(node.input) < 2:
        return None
    b = node.input[1]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Gemm":
        if attrs.get("transA", 0):
            return None
        layout = "out_in" if attrs.get("transB", 0) else "in_out"
    elif node.op_type == "MatMul":
        layout = "in_out"
        src = producers.get(b)
        if b not in inits and src is not None and src.op_type == "Transpose" and src.input[0] in inits:
            perm = [a for a in src.attribute if a.name == "perm"]
            if perm and list(perm[0].ints) == [1, 0]:
                b, layout = src.input[0], "out_in"
    else:
        return None
    t = inits.get(b)
    if t is None or t.data_type not in FLOAT_TYPES or len(t.dims) != 2:
        return None
    return b, layout


def _target(n: onnx.NodeProto, inits: dict, hit, quant, module: str) -> LoraTarget:
    if quant is not None:
        weight, kind, n_in, n_out, dtype, x = quant
        return LoraTarget(weight, module, n.name, n.output[0], "out_in" if kind == "nbits" else "in_out",
                          n_in, n_out, quant=kind, dtype=dtype, input=x)
    weight, layout = hit
    dims = list(inits[weight].dims)
    n_in, n_out = (dims[0], dims[1]) if layout == "in_out" else (dims[1], dims[0])
    alpha = next((a.f for a in n.attribute if a.name == "alpha"), 1.0) if n.op_type == "Gemm" else 1.0
    return LoraTarget(weight, module, n.name, n.output[0], layout, n_in, n_out, alpha,
                      dtype=inits[weight].data_type)


def _exclusive(a: Nested, b: Nested) -> bool:
    """Whether two graphs are different branches of one If (at most one of them runs)."""
    return (a.owner is not None and a.owner is b.owner and a.owner.op_type == "If"
            and a.attribute != b.attribute)


def find_targets(model: onnx.ModelProto, patterns: list[str]) -> list[LoraTarget]:
    """Every MatMul/Gemm (or quantized product) with a weight initializer that some pattern matches, in the main
    graph and in its subgraphs (a merged decoder's If branches, which read the weights of the main graph). A weight
    read in both branches of an If is one target with a site in each (``LoraTarget.also``)."""
    outer = {t.name: t for t in model.graph.initializer}
    found, seen, candidates = [], {}, []
    nested = list(nested_graphs(model.graph))
    for place in nested:
        g = place.graph
        inits = outer if not place.path else {**outer, **{t.name: t for t in g.initializer}}
        producers = {o: n for n in g.node for o in n.output}
        for n in g.node:
            hit = _candidate(n, inits, producers)
            quant = None if hit is not None else quantized_candidate(n, inits, producers)
            if hit is None and quant is None:
                continue
            weight = hit[0] if hit is not None else quant[0]
            module = module_path(n, weight)
            candidates.append(module)
            if not any(_matches(p, [n.name, weight, module, *_fused_names(module, weight)]) for p in patterns):
                continue
            target = _target(n, inits, hit, quant, module)
            target.graph = place.path
            if weight in seen:
                first, places = seen[weight]
                if all(_exclusive(place, other) for other in places) and target.layout == first.layout:
                    first.also.append({"graph": place.path, "node": n.name, "output": n.output[0],
                                       "input": target.input})
                    places.append(place)
                    continue
                raise TrainingBuilderError("lora", f"weight {weight!r} is read by nodes {first.node!r} and {n.name!r}; "
                                                   "adapting a shared weight is not supported: target one module")
            seen[weight] = (target, [place])
            found.append(target)
    if not found:
        shown = ", ".join(list(dict.fromkeys(candidates))[:8])
        raise TrainingBuilderError("lora", f"targets {patterns} match no MatMul/Gemm with a weight initializer; "
                                           f"the model's candidates include: {shown or 'none'}")
    return found


def kaiming_uniform_a(rank: int, n_in: int, dtype, rng: np.random.Generator) -> np.ndarray:
    """PEFT's lora_A init (kaiming_uniform_, a = sqrt(5)): uniform in +-1/sqrt(fan_in)."""
    bound = 1.0 / math.sqrt(n_in)
    return rng.uniform(-bound, bound, size=(rank, n_in)).astype(dtype)


def _emit_branch(b: GraphBuilder, node: onnx.NodeProto, t: LoraTarget, x: str, cfg: dict, dtype: int
                 ) -> tuple[str, list[onnx.NodeProto]]:
    """Rename the node's output and add the adapter branch that writes the old name; returns the new name of the
    node's output and the branch's nodes."""
    first = len(b.nodes)
    output = node.output[0]
    base = b.name(f"{output}/lora_base")
    node.output[0] = base
    g = b.under(f"lora/{t.weight}")
    if cfg["dropout"] > 0:
        ratio = g.initializer(cfg["dropout"], TensorProto.FLOAT, "dropout_ratio")
        on = g.initializer(True, TensorProto.BOOL, "training_mode")
        x = g.Dropout(x, ratio, on)
    a_t = g.Transpose(t.lora_A, perm=[1, 0])
    b_t = g.Transpose(t.lora_B, perm=[1, 0])
    d = g.MatMul(g.MatMul(x, a_t), b_t)
    ds = g.Mul(d, g.initializer(cfg["alpha"] / cfg["rank"], dtype, "scale"))
    g.Add(base, ds, outputs=[output])
    return base, b.nodes[first:]


def add_lora(model: onnx.ModelProto, spec, arrays: Mapping, store: dict, family: str | None = None) -> list[str]:
    """Rewrite ``model`` (in place) with adapters on the targets of ``spec`` (see the module docstring);
    the adapters' arrays go to ``store``, their placeholders to the graph. Returns the adapter names,
    A then B per target. ``arrays``: the values of detached initializers (unused; shapes come from dims).
    ``family``: a model builder's model's family (genai_config.json's model.type), recorded for PEFT export."""
    cfg = lora_config(spec)
    if lora_record(model) is not None:
        raise TrainingBuilderError("lora", "the model already has LoRA adapters (metadata onnx_autodiff.lora)")
    targets = find_targets(model, cfg["targets"])
    g = model.graph
    graphs = {place.path: place.graph for place in nested_graphs(g)}
    b = GraphBuilder(used_names(model), "")
    rng = np.random.default_rng(cfg["seed"])
    names = []
    branches: dict[str, dict[str, list[onnx.NodeProto]]] = {}
    for t in targets:
        dtype = t.dtype
        np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
        t.lora_A, t.lora_B = b.name(f"{t.weight}.lora_A"), b.name(f"{t.weight}.lora_B")
        for name, arr in ((t.lora_A, kaiming_uniform_a(cfg["rank"], t.n_in, np_dtype, rng)),
                          (t.lora_B, np.zeros((t.n_out, cfg["rank"]), np_dtype))):
            store[name] = arr
            g.initializer.append(placeholder(name, arr))
            names.append(name)
        for site in [None] + t.also:
            path = t.graph if site is None else site["graph"]
            node = next(n for n in graphs[path].node if n.name == (t.node if site is None else site["node"]))
            x = (t.input if site is None else site["input"]) or node.input[0]
            base, nodes = _emit_branch(b, node, t, x, cfg, dtype)
            branches.setdefault(path, {})[node.name] = nodes
            if site is None:
                t.base_output, t.nodes = base, [n.name for n in nodes]
            else:
                site["base_output"], site["nodes"] = base, [n.name for n in nodes]
    for path, after in branches.items():
        _insert_after(graphs[path], after)
    g.initializer.extend(b.inits)
    record = {k: cfg[k] for k in ("rank", "alpha", "dropout", "targets")} | {"layers": [asdict(t) for t in targets]}
    if cfg["base_backward"] == "int8":
        record["int8_backward"] = _int8_backward(g, names, arrays, store)
    if family:
        record["family"] = family
    metadata.write(model, {metadata.LORA: json.dumps(record)})
    sites = sum(1 + len(t.also) for t in targets)
    _log.info("LoRA rank %d on %d weights (%d sites): %s", cfg["rank"], len(targets), sites,
              ", ".join(t.module for t in targets))
    return names


def _int8_backward(g: onnx.GraphProto, adapters: list[str], arrays: Mapping, store: dict) -> list[str]:
    """``base_backward="int8"``: the int8 weights of the frozen MatMulNBits the backward goes through
    (``quantized.add_int8_backward``); returns their names (dropped again from an inference export)."""
    inits = {t.name: t for t in g.initializer}

    def value(name: str) -> np.ndarray:
        t = inits[name]
        return np.asarray(arrays[name]) if is_detached(t) else numpy_helper.to_array(t)

    before = {t.name for t in g.initializer}
    layers = add_int8_backward(g, adapters, value, store)
    if not layers:
        raise TrainingBuilderError("lora", "base_backward='int8': the backward goes through no float32 MatMulNBits "
                                           "(an int4 base) in this model; leave base_backward out (it applies to "
                                           "int4 models such as onnxruntime-genai's builder makes)")
    _log.info("LoRA base_backward=int8: %d frozen MatMulNBits re-quantized to int8 per column", len(layers))
    return [t.name for t in g.initializer if t.name not in before]


def _insert_after(g: onnx.GraphProto, branch: dict[str, list[onnx.NodeProto]]) -> None:
    """Put each target's branch right after its node, keeping the graph topologically sorted."""
    order = []
    for n in g.node:
        order.append(n)
        order.extend(branch.get(n.name, []))
    del g.node[:]
    g.node.extend(order)


__all__ = ["PRESETS", "LoraTarget", "add_lora", "find_targets", "lora_config", "lora_delta", "lora_inference",
           "lora_record", "merge_lora", "module_path", "MergedWeights"]
