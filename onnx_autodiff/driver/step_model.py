"""One plain ONNX model per training step and per initialization, runnable by any ONNX runtime.

``build_step_model`` concatenates the inference graph and a (lowered) ``algorithm`` graph, as the
released spec defines the training step. Every mutable initializer (a key of an update_binding or an
initialization_binding) becomes a graph input of the same name whose initializer stays as its default,
so a runtime that feeds nothing for it gets the stored value, and a training loop feeds back the
bound outputs after each step. The bindings are recorded as JSON in ``metadata_props``.
"""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import TrainingSpecError
from ..graph import TRAINING_DOMAINS, ancestors, attr_value, finalize, fresh_name, model_shell, node_inputs
from ..model import metadata
from ..model.carrier import dense_zeros
from ..model.weights import check_model, checkable
from ..passes.training import training_nodes_left
from .spec_checks import check_update_bindings


def gradient_names(model: onnx.ModelProto, index: int) -> dict[str, list[str]]:
    """``{"gradients": [...], "parameters": [...]}``: the outputs and the ``xs`` of the Gradient nodes of
    ``training_info[index].algorithm`` (before lowering), or what a lowered model recorded under
    ``metadata.GRADIENTS``."""
    recorded = metadata.read_json(model, metadata.GRADIENTS)
    if recorded is not None:
        return recorded
    found: dict[str, list[str]] = {"gradients": [], "parameters": []}
    if index < len(model.training_info):
        for n in model.training_info[index].algorithm.node:
            if n.op_type == "Gradient" and n.domain in TRAINING_DOMAINS:
                found["gradients"] += [o for o in n.output if o]
                found["parameters"] += list(attr_value(n, "xs", []))
    return found


def _training_info(model: onnx.ModelProto, index: int) -> onnx.TrainingInfoProto:
    if not 0 <= index < len(model.training_info):
        raise TrainingSpecError(
            f"training_info[{index}] does not exist: the model has {len(model.training_info)} TrainingInfoProto"
        )
    return model.training_info[index]


def _defined(graph: onnx.GraphProto) -> dict[str, str]:
    """Every name a graph defines -> which field defines it."""
    out: dict[str, str] = {}
    for i in graph.input:
        out.setdefault(i.name, "input")
    for t in graph.initializer:
        out.setdefault(t.name, "initializer")
    for t in graph.sparse_initializer:
        out.setdefault(t.values.name, "sparse_initializer")
    for n in graph.node:
        for o in n.output:
            if o:
                out.setdefault(o, f"output of node {n.name!r}")
    return out


def _initializer_names(graph: onnx.GraphProto) -> set[str]:
    return {t.name for t in graph.initializer} | {t.values.name for t in graph.sparse_initializer}


