"""Lower the graphs of every TrainingInfoProto: GraphCall, then Gradient, then optimizer ops.

The released spec runs ``algorithm`` concatenated with the inference graph, so a Gradient in the
algorithm may name tensors of the inference graph (its initializers, inputs and intermediate values).
Each algorithm is therefore lowered on a temporary model whose graph is that concatenation; the nodes
that were not in the inference graph go back into ``algorithm``. The inference graph's nodes keep their
results; one of them only gains an optional output when the backward reads it (the mask of a
training-mode Dropout, which must be the forward's own random draw).
"""
from __future__ import annotations

import onnx

from ..engine.cleanup import cleanup, merges_into
from ..engine.peephole_cnn import max_pool_indices_from_forward
from ..errors import TrainingSpecError
from ..graph import TRAINING_DOMAINS, fresh_name, model_shell, set_nodes, walk_graph
from .context import LoweringContext
from .gradient import lower_gradients
from .graphcall import inline_graph_calls
from .optimizers import lower_optimizers


def combined_model(model: onnx.ModelProto, graph: onnx.GraphProto, with_inference: bool = True) -> onnx.ModelProto:
    """A model without training_info whose graph is the inference graph followed by ``graph``."""
    m = model_shell(model)
    g = m.graph
    g.name = graph.name or model.graph.name
    parts = [model.graph, graph] if with_inference else [graph]
    seen_out: set[str] = set()
    for part in parts:
        g.node.extend(part.node)
        g.input.extend(part.input)
        g.initializer.extend(part.initializer)
        g.sparse_initializer.extend(part.sparse_initializer)
        g.value_info.extend(part.value_info)
        for o in part.output:
            if o.name not in seen_out:
                seen_out.add(o.name)
                g.output.append(o)
    return m


def _keep_names(ti: onnx.TrainingInfoProto) -> set[str]:
    names = {o.name for o in ti.algorithm.output}
    for b in list(ti.update_binding):
        names.update((b.key, b.value))
    return names


def lower_algorithm(model: onnx.ModelProto, index: int, ctx: LoweringContext) -> bool:
    """Lower the Gradient and optimizer nodes of ``model.training_info[index].algorithm`` in place."""
    ti = model.training_info[index]
    alg = ti.algorithm
    if not any(n.domain in TRAINING_DOMAINS for n in alg.node):
        return False
    inference_nodes = {n.name: n for n in model.graph.node}
    own = {n.name for n in alg.node}
    # each Gradient output keeps its name, also where two are the same expression (else the clean-up merges
    # them and TrainingSession.gradients() has no entry for the second parameter)
    gradients = {o for n in alg.node if n.op_type == "Gradient" and n.domain in TRAINING_DOMAINS for o in n.output if o}
    tmp = combined_model(model, alg)
    sub = ctx.fork()
    lower_gradients(tmp, sub)
    optimized = lower_optimizers(tmp, sub)
    pooled = max_pool_indices_from_forward(tmp.graph, set(inference_nodes))
    nodes = tmp.graph.node[:]
    names = [n.name for n in nodes]  # read once for the four uses below
    sub.added |= {m for m in names if m not in inference_nodes and m not in own}
    for n, m in zip(nodes, names):  # an output the backward reads that preparation named (a Dropout's mask)
        forward = inference_nodes.get(m)
        if forward is not None and len(n.output) > len(forward.output) and list(n.input) == list(forward.input):
            del forward.output[:]
            forward.output.extend(n.output)
    for o in tmp.opset_import:
        if not any(p.domain == o.domain for p in model.opset_import):
            model.opset_import.append(o)
    kept = [k for k, m in enumerate(names) if m not in inference_nodes]
    set_nodes(alg, [nodes[k] for k in kept])
    renamed = _recomputed_apart(alg, model.graph, sub)
    ctx.added |= sub.added
    if optimized or pooled or renamed or not _already_clean(alg, [names[k] for k in kept], sub):
        cleanup(alg, sub.added, _keep_names(ti) | gradients)
    return True


