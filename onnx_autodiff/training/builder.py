"""``make_training_model``: an inference model, a loss and an optimizer -> a spec training model.

The result is the inference model unchanged plus one ``TrainingInfoProto`` as the released ONNX
spec (IR >= 7, domain ``ai.onnx.preview.training``) writes it:

* ``algorithm``: the loss on the chosen outputs, one ``Gradient`` node (``xs`` = the trainable
  initializers, ``y`` = the loss), the optimizer (the spec's ``Adagrad`` / ``Adam`` / ``Momentum``
  ops, or standard ops for SGD and AdamW) and an iteration counter ``T_new = T + 1``. Inputs: the
  labels and ``learning_rate`` (a float scalar whose default is ``lr``; a driver feeds it at every
  step to schedule it; ``lr`` is also recorded in ``metadata_props``).
* ``update_binding``: every trainable weight, every optimizer state tensor and the counter.
* ``initialization`` + ``initialization_binding``: zeros for the optimizer state and the counter
  (the weights keep the inference model's values).

``lower`` / ``TrainingSession`` / any spec reader then trains it. Frozen initializers are not in
``xs``, so the lowering emits no backward computation for them.
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..engine.reverse import check_rules
from ..errors import TrainingBuilderError
from ..graph import FLOAT_TYPES, make_portable, used_names
from ..model import metadata
from ..model.carrier import LightModel, hand_back, open_model
from ..model.weights import fresh_zeros, placeholder
from ..passes.remat import budget_record
from ..passes.remat_plan import check_dims
from ..passes.training import combined_model
from .lora.adapters import folder_family
from .lora.rewrite import add_lora
from .losses import (
    Value,
    builtin_loss,
    compatible,
    dims_of,
    graph_loss,
    label_info,
    loss_kind,
    loss_options,
    value_infos,
)
from .nodes import GraphBuilder
from .optimizers import PREVIEW, Param, emit_optimizer, resolve_optimizer
from .options import LossSpec, as_budget, as_loss, as_optimizer, deprecated_keywords
from .parameters import untie_aliases
from .precision import TYPES as PRECISION_TYPES
from .precision import Scaler, add_masters, convert_model, loss_outputs_in_float32, model_float_type, scales_loss
from .precision import resolve as resolve_precision
from .precision import write_record as write_precision
from .trainable import select_trainable

LEARNING_RATE = "learning_rate"
_log = logging.getLogger("onnx_autodiff")


def _opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    return 1


def _as_mapping(value, outputs: list[str], default, field: str) -> dict:
    if isinstance(value, dict):
        unknown = [k for k in value if k not in outputs]
        if unknown:
            raise TrainingBuilderError(field, f"keys {unknown} are not among the loss outputs {outputs}")
        return {o: value.get(o, default(o)) for o in outputs}
    if value is None:
        return {o: default(o) for o in outputs}
    if len(outputs) > 1 and field == "LossSpec.label":
        raise TrainingBuilderError(field, f"several outputs {outputs} need one label each: pass a dict")
    return {o: value for o in outputs}


def _untyped_output(graph: onnx.GraphProto, name: str, info) -> str:
    """Why the loss cannot go on ``name`` (no known type, or not floating point) and what to do."""
    if info is not None and info.elem_type:
        kind = onnx.TensorProto.DataType.Name(info.elem_type)
        return f"{name!r} is a {kind} tensor; a loss needs a floating-point output (pick it with outputs=...)"
    node = next((n for n in graph.node if name in n.output), None)
    fix = (f"declare its type in graph.value_info or graph.output, e.g. "
           f"helper.make_tensor_value_info({name!r}, TensorProto.FLOAT, shape)")
    if node is None:
        return f"{name!r} has no known type; {fix}"
    domain = node.domain or "ai.onnx"
    return (f"{name!r} has no known type: it is output {list(node.output).index(name)} of node {node.name!r} "
            f"(op {node.op_type!r}, domain {domain!r}), whose output type onnx shape inference cannot infer "
            f"(a custom-domain op has no schema); {fix}")


def make_training_model(model, loss="cross_entropy", optimizer="adam", *, lr: float = 1e-3, trainable=None,
                        frozen=None, lora: dict | None = None, memory_budget=None, check: bool = True,
                        untie: bool = True, precision=None, **deprecated) -> onnx.ModelProto:
    """The inference model plus a TrainingInfoProto that trains it (see the module docstring).

    ``model``: the path of an .onnx file (its weights are memory-mapped, never read into protobuf), an
    ``onnx.ModelProto`` or a ``LightModel``. The result is an ``onnx.ModelProto`` every ONNX tool takes: the
    weights of a model given by its path stay in its files (external-data references, ``model/carrier.py``),
    the optimizer's fresh state is all-zero sparse initializers (no bytes) that the initialization graph also
    writes, and the rest is inline. ``TrainingSession``, ``export_step``, ``lower`` and ``onnx_autodiff.save_model``
    take it as it is; ``onnx.save`` keeps the references (save it beside the model it came from).

    ``loss``: a name (``cross_entropy``, ``causal_lm``, ``nll``, ``mse``, ``l1``, ``bce``, ``bce_with_logits``), a
    GraphProto, a dict ``{output: loss}``, or a ``LossSpec`` (which outputs, labels, label shape, term weights,
    options). ``causal_lm`` reads logits [B, S, V]; its label is the model's token-id input (``input_ids``).
    ``optimizer``: ``sgd``, ``momentum``, ``nesterov``, ``adagrad``, ``adam`` or ``adamw`` with torch's defaults,
    or an ``OptimizerSpec(name, options)``. ``lr``: the learning rate a driver feeds when told nothing else
    (``learning_rate`` is an input whose default is ``lr``; feed it to schedule). ``trainable`` / ``frozen``:
    names or glob patterns of initializers. ``lora``: ``{"rank", "alpha", "dropout", "targets"}`` adds LoRA
    adapters beside the targeted MatMul/Gemm weights (``onnx_autodiff.training.lora``) and trains only them.
    ``memory_budget``: bytes, a size text (``"2GiB"``) or ``"auto"``, or a ``MemoryBudget(size, dims)``: the
    lowering then lets the backward recompute cheap forward activations until its estimated peak fits
    (``passes/remat.py``; the ``remat`` extra). With ``check`` every op on the path from the trainable
    tensors to the loss must have a gradient rule (``UnsupportedOperatorError`` here, not at the first step);
    the lowering itself happens once, where the model is run or exported. With ``untie`` every Identity alias
    of an initializer (the TorchScript exporter's merging of parameters that were equal at export) becomes
    an initializer of its own, so they train apart. ``precision``: ``"fp16"``, ``"bf16"`` or a ``Precision``: mixed
    precision (``training/precision.py``): the forward and backward in that type (a float32 model is converted),
    float32 master copies of the trained tensors and float32 optimizer state, the loss in float32, dynamic loss
    scaling for float16. A float16 / bfloat16 model trains so without being asked.

    Deprecated keywords (one more release, each with a ``DeprecationWarning``): ``outputs``, ``label``,
    ``label_shape``, ``loss_weights``, ``loss_options`` (the ``LossSpec`` fields), ``optimizer_options``
    (``OptimizerSpec.options``), ``memory_budget_dims`` (``MemoryBudget.dims``), ``weights`` (pass the path).
    """
    loss, optimizer, memory_budget, weights = deprecated_keywords(loss, optimizer, memory_budget, deprecated)
    light = open_model(model, weights=weights, what="inference model")
    return hand_back(build_training_model(light, loss, optimizer, lr=lr, trainable=trainable, frozen=frozen,
                                          lora=lora, memory_budget=memory_budget, check=check, untie=untie,
                                          precision=precision))


def build_training_model(light: LightModel, loss="cross_entropy", optimizer="adam", *, lr: float = 1e-3,
                         trainable=None, frozen=None, lora: dict | None = None, memory_budget=None,
                         check: bool = True, untie: bool = True, precision=None) -> LightModel:
    """``make_training_model`` on the carrier: a LightModel in, a LightModel out (what the CLI writes)."""
    spec, opt, budget = as_loss(loss), as_optimizer(optimizer), as_budget(memory_budget)
    if len(light.proto.training_info):
        raise TrainingBuilderError("model", "the model already has training_info; start from the inference model "
                                            "(onnx-autodiff export gives one)")
    opt_name, opts = resolve_optimizer(opt.name, opt.options)
    budget_args = (budget.size, budget.dims) if budget is not None else (None, None)
    budget_record(*budget_args, "")  # a budget that is not a size fails before any work
    if not np.isfinite(lr) or lr < 0:
        raise TrainingBuilderError("lr", f"the learning rate must be a finite number >= 0, got {lr}")
    model, arrays, originals, trainable = _inference_copy(light, untie, precision, lora, trainable)
    g = model.graph
    infos = value_infos(model)
    out_names = _loss_outputs(g, infos, spec.loss, spec.outputs)
    labels = _labels(g, spec.loss, spec.label, out_names)
    trainable_names = select_trainable(model, trainable, frozen, out_names, arrays)
    mixed = resolve_precision(precision, model, trainable_names)
    masters = {}
    if mixed is not None:
        trainable_names, masters = add_masters(model, arrays, trainable_names, PRECISION_TYPES[mixed.dtype],
                                               used_names(model), originals)
    alg, scaler, (loss_name, lr_name, counter) = _add_training_info(model, infos, spec, out_names, labels,
                                                                    trainable_names, mixed, (opt_name, opts), lr)
    algorithm = model.training_info[0].algorithm
    _set_record(model, {
        "loss": loss_name, "outputs": out_names, "labels": [labels[o] for o in out_names],
        "learning_rate": lr_name, "lr": float(lr), "optimizer": opt_name,
        "optimizer_options": {k: list(v) if isinstance(v, tuple) else v for k, v in opts.items()},
        "trainable": trainable_names, "iteration": counter, "host_scalars": alg.host_scalars,
    })
    metadata.write(model, budget_record(*budget_args, loss_name))
    if mixed is not None:
        write_precision(model, mixed, masters, scaler, originals is not None)
    if light.source:  # where its tokenizer and the rest of its folder are (driver/text.py, export-adapter)
        metadata.write(model, {metadata.SOURCE: json.dumps({"path": light.source,
                                                            "abspath": os.path.abspath(light.source)})})
    if budget is not None:
        check_dims(list(g.input) + list(algorithm.input), budget.dims)
    make_portable(model)  # node names distinct from tensor names, no empty trailing inputs (docs/runtimes.md)
    if check:
        check_rules(combined_model(model, model.training_info[0].algorithm), trainable_names, loss_name,
                    "the training model's Gradient")
    arrays.update(alg.arrays)
    return LightModel(model, arrays, light.folder, light.source, light.private | set(alg.arrays))


def _inference_copy(light: LightModel, untie: bool, precision, lora, trainable):
    """(model, arrays, float32 values of converted weights or None, trainable): a copy of the light inference model
    with Identity aliases untied, converted to the ``precision`` asked, and with the LoRA adapters (which are
    then what trains)."""
    model = onnx.ModelProto()
    model.CopyFrom(light.proto)  # light: graphs and small tensors only
    arrays = dict(light.arrays)
    if untie:
        _untie(model, arrays)
    originals = _convert_for(model, arrays, precision)
    if lora is not None:
        if trainable is not None:
            raise TrainingBuilderError("trainable", "with lora= only the adapters train; leave trainable= out")
        trainable = add_lora(model, lora, arrays, arrays, family=folder_family(light.source))  # PEFT's names
        metadata.write(model, {metadata.FROZEN: "reference"})  # checkpoints: the adapters, not the base again
    return model, arrays, originals, trainable


def _add_training_info(model: onnx.ModelProto, infos: dict[str, Value], spec: LossSpec, out_names: list[str],
                       labels: dict[str, str], trainable_names: list[str], mixed, optimizer: tuple[str, dict],
                       lr: float):
    """Append the TrainingInfoProto (the algorithm: loss, Gradient, optimizer and counter; the initialization of
    the optimizer state, counter and loss scale; their bindings) and the spec's opset. Returns the algorithm's
    builder (its host scalars and state arrays), the loss scaler (None without) and the names of the loss, the
    learning-rate input and the counter."""
    g = model.graph
    taken = used_names(model)
    alg = GraphBuilder(taken, "train")
    taken.update(labels.values())
    lr_name = _reserve(alg, LEARNING_RATE)
    loss_name, loss_dtype = _emit_loss(alg, model, infos, spec, out_names, labels, float32=mixed is not None)
    alg.inputs.append(helper.make_tensor_value_info(lr_name, TensorProto.FLOAT, []))
    alg.inits.append(numpy_helper.from_array(np.array(lr, np.float32), lr_name))  # the default; feed to override
    counter = alg.initializer(0, TensorProto.INT64, "iteration")

    inits = {t.name: t for t in g.initializer}
    params = [Param(n, inits[n].data_type, list(inits[n].dims)) for n in trainable_names]
    scaler = Scaler(alg, mixed) if mixed is not None and scales_loss(mixed) else None
    states, update = _emit_update(alg, params, *optimizer, lr_name, counter, loss_name, loss_dtype, scaler)

    algorithm = alg.graph(f"{g.name or 'model'}_training")
    starts = [] if scaler is None else [(scaler.scale, np.array(scaler.init, np.float32))] + (
        [(scaler.good, np.array(0, np.int64))] if scaler.good else [])
    initialization, init_binding = _initialization(taken, states, counter, g.name, starts)
    model.ir_version = max(model.ir_version, 7)
    if not any(o.domain == PREVIEW for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(PREVIEW, 1))
    model.training_info.append(helper.make_training_info(algorithm, update, initialization, init_binding))
    return alg, scaler, (loss_name, lr_name, counter)


def _emit_update(alg: GraphBuilder, params: list, opt_name: str, opts: dict, lr_name: str, counter: str,
                 loss_name: str, loss_dtype: int, scaler: Scaler | None = None) -> tuple[list, list]:
    """The Gradient node, the optimizer and the counter's increment; the algorithm's outputs. Returns the
    optimizer's state slots and the update binding. With a loss ``scaler`` (mixed precision) the Gradient
    differentiates the scaled loss, the optimizer reads the unscaled gradients, and a step whose gradients are
    not finite keeps every state tensor (the scaler's guard)."""
    for p in params:
        p.grad = alg.name(f"{p.name}_grad")
    y = loss_name if scaler is None else scaler.scaled(loss_name)
    alg.Gradient(*[p.name for p in params], domain=PREVIEW, outputs=[p.grad for p in params],
                 xs=[p.name for p in params], y=y)
    if scaler is not None:
        for p in params:
            p.grad = scaler.unscaled(p.grad)
        scaler.finite()
    states = emit_optimizer(alg, opt_name, opts, params, lr_name, counter, lambda p, slot: _zero_state(alg, p, slot))
    counter_new = alg.Add(counter, alg.initializer(1, TensorProto.INT64, "one"), outputs=[alg.name("iteration.new")])
    scaled = []
    if scaler is not None:
        for p in params:
            p.new = scaler.guard(p.new, p.name)
        states = [(s, p, scaler.guard(s_new, s)) for s, p, s_new in states]
        counter_new = scaler.guard(counter_new, counter)
        scaled = scaler.updates()
    alg.outputs.append(helper.make_tensor_value_info(loss_name, loss_dtype, []))
    alg.outputs += [helper.make_tensor_value_info(p.new, p.dtype, p.dims) for p in params]
    alg.outputs += [helper.make_tensor_value_info(s_new, p.dtype, p.dims) for _, p, s_new in states]
    alg.outputs.append(helper.make_tensor_value_info(counter_new, TensorProto.INT64, []))
    alg.outputs += [vi for _, _, vi in scaled] + (scaler.report() if scaler is not None else [])
    update = [(p.name, p.new) for p in params] + [(s, s_new) for s, _, s_new in states] + [(counter, counter_new)]
    update += [(state, new) for state, new, _ in scaled]
    return states, update


def _token_input(g: onnx.GraphProto) -> str | None:
    """The token-id input of a language model: ``input_ids``, else the only integer input of rank 2."""
    inits = {t.name for t in g.initializer}
    ints = [i for i in g.input if i.name not in inits and i.type.tensor_type.elem_type in _INT_TYPES
            and len(i.type.tensor_type.shape.dim) == 2]
    if any(i.name == "input_ids" for i in ints):
        return "input_ids"
    return ints[0].name if len(ints) == 1 else None


_INT_TYPES = (TensorProto.INT64, TensorProto.INT32)


def _labels(g: onnx.GraphProto, loss, label, out_names: list[str]) -> dict[str, str]:
    """Output -> label input. ``causal_lm`` defaults to the token-id input and may name any integer input;
    other losses get a new input (``labels``, or ``<output>_labels`` for several outputs)."""
    losses = _as_mapping(loss, out_names, lambda o: loss, "loss")
    causal = {o for o in out_names if isinstance(losses[o], str) and loss_kind(losses[o], "loss") == "causal_lm"}
    tokens = _token_input(g)

    def default(o):
        if o in causal:
            if tokens is None:
                raise TrainingBuilderError("LossSpec.label", "causal_lm takes its labels from the token-id input, and "
                                           "the model has no 'input_ids' (nor one integer [B, S] input): name the "
                                           "label input with LossSpec(label=...)")
            return tokens
        return "labels" if len(out_names) == 1 else f"{o}_labels"

    labels = _as_mapping(label, out_names, default, "LossSpec.label")
    if len(set(labels.values())) != len(labels):
        raise TrainingBuilderError("LossSpec.label", f"each output needs its own label input, got {labels}")
    taken = used_names_of_graph(g)
    inputs = {i.name for i in g.input}
    for o, lab in labels.items():
        if lab in taken and not (o in causal and lab in inputs):
            raise TrainingBuilderError("LossSpec.label", f"{lab!r} is already a name in the inference graph; "
                                                "pick another label name")
    return labels


def used_names_of_graph(g: onnx.GraphProto) -> set[str]:
    return ({i.name for i in g.input} | {t.name for t in g.initializer} | {o for n in g.node for o in n.output}
            | {o.name for o in g.output})


def _untie(model: onnx.ModelProto, arrays: dict) -> None:
    pairs = untie_aliases(model)
    for alias, source in pairs:  # the alias starts from the same values (the arrays are read-only)
        if source in arrays:
            arrays[alias] = arrays[source]
    if pairs:
        _log.info("untied %d Identity aliases of initializers (each trains on its own; untie=False keeps "
                  "them tied): %s", len(pairs), ", ".join(f"{a} <- {b}" for a, b in pairs))


def _loss_outputs(g: onnx.GraphProto, infos: dict[str, Value], loss, outputs) -> list[str]:
    """The tensors the loss reads, each a float tensor of the inference graph."""
    graph_outputs = [o.name for o in g.output]
    if isinstance(loss, dict):
        out_names = list(loss)
    elif outputs is not None:
        out_names = [outputs] if isinstance(outputs, str) else list(outputs)
    else:
        out_names = graph_outputs[:1]
    if not out_names:
        raise TrainingBuilderError("LossSpec.outputs", "the model has no graph output to put a loss on")
    defined = {o for n in g.node for o in n.output if o} | {i.name for i in g.input}
    for o in out_names:
        if o not in defined:
            raise TrainingBuilderError("LossSpec.outputs", f"{o!r} is not a tensor of the inference graph; "
                                                  f"graph outputs: {graph_outputs}")
        if o not in infos or infos[o].elem_type not in FLOAT_TYPES:
            raise TrainingBuilderError("LossSpec.outputs", _untyped_output(g, o, infos.get(o)))
    return out_names


def _reserve(b: GraphBuilder, want: str) -> str:
    """``want`` itself if the model does not use it, else a fresh name under the builder's prefix."""
    name = want if want not in b.taken else b.name(want)
    b.taken.add(name)
    return name


def _emit_loss(alg: GraphBuilder, model: onnx.ModelProto, infos: dict[str, Value], spec: LossSpec,
               out_names: list[str], labels: dict[str, str], float32: bool = False) -> tuple[str, int]:
    """The (weighted sum of the) loss terms and their label inputs; returns (loss name, element type). With
    ``float32`` (mixed precision) the loss reads its outputs cast to float32."""
    if float32:
        cast = loss_outputs_in_float32(alg, out_names)
        infos = {**infos, **{c: Value(c, TensorProto.FLOAT, infos[o].dims) for o, c in cast.items()}}
    loss, label_shape, loss_weights, options = spec.loss, spec.label_shape, spec.weights, spec.options
    losses = _as_mapping(loss, out_names, lambda o: loss, "loss")
    per_output = isinstance(loss, dict) and options is not None and set(options) <= set(out_names)
    inputs = {i.name for i in model.graph.input}
    shapes = {} if label_shape is None else _as_mapping(label_shape, out_names, lambda o: None, "LossSpec.label_shape")
    if isinstance(label_shape, (list, tuple)) and len(out_names) == 1:
        shapes = {out_names[0]: list(label_shape)}
    term_weights = _as_mapping(loss_weights, out_names, lambda o: 1.0, "LossSpec.weights")
    opset = _opset(model)
    terms = []
    for o in out_names:
        field = f"loss[{o!r}]" if isinstance(loss, dict) else "loss"
        kind = loss_kind(losses[o], field)
        y = infos[cast[o]] if float32 else infos[o]
        if isinstance(kind, onnx.GraphProto):
            term, label_vi = graph_loss(alg, kind, y, labels[o], field)
            lab_dims = dims_of(label_vi)
        else:
            opts = loss_options(kind, (options or {}).get(o) if per_output else options, field)
            lab_type, lab_dims = label_info(kind, y, field, opset, opts)
            _check_mask(model.graph, opts.get("mask"), field)
            term = builtin_loss(alg, kind, y.name, labels[o], y.elem_type, **opts)
            label_vi = helper.make_tensor_value_info(labels[o], lab_type, lab_dims)
        if o in shapes and shapes[o] is not None and not compatible(list(shapes[o]), lab_dims):
            raise TrainingBuilderError("LossSpec.label_shape", f"the label of {o!r} has shape {list(shapes[o])}, but "
                                                      f"the loss needs {Value('', 0, lab_dims).shape_text()}")
        if labels[o] not in inputs:  # causal_lm's labels may be an input of the inference graph (the token ids)
            alg.inputs.append(label_vi)
        w = float(term_weights[o])
        if len(out_names) > 1 or w != 1.0:
            term = alg.Mul(term, alg.initializer(w, y.elem_type, f"weight_{o}"))
        terms.append(term)
    read = [cast[o] if float32 else o for o in out_names]
    loss_dtype = infos[read[0]].elem_type
    if len({infos[o].elem_type for o in read}) > 1:
        terms = [alg.Cast(t, to=loss_dtype) for t in terms]
    loss_name = _reserve(alg, "loss")
    alg.op("Sum" if len(terms) > 1 else "Identity", *terms, outputs=[loss_name])
    return loss_name, loss_dtype


def _convert_for(model: onnx.ModelProto, arrays: dict, precision) -> dict | None:
    """A float32 model asked to train in float16 / bfloat16 computes in it (precision.convert_model); a model
    already in a low-precision type must be in the one asked. Returns the float32 values of the converted weights
    (None: not converted)."""
    if precision is None:
        return None
    asked = resolve_precision(precision, model, [])
    dtype = PRECISION_TYPES[asked.dtype]
    have = model_float_type(model)
    if have == TensorProto.FLOAT:
        return convert_model(model, arrays, dtype)
    if have is not None and have != dtype:
        raise TrainingBuilderError("precision", f"the model's weights are {helper.tensor_dtype_to_string(have)}, "
                                                f"not {asked.dtype}: train it in its own precision (leave "
                                                "precision= out) or convert it from float32")
    return None


def _check_mask(g: onnx.GraphProto, mask, field: str) -> None:
    if mask is None:
        return
    inputs = [i.name for i in g.input if i.name not in {t.name for t in g.initializer}]
    if mask not in inputs:
        raise TrainingBuilderError(field, f"the mask {mask!r} is not an input of the model; its inputs: {inputs}")


def _zero_state(b: GraphBuilder, p: Param, slot: str) -> str:
    """An optimizer state tensor: a detached initializer of zeros (calloc: no memory until written)."""
    s = b.name(f"{p.name}.{slot}")
    zeros = fresh_zeros(p.dims, helper.tensor_dtype_to_np_dtype(p.dtype))
    b.inits.append(placeholder(s, zeros))
    b.arrays[s] = zeros
    return s


def _initialization(taken: set[str], states, counter: str, model_name: str, starts=()):
    """The initialization graph (zeros for the optimizer state and the counter, ``starts``' (name, value) for
    other state: the loss scale) and its binding."""
    init = GraphBuilder(taken, "init")
    binding = []
    for name, value in starts:
        out = init.Constant(outputs=[init.name(f"{name}.start")], value=numpy_helper.from_array(value))
        init.outputs.append(helper.make_tensor_value_info(out, helper.np_dtype_to_tensor_dtype(value.dtype), []))
        binding.append((name, out))
    for s, p, _ in states:
        shape = init.initializer(np.array(p.dims, np.int64), TensorProto.INT64, f"{s}/shape")
        zero = helper.make_tensor("value", p.dtype, [1], [0])
        out = init.ConstantOfShape(shape, outputs=[init.name(f"{s}.zeros")], value=zero)
        init.outputs.append(helper.make_tensor_value_info(out, p.dtype, p.dims))
        binding.append((s, out))
    t0 = init.Constant(outputs=[init.name("iteration.zero")], value=numpy_helper.from_array(np.array(0, np.int64)))
    init.outputs.append(helper.make_tensor_value_info(t0, TensorProto.INT64, []))
    binding.append((counter, t0))
    return init.graph(f"{model_name or 'model'}_initialization"), binding


def _set_record(model: onnx.ModelProto, record: dict) -> None:
    metadata.write(model, {metadata.BUILDER: json.dumps(record)})


def builder_record(model: onnx.ModelProto) -> dict | None:
    """What ``make_training_model`` recorded (loss, labels, learning-rate input, ...), or None."""
    return metadata.read_json(model, metadata.BUILDER)


__all__ = ["make_training_model", "build_training_model", "builder_record", "LEARNING_RATE"]