def validate_training_info(model: onnx.ModelProto) -> None:
    """Raise TrainingSpecError, naming the field, where the bindings or graphs break the spec."""
    inference_inits = _initializer_names(model.graph)
    inference_defs = _defined(model.graph)
    inference_outputs = {o.name for o in model.graph.output}
    seen_keys: dict[str, str] = {}
    for k, ti in enumerate(model.training_info):
        here = f"training_info[{k}]"
        alg = ti.algorithm
        for name, what in _defined(alg).items():
            if name in inference_defs:
                raise TrainingSpecError(
                    f"{here}.algorithm: {name!r} ({what}) is also defined by the inference graph "
                    f"({inference_defs[name]}); the two graphs are concatenated, so names must not collide"
                )
        alg_inits = _initializer_names(alg)
        alg_outputs = {o.name for o in alg.output}
        for b in ti.update_binding:
            field = f"{here}.update_binding"
            if b.key in seen_keys:
                raise TrainingSpecError(
                    f"{field}: key {b.key!r} is already a key of {seen_keys[b.key]}; each mutable "
                    "initializer may be assigned by one update_binding only"
                )
            seen_keys[b.key] = field
            if b.key not in inference_inits and b.key not in alg_inits:
                raise TrainingSpecError(
                    f"{field}: key {b.key!r} is not an initializer of the inference graph or of {here}.algorithm"
                )
            if b.value not in alg_outputs and b.value not in inference_outputs:
                raise TrainingSpecError(
                    f"{field}: value {b.value!r} (bound to {b.key!r}) is not an output of {here}.algorithm "
                    "or of the inference graph"
                )
        init = ti.initialization
        if len(init.input):
            raise TrainingSpecError(
                f"{here}.initialization.input: the initialization graph must have no inputs, it has "
                f"{[i.name for i in init.input]}"
            )
        init_outputs = {o.name for o in init.output}
        init_keys: set[str] = set()
        for b in ti.initialization_binding:
            field = f"{here}.initialization_binding"
            if b.key in init_keys:
                raise TrainingSpecError(f"{field}: key {b.key!r} appears twice")
            init_keys.add(b.key)
            if b.key not in inference_inits and b.key not in alg_inits:
                raise TrainingSpecError(
                    f"{field}: key {b.key!r} is not an initializer of the inference graph or of {here}.algorithm"
                )
            if b.value not in init_outputs:
                raise TrainingSpecError(
                    f"{field}: value {b.value!r} (bound to {b.key!r}) is not an output of {here}.initialization"
                )

    check_update_bindings(model)

def _plain(model: onnx.ModelProto) -> onnx.ModelProto:
    """The lowered model as a graph that runs (all-zero sparse initializers dense), or our error."""
    left = training_nodes_left(model)
    if left:
        where, node, op = left[0]
        raise TrainingSpecError(f"{where} still has training op {op!r} (node {node!r}): a step is built from a "
                                "lowered model; pass onnx_autodiff.lower(model)")
    return dense_zeros(model)


def mutable_names(model: onnx.ModelProto) -> list[str]:
    """Keys of every update_binding and initialization_binding, in binding order, without repeats."""
    names: dict[str, None] = {}  # ordered, one lookup per key (a list made it quadratic: BERT-base has ~600 keys)
    for ti in model.training_info:
        for b in list(ti.update_binding) + list(ti.initialization_binding):
            names.setdefault(b.key)
    return list(names)


def _reads(graph: onnx.GraphProto) -> set[str]:
    names = {o.name for o in graph.output}
    for n in graph.node:
        names.update(node_inputs(n))
    return names


def _new_model(model: onnx.ModelProto, graph: onnx.GraphProto, metadata: dict[str, str]) -> onnx.ModelProto:
    m = model_shell(model, doc_string=True)
    m.graph.CopyFrom(graph)
    for p in model.metadata_props:
        if p.key not in metadata:
            m.metadata_props.append(p)
    for k, v in metadata.items():
        m.metadata_props.append(onnx.StringStringEntryProto(key=k, value=v))
    finalize(m)
    check_model(m)
    return m


def _input_like(t: onnx.TensorProto) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))


def _has_type(vi: onnx.ValueInfoProto) -> bool:
    tt = vi.type.tensor_type
    return vi.type.HasField("tensor_type") and bool(tt.elem_type) and tt.HasField("shape")


def _complete_output_types(model: onnx.ModelProto, g: onnx.GraphProto, binding: dict[str, str]) -> None:
    """Give outputs declared without a type or shape one: a bound value has its key's type, the
    others what shape inference tells (a graph output needs a type to pass the checker)."""
    missing = [o for o in g.output if not _has_type(o)]
    if not missing:
        return
    inits = {t.name: t for t in g.initializer}
    by_value = {v: k for k, v in binding.items()}
    inferred: dict[str, onnx.ValueInfoProto] = {}
    if any(o.name not in by_value for o in missing):
        tmp = onnx.ModelProto()
        tmp.ir_version = model.ir_version
        tmp.opset_import.extend(model.opset_import)
        tmp.graph.CopyFrom(g)
        del tmp.graph.output[:]
        try:
            done = onnx.shape_inference.infer_shapes(tmp)
            inferred = {vi.name: vi for vi in done.graph.value_info}
        except Exception:  # best effort: the checker reports what stays unknown
            inferred = {}
    for o in missing:
        key = by_value.get(o.name)
        if key in inits:
            t = inits[key]
            o.type.CopyFrom(helper.make_tensor_type_proto(t.data_type, list(t.dims)))
        elif o.name in inferred and _has_type(inferred[o.name]):
            o.type.CopyFrom(inferred[o.name].type)