def _already_clean(alg: onnx.GraphProto, alg_names: list[str], ctx: LoweringContext) -> bool:
    """Whether the algorithm's clean-up would change nothing, known without running it (a third of a
    10,000-node chain's backward): one Gradient was lowered, its nodes (``differentiate``'s clean-up fixed
    point) are all the nodes added, stand together in their order, and nothing touched them since (the
    caller checks that no optimizer was lowered, no pool rewritten and no output renamed). Then the
    clean-up can remove none of them: CSE finds none with the key of an earlier node (checked here for the
    user's nodes before them; among themselves there is none), no Identity among them is foldable and
    none is dead (its keep holds the Gradient's outputs, which kept them all live). Nodes not added are
    never removed. ``alg_names``: the names of ``alg``'s nodes, in order."""
    if len(ctx.cleaned) != 1:
        return False
    names = ctx.cleaned[0]
    if ctx.added != set(names):
        return False
    at = next((k for k, m in enumerate(alg_names) if m in ctx.added), len(alg_names))
    if alg_names[at:at + len(names)] != names:
        return False
    nodes = alg.node[:at + len(names)]
    return not merges_into(nodes[:at], nodes[at:])


def _recomputed_apart(alg: onnx.GraphProto, inference: onnx.GraphProto, ctx: LoweringContext) -> bool:
    """An inference node expanded into its function body for the backward (RotaryEmbedding, Attention, ...)
    stays in the inference graph, and its body, recomputing it, goes into ``algorithm``: the body's last
    node writes the node's outputs a second time. Those writes get fresh names (nothing reads them: the
    algorithm reads the inference graph's values, the same ones), and the clean-up drops what only they need
    (the expansion's nodes count as added). Returns whether an output was renamed."""
    defined = {o for n in inference.node for o in n.output[:] if o}  # [:]: see graph.py's docstring
    renamed = False
    for n in alg.node:
        for k, o in enumerate(n.output[:]):
            if o in defined:
                n.output[k] = fresh_name(ctx.taken, f"{o}/recomputed")
                renamed = True
    return renamed


def lower_initialization(model: onnx.ModelProto, index: int, ctx: LoweringContext) -> bool:
    """Optimizers or Gradients in an initialization graph (unusual) are lowered on that graph alone."""
    init = model.training_info[index].initialization
    if not any(n.domain in TRAINING_DOMAINS for n in init.node):
        return False
    tmp = combined_model(model, init, with_inference=False)
    lower_gradients(tmp, ctx)
    lower_optimizers(tmp, ctx)
    set_nodes(init, list(tmp.graph.node))
    return True


def lower_training_info(model: onnx.ModelProto, ctx: LoweringContext) -> bool:
    """Lower every TrainingInfoProto of ``model`` in place; returns whether anything changed."""
    changed = inline_graph_calls(model, ctx)
    for k in range(len(model.training_info)):
        changed |= lower_algorithm(model, k, ctx)
        changed |= lower_initialization(model, k, ctx)
    return changed


def training_nodes_left(model: onnx.ModelProto) -> list[tuple[str, str, str]]:
    """(where, node name, op type) of every node still in a training domain."""
    found = []
    graphs = [("graph", model.graph)]
    for k, ti in enumerate(model.training_info):
        graphs += [(f"training_info[{k}].initialization", ti.initialization),
                   (f"training_info[{k}].algorithm", ti.algorithm)]
    for where, top in graphs:
        for g in walk_graph(top):
            found.extend((where, n.name, n.op_type) for n in g.node if n.domain in TRAINING_DOMAINS)
    return found


def check_no_training_ops(model: onnx.ModelProto, ctx: LoweringContext | None = None) -> bool:
    """Raise TrainingSpecError when a training-domain node survived the passes (changes nothing)."""
    left = training_nodes_left(model)
    if left:
        where, name, op = left[0]
        raise TrainingSpecError(
            f"{where}: node {name!r} ({op}) is still a training op after lowering; only Gradient, GraphCall "
            "(in training graphs), Adagrad, Adam and Momentum are lowered"
        )
    return False
