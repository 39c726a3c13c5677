"""What a rematerialization plan is made of: tensor sizes, node costs, the min-cut that picks what the
backward keeps, and the estimate of a schedule's peak live bytes.

The step graph is the inference graph followed by the lowered algorithm. Its forward is every node the
loss depends on; every other node is the backward (and the optimizer). A forward tensor that a backward
node reads is an activation: kept alive from the forward to its last reader, unless the backward
recomputes it from other kept tensors. Which to keep is a minimum cut, as PyTorch's partitioner frames
it: every activation is an edge whose capacity is its size; the nodes that may not be recomputed (matrix
products, convolutions, attention, random ops, anything outside the default domain or with a subgraph)
hang from the source, the activations the backward reads hang on the sink, and the cheapest set of edges
that separates them is the set of tensors to keep. Everything between a kept tensor and a reader is
recomputed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import onnx
from onnx import helper

from ..errors import MemoryBudgetError
from ..graph import TensorInfo, infer_tensor_info, node_inputs, normalize_domain
from .training import combined_model

# Ops the backward may recompute, in two tiers: tier 1 is elementwise and layout work (one pass over the
# data), tier 2 adds normalizations, reductions and softmax (a few passes). Everything else is kept:
# MatMul, Gemm, Conv, ConvTranspose, Einsum, attention, Dropout and random ops are never in these lists.
TIER1 = frozenset("""Abs Add And Cast CastLike Ceil Clip Concat Cos Div Elu Equal Erf Exp Expand Flatten Floor Gelu
    Greater GreaterOrEqual HardSigmoid HardSwish Identity IsInf IsNaN LeakyRelu Less LessOrEqual Log Max Min Mish
    Mul Neg Not Or Pow PRelu Reciprocal Relu Reshape Selu Shape Sigmoid Sign Sin Size Slice Softplus Softsign
    Sqrt Squeeze Sub Tanh Transpose Unsqueeze Where Xor Gather Split""".split())
TIER2 = TIER1 | frozenset("""LayerNormalization Softmax LogSoftmax ReduceMean ReduceSum ReduceMax ReduceMin
    ReduceL2 ReduceSumSquare InstanceNormalization GroupNormalization AveragePool GlobalAveragePool
    GlobalMaxPool Pad""".split())
_PASSES = {"LayerNormalization": 5, "Softmax": 4, "LogSoftmax": 4, "InstanceNormalization": 5,
           "GroupNormalization": 5, "Erf": 4, "Gelu": 6, "Tanh": 3, "Exp": 2, "Pow": 3}


@dataclass
class StepGraph:
    """The step graph seen by the planner: nodes in order (the inference graph's, then the algorithm's),
    which are forward, and tensor sizes."""
    nodes: list[onnx.NodeProto]
    forward: list[int]  # indices into ``nodes`` of the nodes the loss depends on
    producer: dict[str, int]
    info: dict[str, TensorInfo]
    permanent: set[str]  # graph inputs, initializers, graph outputs: alive for the whole step
    activations: list[str] = field(default_factory=list)  # forward tensors a backward node reads
    in_place: set[str] = field(default_factory=set)  # outputs written into their state tensor (update_binding)
    held: set[str] = field(default_factory=set)  # gradients: a session writes them into buffers it keeps

    def nbytes(self, name: str) -> int:
        """Bytes of a tensor, 0 when its type or shape is not known."""
        t = self.info.get(name)
        if t is None or t.dtype is None or t.shape is None or not all(isinstance(d, int) for d in t.shape):
            return 0
        return math.prod(t.shape) * helper.tensor_dtype_to_np_dtype(t.dtype).itemsize

    def elements(self, name: str) -> int:
        t = self.info.get(name)
        if t is None or t.shape is None or not all(isinstance(d, int) for d in t.shape):
            return 0
        return math.prod(t.shape)


def recomputable(node: onnx.NodeProto, tier: int) -> bool:
    """Whether a forward node may run again in the backward (pure, cheap, standard, no subgraph)."""
    if normalize_domain(node.domain) != "" or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                                  for a in node.attribute):
        return False
    return node.op_type in (TIER1 if tier == 1 else TIER2)


def node_flops(step: StepGraph, node: onnx.NodeProto) -> int:
    """A rough floating-point operation count: 2MNK for products, one or a few per output element else."""
    outs = sum(step.elements(o) for o in node.output if o)
    ins = node_inputs(node)
    if node.op_type in ("MatMul", "Gemm") and ins:
        a = step.info.get(ins[0])
        k = a.shape[-1] if a is not None and a.shape and isinstance(a.shape[-1], int) else 1
        if node.op_type == "Gemm" and a is not None and a.shape and any(
                at.name == "transA" and at.i for at in node.attribute) and isinstance(a.shape[0], int):
            k = a.shape[0]
        return 2 * outs * k
    if node.op_type in ("Conv", "ConvTranspose") and len(ins) > 1:
        w = step.info.get(ins[1])
        per = math.prod(w.shape[1:]) if w is not None and w.shape and all(isinstance(d, int) for d in w.shape) else 1
        return 2 * max(outs, sum(step.elements(x) for x in ins[:1])) * per
    return outs * _PASSES.get(node.op_type, 1)


def step_graph(model: onnx.ModelProto, alg: onnx.GraphProto, loss: str, dims: dict[str, int],
               gradients: list[str] = ()) -> StepGraph:
    """The planner's view of inference graph + ``alg``, shapes inferred with ``dims`` for symbolic dims.
    ``gradients``: the Gradient nodes' outputs, which a session keeps in buffers of their own."""
    tmp = combined_model(model, alg)
    _fix_dims(tmp.graph, dims)
    info = infer_tensor_info(tmp)
    nodes = list(tmp.graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    n_inference = len(model.graph.node)  # the inference graph runs whole, the loss part of alg after it
    forward = sorted(set(range(n_inference)) | set(_ancestor_indices(nodes, producer, loss)))
    g = tmp.graph
    permanent = {i.name for i in g.input} | {t.name for t in g.initializer} | {o.name for o in g.output}
    step = StepGraph(nodes, forward, producer, info, permanent)
    binding = next((t.update_binding for t in model.training_info if t.algorithm is alg), [])
    step.in_place = {b.value for b in binding if step.nbytes(b.value) == step.nbytes(b.key)} & permanent
    step.held = set(gradients) & set(producer)
    fwd = set(forward)
    read_back = {x for i, n in enumerate(nodes) if i not in fwd for x in node_inputs(n)}
    step.activations = [o for i in forward for o in nodes[i].output
                        if o and o in read_back and o not in permanent]
    return step


def _fix_dims(graph: onnx.GraphProto, dims: dict[str, int]) -> None:
    """Give the graph inputs' symbolic dims the sizes in ``dims``; a symbolic dim without one is an error."""
    missing = []
    for vi in graph.input:
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") or not d.HasField("dim_value"):
                name = d.dim_param or f"{vi.name}[?]"
                if name in dims:
                    d.dim_value = int(dims[name])
                elif name not in missing:
                    missing.append(name)
    if missing:
        raise MemoryBudgetError(
            f"memory_budget: the input dims {missing} are symbolic, so the activations' sizes are unknown; "
            f"give their sizes, e.g. MemoryBudget(size, dims={{{', '.join(f'{m!r}: 32' for m in missing)}}}) "
            f"(make-training --budget-dim {missing[0]}=32)")


def check_dims(inputs, dims: dict[str, int]) -> None:
    """MemoryBudgetError when an input (ValueInfoProto) of a budgeted step has a symbolic dim ``dims`` lacks."""
    g = onnx.GraphProto()
    g.input.extend(inputs)
    _fix_dims(g, dims)


def _ancestor_indices(nodes, producer: dict[str, int], of: str) -> list[int]:
    keep: set[int] = set()
    stack = [of]
    while stack:
        i = producer.get(stack.pop())
        if i is None or i in keep:
            continue
        keep.add(i)
        stack.extend(node_inputs(nodes[i]))
    return sorted(keep)


def min_cut_keep(step: StepGraph, tier: int, targets: set[str]) -> set[str]:
    """The activations to keep so the backward can recompute ``targets`` from them at the least kept bytes
    (activations outside ``targets`` are kept anyway, so they cost nothing here)."""
    nx = networkx_module()
    fwd = set(step.forward)
    order = {o: k for k, i in enumerate(step.forward) for o in step.nodes[i].output if o}
    span = max(len(order), 1)
    g = nx.DiGraph()
    for i in step.forward:
        node = step.nodes[i]
        for t in (o for o in node.output if o and o not in step.permanent):
            paid = t in step.activations and t not in targets
            # on ties, keep the later tensor: fewer nodes to run again
            cost = 0.0 if paid else step.nbytes(t) * (1.0 + 1e-3 * (span - order[t]) / span)
            g.add_edge((t, "in"), (t, "out"), capacity=cost)
            if not recomputable(node, tier):
                g.add_edge("source", (t, "in"))
            for x in node_inputs(node):
                if x not in step.permanent and step.producer.get(x) in fwd:
                    g.add_edge((x, "out"), (t, "in"))
            if t in targets:
                g.add_edge((t, "out"), "sink")
    if "source" not in g or "sink" not in g:
        return set(step.activations) - set(targets)
    _, (reach, _) = nx.minimum_cut(g, "source", "sink")
    return {v[0] for v in reach if isinstance(v, tuple) and v[1] == "in" and (v[0], "out") not in reach} | (
        set(step.activations) - targets)


def networkx_module():
    try:
        import networkx
    except ImportError as e:
        raise MemoryBudgetError(
            "memory_budget needs networkx, which is not installed: pip install 'onnx-autodiff[remat]'") from e
    return networkx


def recompute_set(step: StepGraph, keep: set[str], tier: int) -> tuple[list[int], set[str]]:
    """The forward nodes the backward runs again (in forward order) and the activations it reads from
    them; an activation that cannot be recomputed from ``keep`` (a random op behind it) is kept instead."""
    fwd = set(step.forward)
    nodes: set[int] = set()
    rebuilt: set[str] = set()
    for t in step.activations:
        if t in keep:
            continue
        chain = _chain(step, t, keep, fwd, tier)
        if chain is None:
            keep.add(t)
            continue
        nodes |= chain
        rebuilt.add(t)
    return sorted(nodes), rebuilt


def _chain(step: StepGraph, t: str, keep: set[str], fwd: set[int], tier: int) -> set[int] | None:
    chain: set[int] = set()
    stack = [t]
    while stack:
        x = stack.pop()
        i = step.producer.get(x)
        if x in step.permanent or (x in keep and x != t) or i is None or i not in fwd or i in chain:
            continue
        if not recomputable(step.nodes[i], tier):
            return None
        chain.add(i)
        stack.extend(node_inputs(step.nodes[i]))
    return chain


def peak_bytes(step: StepGraph, nodes: list[onnx.NodeProto], outputs: set[str]) -> int:
    """Peak bytes a session holds running ``nodes`` in this order, as ``TrainingSession`` runs a step:
    graph inputs and initializers throughout; an update written into its state tensor (``in_place``) in the
    same memory; the gradients (``held``) in buffers kept from the first step on; every other tensor from
    the node that makes it to its last reader (a graph output to the end). Not counted: the process itself
    (``_apply`` adds what it holds) and the arena's rounding (a few MB)."""
    last: dict[str, int] = {}
    for k, n in enumerate(nodes):
        for x in node_inputs(n):
            last[x] = k
    size = step.nbytes
    fixed = (step.permanent - step.in_place) | step.held
    live = sum(size(x) for x in fixed)
    peak = live
    for k, n in enumerate(nodes):
        made = [o for o in n.output if o and o not in fixed and o not in step.in_place]
        live += sum(size(o) for o in made)
        peak = max(peak, live)
        for x in set(node_inputs(n)) | set(made):
            if x not in fixed and x not in step.in_place and x not in outputs and last.get(x, -1) <= k:
                live -= size(x)
    return peak