def build_step_model(model: onnx.ModelProto, index: int = 0) -> onnx.ModelProto:
    """One plain graph running one step of ``training_info[index]``: inference graph + algorithm.

    Contract: every key of update_binding (and of any initialization_binding) is a graph input of the
    same name whose initializer stays as its default; every value of update_binding is a graph output;
    ``metadata_props[metadata.UPDATE_BINDING]`` is the binding as JSON ``{key: value}`` and
    ``metadata_props[metadata.STEP_STATE]`` lists the mutable inputs. The inference part is left out
    when the algorithm reads none of its inputs, node outputs or graph outputs (a proposal-style
    algorithm that calls the inference graph through GraphCall); its initializers always stay.

    Deprecated: a model that still holds training ops (Gradient, optimizer ops) is lowered here, with a
    ``DeprecationWarning``; pass ``onnx_autodiff.lower(model)``, which is cheaper (one lowering, kept).
    """
    validate_training_info(model)
    _training_info(model, index)
    if training_nodes_left(model):  # the form before e0f1553, kept one more release
        import warnings

        from ..passes.pipeline import lower
        warnings.warn("build_step_model of a model that still holds training ops is deprecated and goes in the "
                      "release after next; call onnx_autodiff.lower(model) first and pass its result, which is "
                      "cheaper (each call here lowers again)", DeprecationWarning, stacklevel=2)
        model = lower(model, check=False)
    return step_model_parts(model, index)[0]


def step_model_parts(model: onnx.ModelProto, index: int = 0) -> tuple[onnx.ModelProto, dict[str, str], list[str]]:
    """``(build_step_model(model, index), its update binding {key: value}, its mutable inputs)``: what the
    step model records in its metadata, handed over as it was made (``step.assemble``)."""
    return plain_step_parts(checked_plain(model, index), index)


def checked_plain(model: onnx.ModelProto, index: int = 0) -> onnx.ModelProto:
    """``model`` checked once for every part made of it (``plain_step_parts``, ``plain_init_model``): its
    training_info valid, ``index`` one of them, no training op left; all-zero sparse initializers made dense."""
    validate_training_info(model)
    _training_info(model, index)
    if training_nodes_left(model):
        raise TrainingSpecError("the model still holds training ops (Gradient, optimizer ops): lower it first",
                                hint="onnx_autodiff.lower(model)")
    return dense_zeros(model)


