"""The onnxruntime runs of a training step: one weight-free model per part, bound with IOBinding.

A step is two parts (``step_model.split_step_model``): the gradient part (loss, gradients) and the apply
part (the update). Each becomes an onnxruntime session over a model without tensor bytes: every mutable
tensor and every detached frozen weight is a graph input (``inputs_for_weights``), and each part gets
one more output, the sum of squares of what it checks (``add_sum_of_squares``), so NaN/Inf is found
with one number. The exception: what a kernel needs as a constant (``ort_options.CONSTANT_INPUTS``, the
quantization constants of MatMulNBits) stays an initializer whose bytes onnxruntime copies from our
array when it makes the session (``keep_constants``).
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ..errors import TrainingDivergedError
from ..graph import FLOAT_TYPES
from ..model import metadata
from ..model.packed import is_packed, pack
from ..model.weights import is_detached
from ..ort_options import constant_inputs
from .devices import Device
from .state import StateBuffers, c_array, in_place_keys, to_device, to_host
from .step_model import split_step_model

CHECK = "onnx_autodiff/sum_of_squares"


def inputs_for_weights(model: onnx.ModelProto, drop: set[str], constants: set[str] = frozenset()) -> list[str]:
    """In place: the initializers in ``drop`` are removed (they are graph inputs already) and every
    other detached initializer but ``constants`` becomes a graph input of its type and shape. Returns the
    latter."""
    g = model.graph
    fed = [t for t in g.initializer if is_detached(t) and t.name not in drop and t.name not in constants]
    keep = [t for t in g.initializer if t.name not in drop and (not is_detached(t) or t.name in constants)]
    del g.initializer[:]
    g.initializer.extend(keep)
    have = {i.name for i in g.input}
    g.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in fed
                   if t.name not in have)
    return [t.name for t in fed]


_IN_MEMORY_FILES = itertools.count()


def keep_constants(model: onnx.ModelProto, names: set[str], array: Callable[[str], np.ndarray],
                   options: ort.SessionOptions) -> list[np.ndarray]:
    """In place: each detached initializer in ``names`` refers to an in-memory external-data file that holds
    ``array(name)``, given to ``options``, so the session made with them has it as an initializer (onnxruntime
    copies the bytes while it makes the session; the file names are unique, so the options serve other
    models too). Returns the buffers: the caller keeps them until the session is made (a packed copy is ours
    alone, and onnxruntime keeps only their addresses until then)."""
    files, buffers = [], []
    for t in model.graph.initializer:
        if t.name not in names or not is_detached(t):
            continue
        arr = array(t.name)  # a packed type (int4, ...) is one element a byte in numpy, packed in the file
        data = np.frombuffer(pack(arr), np.uint8) if is_packed(t.data_type) else \
            np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        location = f"onnx-autodiff-constant-{next(_IN_MEMORY_FILES)}.bin"
        del t.external_data[:]
        for key, value in (("location", location), ("offset", "0"), ("length", str(data.nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        files.append(location)
        buffers.append(data)
    if files:
        options.add_external_initializers_from_files_in_memory(files, buffers, [b.nbytes for b in buffers])
    return buffers


def add_sum_of_squares(model: onnx.ModelProto, names: list[str], out: str) -> str | None:
    """One float scalar output ``out``, the sum of the squares of ``names``: NaN or Inf iff one of them
    is (or the sum overflows float32, which a training step should not come near either). The per-tensor
    sums (float scalars) are added one to the next: n reductions and n - 1 scalar Adds (no Sum: WebGPU has no
    kernel for it; a Reshape of each sum, a Concat and a ReduceSum were n + 2 nodes more, each a kernel launch)."""
    if not names:
        return None
    g = model.graph
    dtypes = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.input) + list(g.output) + list(g.value_info)}
    total = None
    for k, name in enumerate(names):
        sq = f"{out}/{k}"
        last = k == len(names) - 1
        cast = dtypes.get(name) != TensorProto.FLOAT
        # the last term's own sum is ``out`` when nothing is added to it
        term = out if last and total is None and not cast else sq + "/sum"
        g.node.append(helper.make_node("ReduceSumSquare", [name], [term], name=sq, keepdims=0))
        if cast:
            cast_to = out if last and total is None else sq + "/float"
            g.node.append(helper.make_node("Cast", [term], [cast_to], name=sq + "/cast", to=TensorProto.FLOAT))
            term = cast_to
        if total is not None:
            added = out if last else sq + "/total"
            g.node.append(helper.make_node("Add", [total, term], [added], name=out if last else sq + "/add"))
            term = added
        total = term
    g.output.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, []))
    return out


def defaults_as_inputs(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """In place: every graph input that also has an initializer (its default, such as the learning rate's)
    loses the initializer and becomes a plain input; returns name -> the default's value, which the
    driver binds when the input is not fed. (onnxruntime warns about such inputs and will not fold them.)"""
    g = model.graph
    inputs = {i.name for i in g.input}
    moved = {t.name: numpy_helper.to_array(t) for t in g.initializer if t.name in inputs and not is_detached(t)}
    if moved:
        keep = [t for t in g.initializer if t.name not in moved]
        del g.initializer[:]
        g.initializer.extend(keep)
    return moved


# onnxruntime settings of the step's sessions unless the caller set them: the two parts of a step run
# one after the other, each in its own thread pool, and a pool spinning after its run takes the cores
# from the other's run (on 2 cores the step alternated between 2.7 and 7.9 ms); without spin-waiting
# the step holds steady, and on a busy machine it is several times faster.
SESSION_CONFIG = {"session.intra_op.allow_spinning": "0", "session.inter_op.allow_spinning": "0"}


_SHARED_ARENA = "session.use_env_allocators"
_arena_registered = False
BY_REQUEST = {"arena_extend_strategy": 1}  # kSameAsRequested (onnxruntime's default 0: next power of two)


def shared_cpu_arena(by_request: bool = False) -> None:
    """Register (once per process) one CPU memory arena that the sessions of every step share.

    Each onnxruntime session otherwise grows an arena of its own and never gives it back: the gradient
    part's (activations, gradients) and the update part's (the optimizer's temporaries) add up, where one
    arena serves both runs of a step in turn (BERT-base 8 x 64, Adam: 3023 -> 2679 MB after 3 steps).
    Sessions that do not ask for it (``session.use_env_allocators``) are not affected. The arena lives as
    long as the process and is reused by every later step session. ``by_request`` (the first step session
    is budgeted): it grows by what is asked, not by doubling regions; a budgeted step gives its free chunks
    back after every run and grows again, and doubled regions overshot its live bytes (docs/benchmarks.md)."""
    global _arena_registered
    if not _arena_registered:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        cfg = ort.OrtArenaCfg(BY_REQUEST if by_request else {})  # registering again is a no-op
        ort.create_and_register_allocator(info, cfg)
        _arena_registered = True


def _set_default(options: ort.SessionOptions, key: str, value: str) -> None:
    try:
        options.get_session_config_entry(key)
    except RuntimeError:  # not set by the caller
        options.add_session_config_entry(key, value)


def step_session_options(options: ort.SessionOptions, device: str = "cpu",
                         stored_order: bool = False) -> ort.SessionOptions:
    """``options`` (changed in place) for the sessions of a step: no memory pattern, no spin-waiting
    unless the caller asked for it, and on CPU one arena for both runs (``shared_cpu_arena``) unless the
    caller turned the arena off or chose otherwise. ``stored_order`` (a step planned under a memory
    budget): onnxruntime runs the nodes in their stored order (``PRIORITY_BASED``), the order the
    rematerialization plan was made for, unless the caller chose an order (its default order runs the
    weight gradients last and keeps what they read alive: docs/training_builder.md)."""
    if stored_order and options.execution_order == ort.ExecutionOrder.DEFAULT:
        options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    # onnxruntime's memory pattern keeps a second arena's worth of every intermediate after the
    # first run (measured on BERT-base: 5.1 GB -> 6.9 GB peak); a training step cannot afford it
    options.enable_mem_pattern = False
    for key, value in SESSION_CONFIG.items():
        _set_default(options, key, value)
    if device == "cpu" and options.enable_cpu_mem_arena:
        shared_cpu_arena(by_request=stored_order)
        _set_default(options, _SHARED_ARENA, "1")
    return options


def step_run_options(options: ort.SessionOptions, device: str, budgeted: bool) -> ort.RunOptions | None:
    """The run options of a step planned under a memory budget: the CPU arena gives its free chunks
    back after every run, so that every step grows it afresh in the order of the first.

    A step that finds the first step's chunks already there places its tensors in them by best fit, in
    another layout: a large tensor found no free block big enough and the arena grew again (BERT-base
    32 x 128 under a budget: 4191 MB after the first step, 5007 MB from the second on; given back,
    4216 MB at every step). The price is the page faults of taking the memory again: 1.6 s of system CPU
    time in a step of about 40 s of CPU time there, with no wall-time cost that shows (alternating A/B:
    20.4 vs 21.4 s), but a fifth of a small model's step (MLP, TransformerEncoderLayer), so a step
    without a budget keeps its chunks (docs/benchmarks.md)."""
    if not budgeted or device != "cpu" or not options.enable_cpu_mem_arena:
        return None
    run_options = ort.RunOptions()
    run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return run_options


class Run:
    """One onnxruntime session of the step (the gradient part or the apply part) and its binding.
    ``defaults``: the values of inputs the caller may leave out (the learning rate)."""

    def __init__(self, sess, io, inputs: list[str], outputs: list[str], check: str | None, what: str,
                 defaults: dict[str, ort.OrtValue]):
        self.sess, self.io, self.inputs, self.outputs, self.check, self.what = sess, io, inputs, outputs, check, what
        self.defaults = defaults
        self.frozen: dict[str, ort.OrtValue] = {}  # bound once; a binding does not keep their memory alive
        self.bound_inputs: dict[str, ort.OrtValue] = {}  # what each input is bound to (kept alive here too)
        self.bound_outputs: list[ort.OrtValue | None] | None = None  # ... each output (None: new memory)
        self.check_slot: ort.OrtValue | None = None  # on the host: where a step's run writes its check sum


def _raw_outputs(io: ort.IOBinding) -> list:
    """The outputs of the last run with ``io``, as onnxruntime's own values: ``IOBinding.get_outputs`` wraps
    every one in a Python OrtValue (tens of microseconds a run), where the step wraps only those it did
    not bind to an OrtValue of its own. Index it (a copy of the value); iterating it gives views of the
    binding's own slots, which the next run's binding overwrites."""
    raw = getattr(io, "_iobinding", None)
    return raw.get_outputs() if raw is not None else [v._ortvalue for v in io.get_outputs()]


def prepare_run(part: onnx.ModelProto, what: str, checked: list[str], state_names: set[str],
                options: ort.SessionOptions, device: Device, frozen_value: Callable[[str], ort.OrtValue],
                frozen_array: Callable[[str], np.ndarray] | None = None) -> Run:
    """An onnxruntime session for ``part`` on ``device`` (changed in place: weights become inputs, the check
    sum an output) with its frozen weights bound once, from ``frozen_value(name)``; the ones a kernel needs as
    constants stay initializers with the values of ``frozen_array(name)``. Input defaults (a learning rate's)
    are put on the device once."""
    # onnxruntime makes no OrtValue of a packed type (int4, ...) from numpy: those stay initializers as well
    packed = {t.name for t in part.graph.initializer if is_detached(t) and is_packed(t.data_type)}
    constants = (constant_inputs(part.graph) | packed) - state_names
    kept = keep_constants(part, constants, frozen_array or (lambda name: frozen_value(name).numpy()), options) \
        if constants else []
    frozen = inputs_for_weights(part, state_names, constants)
    defaults = {k: to_device(v, device.name, device.device_id) for k, v in defaults_as_inputs(part).items()}
    check = add_sum_of_squares(part, checked, f"{CHECK}/{what}") if checked else None
    sess = device.session(part.SerializeToString(), options)
    del kept  # onnxruntime has copied them
    io = sess.io_binding()
    bound = {name: frozen_value(name) for name in frozen}
    for name, value in bound.items():
        io.bind_ortvalue_input(name, value)
    run = Run(sess, io, [i.name for i in part.graph.input if i.name not in frozen],
              [o.name for o in part.graph.output], check, what, defaults)
    run.frozen = bound
    return run


def bind_feeds(feeds: dict, state: Mapping, keep: list, required: list[str],
               device: Device | None = None, cache: dict | None = None) -> dict[str, ort.OrtValue]:
    """name -> OrtValue of the user's feeds on ``device`` (on the CPU arrays are wrapped without a copy;
    ``keep`` holds them alive for the run); a feed naming a mutable tensor or a non-finite scalar is
    refused. ``cache`` (a session's, on the CPU): the OrtValues of earlier steps serve again (``_cached_feed``),
    so a step that is fed the same arrays binds nothing again."""
    device = device or Device()
    reuse = cache is not None and device.on_host
    bound = {}
    for name, value in feeds.items():
        if name in state:
            raise ValueError(f"{name!r} is a mutable tensor of the model; set it with set_state, not as a feed")
        if isinstance(value, ort.OrtValue):
            bound[name] = value
            continue
        # through an OrtValue (a view of the array on CPU): bind_cpu_input cannot bind an input
        # that has an initializer default, such as a learning rate with a default value
        arr = c_array(value)
        if arr.size == 1 and arr.dtype.kind == "f" and not math.isfinite(arr.item()):
            raise ValueError(f"feed {name!r} is {arr.reshape(-1)[0]}; a scalar such as a learning rate "
                             "must be a finite number")
        if reuse:
            bound[name] = _cached_feed(cache, name, value, arr)
            continue
        keep.append(arr)
        bound[name] = to_device(arr, device.name, device.device_id)
    missing = [n for n in required if n not in feeds]
    if missing:
        raise ValueError(f"step() needs feeds for {missing}")
    return bound


def _cached_feed(cache: dict, name: str, value, arr: np.ndarray) -> ort.OrtValue:
    """The host OrtValue of feed ``name`` (``arr``, made from the user's ``value``), from ``cache`` where one
    serves: a one-element feed (a learning rate, a bias correction) is copied into a buffer of ours that one
    OrtValue views; the same array object as at the last step, unchanged in shape and type and not copied by
    ``c_array``, is the memory its OrtValue already views (what the user wrote into it since is what the
    run reads). Making an OrtValue and binding it cost tens of microseconds each; the cache holds the last
    array of every feed alive."""
    hit = cache.get(name)
    if arr.size == 1:
        if hit is not None and hit[0] is None and hit[1].shape == arr.shape and hit[1].dtype == arr.dtype:
            hit[1][...] = arr
            return hit[2]
        own = arr.copy()
        cache[name] = (None, own, ort.OrtValue.ortvalue_from_numpy(own))
        return cache[name][2]
    if hit is not None and hit[0] is value and arr is value and hit[1].shape == arr.shape \
            and hit[1].dtype == arr.dtype:
        return hit[2]
    cache[name] = (value if arr is value else None, arr, ort.OrtValue.ortvalue_from_numpy(arr))
    return cache[name][2]


def run_initialization(init_models: list, state: StateBuffers, options: ort.SessionOptions, device: Device) -> None:
    """Run every initialization graph and set the state its initialization_binding names."""
    for init in init_models:
        if init is None:
            continue
        binding = metadata.read_json(init, metadata.INITIALIZATION_BINDING)
        m = onnx.ModelProto()
        m.CopyFrom(init)
        constants = constant_inputs(m.graph)
        kept = keep_constants(m, constants, state.array, options)
        fed = inputs_for_weights(m, set(), constants)
        sess = device.session(m.SerializeToString(), options)
        del kept  # onnxruntime has copied them
        wanted = [v for key, v in binding.items() if key in state.values]
        feeds = {n: state.array(n) for n in fed}
        values = dict(zip(wanted, sess.run(wanted, feeds))) if wanted else {}
        for key, v in binding.items():
            if key in state.values:
                state.set(key, values[v])


@dataclass
class StepRuns:
    """The runs of a step (``open_runs``) over the state ``buffers`` on ``device``: ``runs`` (the gradient part,
    then the apply part), the gradients the first computes (``grad_names``, with ``grad_shapes``: gradient -> its
    parameter, for buffers of its shape), ``key_of``: a bound output -> the one state key it updates;
    ``buffered``: those keys. ``feed_cache``: the OrtValues of the feeds (``bind_feeds``)."""

    runs: list[Run]
    grad_names: list[str]
    grad_shapes: dict[str, str]
    key_of: dict[str, str]
    buffered: set[str]
    buffers: StateBuffers
    device: Device
    run_options: ort.RunOptions | None = None
    grad_buffers: dict[str, ort.OrtValue] | None = None
    feed_cache: dict = field(default_factory=dict)

    def execute(self, run: Run, bound: dict, values: dict, targets: dict | None,
                into: Mapping[str, ort.OrtValue] | None = None) -> None:
        """One onnxruntime run of the step; an output that is the new value of a buffered state tensor
        goes into its buffer (listed in ``targets``), one named in ``into`` into that OrtValue, the check sum
        of a step (``targets`` given) on the host into the run's ``check_slot``, the others into new memory;
        all are listed in ``values``. What stayed bound since the last run (state updated in place, the
        gradient buffers, the check slot) is not bound again, and without an output in new memory no output
        is fetched from onnxruntime."""
        io, state, last = run.io, self.buffers.values, run.bound_inputs
        for name in run.inputs:
            value = bound.get(name)
            if value is None:
                value = state.get(name)
                if value is None:
                    value = values.get(name, run.defaults.get(name))
            if value is not None and last.get(name) is not value:
                io.bind_ortvalue_input(name, value)
                last[name] = value
        wanted: list[ort.OrtValue | None] = []  # None: new memory onnxruntime allocates
        for name in run.outputs:
            key = self.key_of.get(name)
            if into is not None and name in into:
                wanted.append(into[name])
            elif key is not None and targets is not None:
                targets[key] = self.buffers.output_buffer(key)
                wanted.append(targets[key])
            elif name == run.check and targets is not None and self.device.on_host:
                wanted.append(self.check_slot(run))
            else:
                wanted.append(None)
        self._bind_outputs(run, wanted)
        run.sess.run_with_iobinding(io, self.run_options)
        got = _raw_outputs(io) if any(w is None for w in wanted) else ()
        for k, (name, mine) in enumerate(zip(run.outputs, wanted)):
            values[name] = mine if mine is not None else ort.OrtValue(got[k])

    @staticmethod
    def check_slot(run: Run) -> ort.OrtValue:
        """The float scalar of ours that a step's run writes its check sum into (it is read before the next
        run: ``check_outputs``); new memory at every run would be bound and fetched again each time."""
        if run.check_slot is None:
            run.check_slot = ort.OrtValue.ortvalue_from_shape_and_type([], np.float32, "cpu", 0)
        return run.check_slot

    def _bind_outputs(self, run: Run, wanted: list) -> None:
        """Bind ``run``'s outputs (in ``run.outputs``' order, the order onnxruntime returns them in) to
        ``wanted``. An output bound to new memory is bound again at every run (else onnxruntime writes the
        next result into the memory the last one returned); one bound to an OrtValue stays bound while it
        is the same OrtValue."""
        io, last = run.io, run.bound_outputs
        if last is None:
            io.clear_binding_outputs()
        for k, (name, value) in enumerate(zip(run.outputs, wanted)):
            if value is None:
                io.bind_output(name, self.device.name, self.device.device_id)
            elif last is None or last[k] is not value:
                io.bind_ortvalue_output(name, value)
        run.bound_outputs = wanted

    def gradient_buffers(self) -> dict[str, ort.OrtValue]:
        """One buffer per gradient of a parameter, allocated at the first step and written by every step:
        new gradient memory at each step would churn the arena, which then grows step after step."""
        if self.grad_buffers is None:
            b, d = self.buffers, self.device
            self.grad_buffers = {
                g: ort.OrtValue.ortvalue_from_shape_and_type(list(b.shapes[p]), helper.tensor_dtype_to_np_dtype(
                    b.dtypes[p]), d.name, d.device_id) for g, p in self.grad_shapes.items()}
        return self.grad_buffers


def open_runs(step_model: onnx.ModelProto, gradients: dict[str, list[str]], binding: dict[str, str],
              loss: str | None, buffers: StateBuffers, options: ort.SessionOptions, device: Device,
              in_place: bool, check_gradients: bool, run_options: ort.RunOptions | None = None) -> StepRuns:
    """Two runs: the gradient part (loss, gradients) and the apply part (the update). Between them the
    loss and the gradients are checked for NaN/Inf, so a failed step changes no state; in the apply
    part a tensor whose only readers come before its update is updated in place (``buffers.inplace``)."""
    produced = {o for n in step_model.graph.node for o in n.output}
    grad_names = [n for n in gradients["gradients"] if n in produced]
    first_outputs = grad_names + ([loss] if loss and grad_names else [])
    first, second, _ = split_step_model(step_model, first_outputs)
    param_of = dict(zip(gradients["gradients"], gradients["parameters"]))
    grad_shapes = {g: param_of[g] for g in grad_names if param_of.get(g) in buffers.shapes}
    params = set(gradients["parameters"]) & set(binding) or {
        k for k in binding if buffers.dtypes.get(k) in FLOAT_TYPES}
    counts = Counter(binding.values())
    key_of = {v: k for k, v in binding.items() if counts[v] == 1}
    runs: list[Run] = []
    updated = [binding[k] for k in binding if k in params]
    for part, (what, checked) in ((first, ("gradients", grad_names if check_gradients else [])),
                                  (second, ("update", updated))):
        if part is None:
            continue
        if part is second and in_place:
            buffers.inplace = in_place_keys(part.graph, key_of)
        made = {o for n in part.graph.node for o in n.output}
        runs.append(prepare_run(part, what, [n for n in checked if n in made], set(buffers.names), options,
                                device, lambda name: buffers.ortvalue(buffers.array(name)), buffers.array))
    return StepRuns(runs, grad_names, grad_shapes, key_of, set(key_of.values()), buffers, device, run_options)


def _finite(arr: np.ndarray) -> bool:
    """No NaN/Inf in a float array (a one-element one read as a Python number: numpy's reductions cost
    microseconds even on a scalar); arrays of other types are finite."""
    if arr.dtype.kind != "f":
        return True
    return math.isfinite(arr.item()) if arr.size == 1 else bool(np.isfinite(arr).all())


def check_outputs(values: dict, run: Run, step: int, state_kept: bool, outputs: list[str], loss: str | None,
                  binding: dict[str, str], buffered: set[str]) -> dict[str, np.ndarray]:
    """NaN/Inf in the loss, the other ``outputs`` of ``run`` or its check sum stops the step
    (``TrainingDivergedError``, naming a buffered state tensor the update made non-finite). Returns the
    outputs it read to the host (each is read once: the step returns them)."""
    names = [n for n in outputs if n in run.outputs]
    read = {}
    for name in sorted(names, key=lambda n: n != loss):
        arr = read[name] = to_host(values[name])
        if not _finite(arr):
            raise TrainingDivergedError(name, step, state_kept=state_kept)
    if run.check and not _finite(to_host(values[run.check])):
        if run.what == "update":
            for key, value in binding.items():
                if value in values and key in buffered:
                    if not _finite(to_host(values[value])):
                        raise TrainingDivergedError(value, step, key, state_kept=state_kept)
        raise TrainingDivergedError(f"the {run.what}", step, state_kept=state_kept)
    return read


__all__ = ["Run", "StepRuns", "open_runs", "check_outputs", "prepare_run", "step_session_options", "step_run_options",
           "defaults_as_inputs", "bind_feeds", "run_initialization", "inputs_for_weights", "add_sum_of_squares",
           "CHECK", "SESSION_CONFIG"]