def plain_step_parts(model: onnx.ModelProto, index: int = 0) -> tuple[onnx.ModelProto, dict[str, str], list[str]]:
    """``step_model_parts`` of a model ``checked_plain`` gave."""
    ti = model.training_info[index]
    inf, alg = model.graph, ti.algorithm
    inference_values = {i.name for i in inf.input if i.name not in _initializer_names(inf)}
    inference_values |= {o for n in inf.node for o in n.output if o}
    read = _reads(alg) | {b.value for b in ti.update_binding}
    with_inference = bool(read & (inference_values | {o.name for o in inf.output}))

    g = onnx.GraphProto()
    g.name = f"{inf.name}_step{index}" if inf.name else f"step{index}"
    parts = [inf, alg] if with_inference else [alg]
    for part in parts:
        g.node.extend(part.node)
        g.input.extend(part.input)
        g.value_info.extend(part.value_info)
    if not with_inference:
        g.value_info.extend(inf.value_info)
    outputs_seen: set[str] = set()
    for part in parts:
        for o in part.output:
            if o.name not in outputs_seen:
                outputs_seen.add(o.name)
                g.output.append(o)
    for part in (inf, alg):
        g.initializer.extend(part.initializer)
        g.sparse_initializer.extend(part.sparse_initializer)
    inits = {t.name: t for t in g.initializer}
    have_inputs = {i.name for i in g.input}
    state = []
    for name in mutable_names(model):
        if name not in inits:
            continue  # an initializer of another training_info's algorithm
        state.append(name)
        if name not in have_inputs:
            g.input.append(_input_like(inits[name]))
            have_inputs.add(name)
    for b in ti.update_binding:
        if b.value not in outputs_seen:
            raise TrainingSpecError(
                f"training_info[{index}].update_binding: value {b.value!r} is not an output of the step graph"
            )
    binding = {b.key: b.value for b in ti.update_binding}
    _complete_output_types(model, g, binding)
    step = _new_model(model, g, {metadata.UPDATE_BINDING: json.dumps(binding),
                                 metadata.STEP_STATE: json.dumps(state)})
    return step, binding, state


def _counts_up(g: onnx.GraphProto, counter: str, binding: dict[str, str], produced: dict) -> bool:
    """Whether the step's new value of ``counter`` is ``counter + 1`` (make_training_model's counter);
    ``produced``: output name -> node of ``g``."""
    new = binding.get(counter)
    node = produced.get(new)
    if node is None or node.op_type != "Add" or counter not in node.input:
        return False
    other = [i for i in node.input if i != counter]
    consts = {t.name: t for t in g.initializer}
    one = consts.get(other[0]) if len(other) == 1 else None
    if one is None:
        one_node = next((n for n in g.node if other and other[0] in n.output and n.op_type == "Constant"), None)
        one = one_node.attribute[0].t if one_node is not None and one_node.attribute else None
    value = numpy_helper.to_array(one).reshape(-1) if one is not None else None
    return value is not None and value.size == 1 and int(value[0]) == 1


def feed_host_scalars(step: onnx.ModelProto) -> dict[str, dict]:
    """In place: the scalars of the step that follow from ``make_training_model``'s step counter are computed by the
    driver on the host and fed, and the nodes that computed them from the counter go: Adam's and AdamW's bias
    corrections (``training/optimizers.bias_correction``: a device's ``Pow`` is ulps off on WebGPU) and the
    counter's own next value (its ``Add`` would be int64 arithmetic, which onnxruntime-web's WebGPU leaves to the
    CPU; the step casts the fed int32 to the int64 state). Returns ``{input: spec}``, also in
    ``metadata.HOST_SCALARS``; a driver feeds ``host_scalar_value(spec, counter)`` at every step, ``counter`` being
    the value of the state tensor ``spec["counter"]`` the step reads (its finished steps). Nothing changes where
    the step's counter does not count up by one (then the graph computes them, as before)."""
    record = metadata.read_json(step, metadata.BUILDER) or {}
    g = step.graph
    produced = {o: n for n in g.node for o in n.output if o}
    binding = metadata.read_json(step, metadata.UPDATE_BINDING, {})
    specs = {k: v for k, v in (record.get("host_scalars") or {}).items() if k in produced}
    specs = {k: v for k, v in specs.items() if _counts_up(g, v["counter"], binding, produced)}
    counter = record.get("iteration")
    cut = [produced[k] for k in specs]
    casts = []
    if counter in binding and _counts_up(g, counter, binding, produced):
        new = binding[counter]
        fed = fresh_name({*produced, *(i.name for i in g.input), *(t.name for t in g.initializer)}, f"{new}/host")
        specs[fed] = {"counter": counter, "offset": 1, "dtype": "int32"}
        cut.append(produced[new])
        casts.append(helper.make_node("Cast", [fed], [new], name=f"{new}/from_host", to=onnx.TensorProto.INT64))
    if not specs:
        return {}
    cut_ids = {id(c) for c in cut}
    nodes = _without_dead([n for n in g.node if id(n) not in cut_ids] + casts,
                          {id(n) for n in ancestors(list(g.node), [o for c in cut for o in c.output])},
                          {o.name for o in g.output})
    del g.node[:]
    g.node.extend(nodes)
    # the inputs' names collected once, not again for each initializer no node reads
    read = {x for n in nodes for x in node_inputs(n)} | {o.name for o in g.output} | {i.name for i in g.input}
    kept = [t for t in g.initializer if t.name in read]
    del g.initializer[:]
    g.initializer.extend(kept)
    for name, spec in specs.items():
        dtype = helper.np_dtype_to_tensor_dtype(np.dtype(spec["dtype"]))
        g.input.append(helper.make_tensor_value_info(name, dtype, []))
    metadata.write(step, {metadata.HOST_SCALARS: json.dumps(specs)})
    return specs


def _without_dead(nodes: list, maybe_dead: set[int], outputs: set[str]) -> list:
    """``nodes`` less those of ``maybe_dead`` (ids) whose outputs nothing reads, transitively: reader counts kept as
    nodes go (one pass over the graph, where recomputing every read name per round took as many passes as the
    chain of the counter's arithmetic is long)."""
    reads = [set(node_inputs(n)) for n in nodes]
    readers = Counter(x for r in reads for x in r)
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    alive = [True] * len(nodes)

    def unread(k: int) -> bool:
        return not any(readers[o] or o in outputs for o in nodes[k].output if o)

    todo = [k for k, n in enumerate(nodes) if id(n) in maybe_dead]
    while todo:
        k = todo.pop()
        if not alive[k] or not unread(k):
            continue
        alive[k] = False
        for x in reads[k]:
            readers[x] -= 1
            p = producer.get(x)
            if p is not None and alive[p] and id(nodes[p]) in maybe_dead:
                todo.append(p)
    return [n for n, keep in zip(nodes, alive) if keep]


def host_scalar_value(spec: dict, counter: int) -> np.ndarray:
    """The value of a host scalar (``feed_host_scalars``) after ``counter`` finished steps: with
    ``t = counter + spec["offset"]``, the product over ``spec["factors"]`` of ``(1 - beta^t) ** power``, computed
    in float64 and rounded once to ``spec["dtype"]``; without ``factors``, ``t`` itself (the counter's next
    value)."""
    t = counter + spec["offset"]
    if "factors" not in spec:
        return np.array(t, dtype=spec["dtype"])
    value = 1.0
    for beta, power in spec["factors"]:
        value *= (1.0 - float(beta) ** t) ** power
    return np.array(value, dtype=spec["dtype"])


def build_init_model(model: onnx.ModelProto, index: int = 0) -> onnx.ModelProto | None:
    """The initialization graph of ``training_info[index]`` as a model with no inputs, or None when
    it has no initialization. ``metadata_props[metadata.INITIALIZATION_BINDING]`` holds the
    binding as JSON ``{key: value}``. Initializers of the inference or algorithm graph that the
    initialization graph reads are copied in."""
    validate_training_info(model)
    _training_info(model, index)
    return plain_init_model(_plain(model), index)


def plain_init_model(model: onnx.ModelProto, index: int = 0) -> onnx.ModelProto | None:
    """``build_init_model`` of a model ``checked_plain`` gave."""
    ti = model.training_info[index]
    init = ti.initialization
    if not len(init.node) and not len(init.output) and not len(ti.initialization_binding):
        return None
    g = onnx.GraphProto()
    g.CopyFrom(init)
    if not g.name:
        g.name = f"{model.graph.name or 'model'}_init{index}"
    defined = set(_defined(g))
    reads = _reads(g)
    for part in (model.graph, ti.algorithm):
        for t in part.initializer:
            if t.name in reads and t.name not in defined:
                g.initializer.append(t)
                defined.add(t.name)
    binding = {b.key: b.value for b in ti.initialization_binding}
    return _new_model(model, g, {metadata.INITIALIZATION_BINDING: json.dumps(binding)})



def _part(step: onnx.ModelProto, nodes: list, outputs: list[str], extra_inputs: list[onnx.ValueInfoProto],
          name: str) -> onnx.ModelProto:
    g = step.graph
    read = {x for n in nodes for x in node_inputs(n)} | set(outputs)
    part = model_shell(step)
    p = part.graph
    p.name = f"{g.name}_{name}"
    p.node.extend(nodes)
    p.input.extend(i for i in g.input if i.name in read)
    p.input.extend(vi for vi in extra_inputs if vi.name in read)
    p.initializer.extend(t for t in g.initializer if t.name in read)
    p.sparse_initializer.extend(t for t in g.sparse_initializer if t.values.name in read)
    p.value_info.extend(vi for vi in g.value_info if vi.name in read)
    return part


def split_step_model(step: onnx.ModelProto, first_outputs: list[str]
                     ) -> tuple[onnx.ModelProto | None, onnx.ModelProto | None, list[str]]:
    """The step model as two runs: ``(gradient part, apply part, boundary)``. The first part computes
    ``first_outputs`` (the loss and the gradients) and everything they depend on; the second every
    other node (the update), reading the ``boundary`` tensors the first part made. The step model's
    outputs go to the part that computes them (graph inputs passed straight through go to the second).
    A part with no node is None. Names, types and the metadata of the step model stay as they are."""
    g = step.graph
    nodes = list(g.node)
    first = ancestors(nodes, first_outputs)
    first_ids = {id(n) for n in first}
    second = [n for n in nodes if id(n) not in first_ids]
    made_first = {o for n in first for o in n.output if o}
    read_second = {x for n in second for x in node_inputs(n)}
    graph_outputs = [o.name for o in g.output]
    boundary = [o for n in first for o in n.output if o and o in read_second]
    types = {vi.name: vi for vi in g.output}
    missing = [b for b in boundary if b not in types]
    if missing:
        tmp = _part(step, first, graph_outputs, [], "types")
        tmp.graph.output.extend(helper.make_empty_tensor_value_info(b) for b in missing)
        try:
            inferred = onnx.shape_inference.infer_shapes(checkable(tmp)).graph
            types.update({vi.name: vi for vi in list(inferred.value_info) + list(inferred.output)})
        except Exception:  # onnxruntime infers what stays unknown
            pass
    typed = [types.get(b, helper.make_empty_tensor_value_info(b)) for b in boundary]

    def with_outputs(part: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
        seen = set()
        for name in names:
            if name not in seen:
                seen.add(name)
                part.graph.output.append(types.get(name, helper.make_empty_tensor_value_info(name)))
        return part

    first_part = second_part = None
    if first:
        outs = [o for o in graph_outputs if o in made_first] + boundary + [o for o in first_outputs if o in made_first]
        first_part = with_outputs(_part(step, first, outs, [], "gradient"), outs)
    rest = [o for o in graph_outputs if o not in made_first]
    if second or rest:
        second_part = with_outputs(_part(step, second, rest, typed, "apply"), rest)
    for part in (first_part, second_part):
        if part is not None:
            part.metadata_props.extend(step.metadata_props)
    return first_part, second_part, boundary


__all__ = ["build_step_model", "step_model_parts", "build_init_model", "split_step_model", "validate_training_info",
           "mutable_names", "gradient_names", "feed_host_scalars", "host_scalar_value", "checked_plain",
           "plain_step_parts", "plain_init_model"]
