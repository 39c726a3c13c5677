"""``TrainingSession``: run a training-spec model with stock onnxruntime.

The step is made once (``step.py``: the model lowered as a light model, ``weights.py``: no tensor bytes inside
the protobuf, then split into a step model and initialization models, ``step_model.py``) and driven by a small
loop. onnxruntime gets a weight-free model per part of the
step (``runs.py``): every mutable tensor (a key of the bindings) and every large frozen weight is a graph
input, bound with IOBinding from OrtValues (frozen weights straight from their arrays, memory-mapped when
the model came from a file). The mutable tensors live in ``state.py``'s buffers: the step reads one and
writes the other (or the same one, when the update may run in place), so a step allocates no state and
copies none to numpy unless asked. Checkpoints and inference models are written by ``export.py``.

A step is checked for NaN/Inf through the loss and one global sum of squares of the gradients (of the
updated tensors when the gradients cannot be named); a step that fails the check changes no state.

``gradients`` and ``apply_gradients`` are the two halves of ``step``: between them ``accumulate.py`` sums
the gradients of micro-batches and ``distributed.py`` those of other processes.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import onnx
import onnxruntime as ort

from ..errors import TrainingDivergedError, TrainingSpecError
from ..graph import FLOAT_TYPES
from ..model import metadata as md
from ..model.io import EXTERNAL_DATA_THRESHOLD, save_model_atomic
from ..model.weights import attach_weights
from ..ort_options import session_options as quiet_session_options
from . import export
from .checkpoint import TrainState
from .devices import resolve_device
from .fit import fit, run_epoch
from .forward_check import check_feeds, forward_check
from .kv_cache import cache_names, made_inputs
from .progress import stage
from .runs import Run, bind_feeds, check_outputs, open_runs, run_initialization, step_run_options, step_session_options
from .state import StateBuffers, TrainingState, c_array, to_host
from .step import Step, open_step
from .step_model import gradient_names, host_scalar_value


def _check_given(step: Step, target: str | None, **making) -> None:
    """A ``Step`` given to a session is made already: for the session's target, in the session's form."""
    given = [k for k, v in making.items() if v not in (None, 0)]
    if given:
        raise TrainingSpecError(f"{given} make a step, and this Step is made: pass them to open_step(model, ...) "
                                "and its Step to TrainingSession")
    if step.plain:
        raise TrainingSpecError("this Step is a bundle's (assemble(..., plain=True): no input keeps a default); a "
                                "session runs open_step(model, ...)")
    if step.target != target:
        raise TrainingSpecError(f"this Step was assembled for target {step.target!r}, and the session's device "
                                f"runs target {target!r}: open_step(model, target={target!r})")


class TrainingSession:
    """Train a model that carries a TrainingInfoProto with onnxruntime.

    ``TrainingSession(model_or_path, providers=None, index=0)`` starts from the stored initializers
    (a checkpoint written by ``save`` resumes where it stopped); call ``reset()`` to run the
    initialization graphs instead. ``step(feeds)`` runs ``training_info[index].algorithm`` once.
    A path is the lean way in: its external data is memory-mapped, not read into protobuf messages.
    ``weights`` gives the arrays of a light model's detached tensors (see ``onnx_autodiff.model.weights``).
    ``in_place=False`` gives every updated tensor two buffers instead of updating the ones whose
    readers all run before their update in place (same results, more memory; for checking).
    ``progress``: steps of the set-up that take over a second say so on stderr.
    ``outputs``: the step outputs that ``step`` computes and returns (the loss is always among them);
    default every output of the step, the inference model's included. Name only what you read: an
    output left out is freed as soon as the step is done with it (a language model's logits, [B, S, V]).
    A step that finds NaN/Inf in the loss or the gradients changes no state; one that finds it only in
    the update says whether tensors updated in place already hold it (``TrainingDivergedError.state_kept``).
    ``providers``: onnxruntime's, as for ``InferenceSession``; on a device (``"CUDAExecutionProvider"``,
    ``"WebGpuExecutionProvider"``: the WebGPU plugin EP, ``driver/devices.py``) the weights, the optimizer state
    and the gradients live in device memory from the start, and a step copies only the batch and the
    hyper-parameters there and the outputs it returns (and the NaN checks, two scalars) back. ``dims``: sizes
    for symbolic dims (``{"N": 32}``): the step then takes batches of that size only and computes no shapes
    at run time (on WebGPU, no node is left to the CPU).
    ``check_forward``: the first step also runs the step's forward as a plain onnxruntime model and stops
    with ``ForwardMismatchError`` unless the loss and the inference outputs it returns agree
    (``forward_check.py``): ``"auto"`` (default) where a kernel outside standard ONNX (MatMulNBits, ...) reads a
    weight the step feeds at run time, ``True`` always, ``False`` never. A decoder's KV cache
    (``past_key_values.*``) is fed empty unless given and its present outputs are not returned unless named in
    ``outputs`` (``kv_cache.py``).

    Making the step and running it are two halves: ``model_or_path`` may be a ``Step`` already made
    (``driver/step.py``: ``open_step(model_or_path, target, index, weights=, base_path=, dims=)``, or ``assemble``),
    and then only the running options apply (``providers``, ``session_options``, ``loss``, ``in_place``,
    ``progress``, ``outputs``, ``check_forward``). The session owns the Step it runs (it may drop step outputs
    nobody reads): make one per session.
    """

    def __init__(self, model_or_path, providers=None, index: int = 0, *,
                 session_options: ort.SessionOptions | None = None, loss: str | None = None,
                 weights: Mapping | None = None, in_place: bool = True, progress: bool = True,
                 base_path: str | os.PathLike | None = None, outputs: list[str] | None = None,
                 check_forward: bool | str = "auto", dims: Mapping[str, int] | None = None):
        if check_forward not in (True, False, "auto"):
            raise ValueError(f"check_forward={check_forward!r}: give True, False or 'auto'")
        self._device = resolve_device(providers)
        self.device, self.device_id = self._device.name, self._device.device_id
        self.providers = self._device.providers
        if isinstance(model_or_path, Step):
            step = model_or_path
            _check_given(step, self._device.target, index=index, weights=weights, base_path=base_path, dims=dims)
        else:
            step = open_step(model_or_path, self._device.target, index, weights=weights, base_path=base_path,
                             dims=dims, cpu=self.device == "cpu", progress=progress)
        self._start(step, session_options, loss, outputs)
        self._check_forward = check_forward
        with stage("opening onnxruntime sessions", enabled=progress):
            self._plan = open_runs(self.step_model, step.gradients, self.update_binding, self.loss_name,
                                   self._buffers, self._options, self._device, in_place, self._checks_gradients,
                                   self._run_options)
        self._runs, self._key_of = self._plan.runs, self._plan.key_of
        self._buffers.load_stored()

    # ---- setup -----------------------------------------------------------------------------------
    def _start(self, step: Step, session_options, loss: str | None, outputs: list[str] | None) -> None:
        """The session's view of ``step``: its models and names, the state buffers (not loaded yet), the
        onnxruntime options, what ``step()`` is fed and returns."""
        self._step = step
        self.model, self.step_model, self.init_models = step.light.proto, step.model, step.init_models
        self.index, self.host_scalars, self.update_binding = step.index, step.host_scalars, step.binding
        self.base_path = step.base_path
        stored = md.read(self.model)
        self.steps = int(stored.get(md.STEPS, 0))
        self.train_state = TrainState.from_metadata(stored)  # fit's state, when this is one of its checkpoints
        budgeted = md.MEMORY_BUDGET in stored
        self._options = self._device.add_to(step_session_options(
            quiet_session_options() if session_options is None else session_options, self.device,
            stored_order=budgeted))
        self._run_options = step_run_options(self._options, self.device, budgeted)
        inits = {t.name: t for t in self.step_model.graph.initializer}
        names = step.state
        self._buffers = StateBuffers(self.model, dict(step.light.arrays), names, {n: inits[n].data_type for n in names},
                                     {n: tuple(inits[n].dims) for n in names}, self.device, self.device_id,
                                     step.light.private, step.reload)
        self._buffers.mirrored = {spec["counter"] for spec in self.host_scalars.values()}
        state_values = set(self.update_binding.values())
        self.output_names = [o.name for o in self.step_model.graph.output if o.name not in state_values]
        # inputs step() needs; an input with an initializer default (a learning rate) may be fed or not
        self.feed_names = [i.name for i in self.step_model.graph.input
                           if i.name not in set(names) and i.name not in inits and i.name not in self.host_scalars]
        self.loss_name = loss if loss is not None else step.loss
        presents = cache_names(self.model.graph)[1]
        # a decoder's empty KV cache, its position_ids and a merged decoder's cache switch (its no-cache branch)
        self._made = made_inputs(self.model, self.feed_names)
        made = set(self._made.names)
        self.feed_names = [n for n in self.feed_names if n not in made]
        scaling = (md.read_json(self.model, md.PRECISION) or {}).get("loss_scale") or {}
        # dynamic loss scaling: a step whose gradients overflow is skipped by the step itself (not a divergence);
        # it reports the scale it used and whether it skipped
        self.scaled_outputs = [n for n in scaling.get("outputs", []) if n in self.output_names]
        self._checks_gradients = not scaling.get("dynamic", False)
        if outputs is None and presents:
            outputs = [n for n in self.output_names if n not in presents]
        if outputs is not None:
            step.keep_outputs(list(outputs) + self.scaled_outputs, self.loss_name)
            self.output_names = [n for n in self.output_names if n in {o.name for o in self.step_model.graph.output}]

    # ---- state -----------------------------------------------------------------------------------
    @property
    def state(self) -> TrainingState:
        return TrainingState(self._buffers)

    @property
    def metadata(self) -> dict[str, str]:
        """The model's ``metadata_props`` as loaded (a checkpoint's extra metadata included)."""
        return {p.key: p.value for p in self.model.metadata_props}

    def get_state(self, name: str) -> np.ndarray:
        """A numpy copy of one mutable tensor (OrtValue.numpy() is a view of memory a step updates in place)."""
        return self._buffers.get(name)

    def get_ortvalue(self, name: str) -> ort.OrtValue:
        """The OrtValue holding one mutable tensor, without a copy. It holds this value until the next
        step; the step after that reuses its memory (copy it with ``.numpy()`` to keep it)."""
        return self._buffers.value(name)

    def set_state(self, name: str, value) -> None:
        """Replace one mutable tensor; the shape and element type must stay the same."""
        self._buffers.set(name, value)

    def reset(self) -> None:
        """Restore every mutable tensor to the initializer stored in the model, then run every
        initialization graph and apply its initialization_binding (the spec's initialization step)."""
        self._buffers.load_stored()
        run_initialization(self.init_models, self._buffers, self._options, self._device)
        self.steps = 0

    # ---- running ---------------------------------------------------------------------------------
    def _bind_feeds(self, feeds: dict, keep: list, required: list[str] | None = None) -> dict[str, ort.OrtValue]:
        """The user's feeds and the host scalars (bias corrections) of this step, as OrtValues on the device."""
        computed = [n for n in feeds if n in self.host_scalars]
        if computed:
            raise ValueError(f"{computed} are computed by the session from the step count (host scalars of "
                             "the optimizer); feed only the batch and the hyper-parameters")
        counters = self._buffers.host_values
        scalars = {n: host_scalar_value(spec, counters[spec["counter"]]) for n, spec in self.host_scalars.items()}
        return bind_feeds({**self._made.fill(feeds), **scalars}, self._buffers.values, keep,
                          self.feed_names if required is None else required, self._device, self._plan.feed_cache)

    def _first_forward(self, bound: dict):
        """At the session's first step: the check of its forward and the reference values (else None); on a
        device, the reference runs there too (its state read back once)."""
        if not self._check_forward:
            return None
        auto, self._check_forward = self._check_forward == "auto", False
        fed = set(self._buffers.names).union(*(run.frozen for run in self._runs)) if auto else None
        check = forward_check(self.step_model, self.loss_name, self.output_names,
                              {o.name for o in self.model.graph.output}, self.providers,
                              lambda: self._device.add_to(quiet_session_options()), fed)
        if check is None:
            if auto:  # no reference: the first batch is still checked, as the reference's run does
                check_feeds({n: v for n, v in bound.items() if n in self.feed_names})
            return None
        defaults = {k: v for run in self._runs for k, v in run.defaults.items()}
        state = set(self._buffers.names)
        expected = check.run({**defaults, **bound}, lambda name: to_host(self._buffers.values[name])
                             if name in state else self._buffers.array(name), state)
        return check, expected

    def step(self, feeds: dict) -> dict[str, np.ndarray]:
        """Run one training step; returns the step graph's outputs that are not bound to state."""
        keep: list = []
        bound = self._bind_feeds(feeds, keep)
        step = self.steps + 1
        values: dict[str, ort.OrtValue] = {}
        targets: dict[str, ort.OrtValue] = {}
        read: dict[str, np.ndarray] = {}
        reference = self._first_forward(bound)
        for run in self._runs:
            into = self._plan.gradient_buffers() if run.what == "gradients" else None
            self._plan.execute(run, bound, values, targets, into)
            if reference is not None:
                reference[0].compare(reference[1], {n: values[n] for n in run.outputs}, step)
            written = any(buf is self._buffers.values[key] for key, buf in targets.items())
            read.update(self._check_outputs(values, run, step, state_kept=not written))
        return self._commit(values, targets, read)

    def _commit(self, values: dict, targets: dict, read: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Make the new values the state (swapping buffers) and count the step; returns the outputs (``read``:
        those already on the host, read by the NaN checks)."""
        reused = self._plan.grad_buffers or {}
        result = {}
        for n in self.output_names:
            arr = read[n] if n in read else to_host(values[n])
            result[n] = arr.copy() if n in reused and self._device.on_host else arr  # a view of a buffer we reuse
        buffers = self._buffers
        current = buffers.values
        for key, value in self.update_binding.items():
            new = targets.get(key)
            if new is None:
                buffers.take(key, values[value])
            elif new is not current[key]:  # updated in place: already the state
                buffers.commit(key, new)
        for counter in self._buffers.mirrored:
            self._buffers.host_values[counter] += 1
        self.steps += 1
        return result

    # ---- a step in two halves: the seam of gradient accumulation and data parallelism --------------
    # step(feeds) == apply_gradients(gradients(feeds), feeds). Between the halves the outputs named in
    # ``averaged_outputs`` may be replaced by a weighted sum over micro-batches (``accumulate.py``) or
    # over processes (``distributed.py``); everything else passes through unchanged.
    def _gradient_run(self) -> Run:
        if len(self._runs) < 2 or self._runs[0].what != "gradients":
            raise TrainingSpecError("this model's step has no separate gradient part (its Gradient outputs are not "
                                    "named in the lowered model), so gradients cannot be accumulated or averaged "
                                    "across processes; build it with make_training_model")
        return self._runs[0]

    @property
    def update_inputs(self) -> list[str]:
        """The inputs the update half of a step reads (``apply_gradients``): the outputs of ``gradients`` among
        them must be combined or agree between micro-batches (``accumulate.py``)."""
        self._gradient_run()
        return list(dict.fromkeys(i for r in self._runs[1:] for i in r.inputs))

    @property
    def averaged_outputs(self) -> list[str]:
        """The outputs of ``gradients`` that a combined step averages: the gradients, the loss, the NaN
        check sum, and new values of float state the gradient part computes (BatchNorm running statistics).
        The other outputs are the same for every micro-batch (constants) or are only reported."""
        run = self._gradient_run()
        state_values = {v for k, v in self.update_binding.items() if self._buffers.dtypes.get(k) in FLOAT_TYPES}
        wanted = set(self._plan.grad_names) | {self.loss_name, run.check} | state_values
        return [n for n in run.outputs if n in wanted]

    def gradients(self, feeds: dict, into: Mapping[str, ort.OrtValue] | None = None) -> dict[str, ort.OrtValue]:
        """The first half of a step: the gradient part's outputs on ``feeds`` (the loss, the gradients, new
        non-parameter state such as BatchNorm statistics, the NaN check sum) as OrtValues. No state changes.
        ``into``: OrtValues of the right shape and type that the named outputs are written into instead of
        new memory (the flat buffers the all-reduce reads, so the gradients are not copied there)."""
        run = self._gradient_run()
        keep: list = []
        values: dict[str, ort.OrtValue] = {}
        bound = self._bind_feeds(feeds, keep)
        reference = self._first_forward(bound)
        self._plan.execute(run, bound, values, None, into)
        if reference is not None:
            reference[0].compare(reference[1], values, self.steps + 1)
        return values

    def apply_gradients(self, values: Mapping, feeds: dict) -> dict[str, np.ndarray]:
        """The second half of a step: check ``values`` (every output of ``gradients``, as OrtValues or arrays,
        possibly averaged) for NaN/Inf, run the update, and make it the state. ``feeds`` needs only what the
        update reads (the learning rate). Returns the step's outputs, as ``step`` does."""
        run, rest = self._gradient_run(), self._runs[1:]
        missing = [n for n in run.outputs if n not in values]
        if missing:
            raise ValueError(f"apply_gradients needs every output of gradients(); missing {missing}")
        keep: list = []
        needed = {i for r in rest for i in r.inputs}
        bound = self._bind_feeds({k: v for k, v in feeds.items() if k in needed}, keep,
                                 required=[n for n in self.feed_names if n in needed])
        given: dict[str, ort.OrtValue] = {}
        for name in run.outputs:
            v = values[name]
            if not isinstance(v, ort.OrtValue):
                arr = np.array(v) if name in self._key_of else c_array(v)  # new state: our own copy
                keep.append(arr)
                v = self._buffers.ortvalue(arr)
            given[name] = v
        step = self.steps + 1
        read = self._check_outputs(given, run, step, state_kept=True)
        targets: dict[str, ort.OrtValue] = {}
        for r in rest:
            self._plan.execute(r, bound, given, targets)
            written = any(buf is self._buffers.values[key] for key, buf in targets.items())
            read.update(self._check_outputs(given, r, step, state_kept=not written))
        return self._commit(given, targets, read)

    def _check_outputs(self, values: dict, run: Run, step: int, state_kept: bool) -> dict[str, np.ndarray]:
        return check_outputs(values, run, step, state_kept, self.output_names, self.loss_name, self.update_binding,
                             self._plan.buffered)

    def train(self, batches, epochs: int = 1, callback: Callable | None = None, progress: bool = True) -> list:
        """Run ``step`` over ``batches`` (an iterable of feed dicts, or a callable returning one per
        epoch) ``epochs`` times. ``callback(step, outputs)`` runs after each step; returning False stops.
        A one-line progress bar with the loss goes to stderr. Returns the loss of every step. ``fit`` does
        the batching, shuffling, learning rate and checkpoints for arrays."""
        losses: list = []
        stopped = False

        def until_false(step, out):
            nonlocal stopped
            stopped = callback(step, out) is False
            return not stopped

        for epoch in range(epochs):
            data = batches() if callable(batches) else batches
            if epoch and isinstance(data, Iterator):
                raise ValueError("batches is an iterator and was used up by the first epoch; pass a list or "
                                 "a callable returning a fresh iterable")
            losses += self.run_epoch(data, f"epoch {epoch + 1}/{epochs}", progress=progress,
                                     callback=until_false if callback is not None else None)
            if stopped:
                break
        return losses

    def run_epoch(self, batches, desc: str = "epoch", *, callback: Callable | None = None, progress: bool = True,
                  total: int | None = None, step: Callable | None = None,
                  tokens: Callable[[dict], int] | None = None) -> list:
        """``step`` over every feed dict of ``batches`` with one progress line ``desc``; the loss of every
        step (None without a loss output). ``callback(step, outputs)`` returning False stops early. The
        one loop over steps: ``train``, ``fit``, the ``train`` command and the demo run it. ``step``: what runs
        one batch instead of ``self.step`` (``accumulate.SplitStep.step``: micro-batches, several processes).
        ``tokens(feeds)``: the tokens of a batch, for a tokens/s rate in the progress line."""
        return run_epoch(self, batches, desc, callback=callback, progress=progress, total=total, step=step,
                         tokens=tokens)

    def fit(self, data: Mapping[str, np.ndarray], batch_size: int = 32, epochs: int = 1, *,
            checkpoint=None, seed: int = 0, shuffle: bool = True, lr=None, progress: bool = True,
            log: Callable[[str], None] | None = None, on_epoch: Callable | None = None,
            callback: Callable | None = None, **run) -> TrainState:
        """Train on arrays for ``epochs`` epochs in batches of ``batch_size``; returns the training state
        (epochs done, steps, the mean loss of every epoch).

        ``data``: arrays named after the step's inputs, or ``X`` (the first model input) and ``y`` (the
        label), samples on the first axis; checked (dtype, shape, finite, class labels in range) before the
        first step. ``shuffle``: epoch ``e`` visits the samples in the order ``default_rng([seed, e])`` gives.
        ``lr``: the learning rate fed at every step, a number or a schedule ``lr(steps_done)`` (default: what
        ``make_training_model`` recorded). ``checkpoint``: a directory; after every epoch
        ``DIR/checkpoint.onnx`` holds the weights, the optimizer state and the training state, and a later
        ``fit`` with the same directory, model, data and order continues from it (a killed run loses at most
        the epoch under way). ``log``: where the one-line messages go (default: the ``onnx_autodiff`` logger).
        ``on_epoch(state)`` runs after each epoch (returning False stops), ``callback(step, outputs)`` after
        each step."""
        return fit(self, data, batch_size, epochs, checkpoint=checkpoint, seed=seed, shuffle=shuffle, lr=lr,
                   progress=progress, log=log, on_epoch=on_epoch, callback=callback, **run)

    def load_checkpoint_state(self, model: onnx.ModelProto, weights: Mapping | None = None) -> None:
        """Set every mutable tensor and the step count from a checkpoint of this model (``save`` wrote it;
        a light model and its weights, or a whole model)."""
        self.steps, self.train_state = export.load_checkpoint_state(self._buffers, model, weights)

    # ---- saving (export.py) ----------------------------------------------------------------------
    def checkpoint(self, metadata: dict[str, str] | None = None) -> onnx.ModelProto:
        """The lowered model with every mutable initializer set to the current state, training_info kept;
        ``metadata`` entries are added to (or replace) its ``metadata_props``. A whole ModelProto: for a
        model near protobuf's 2 GiB limit use ``save``, which streams the tensors to an external-data file."""
        return export.checkpoint_model(self._step, self._buffers, self.steps, metadata)

    def save(self, path, external_data_threshold: int = EXTERNAL_DATA_THRESHOLD, *,
             metadata: dict[str, str] | None = None) -> None:
        """Write a checkpoint atomically; ``TrainingSession(path)`` resumes from it exactly. ``metadata``
        (str -> str) is stored in the checkpoint's ``metadata_props``, replaced together with the weights.
        Tensors go to an external-data file beside it once they exceed ``external_data_threshold`` bytes.
        With LoRA adapters and a session opened from a file (or given ``base_path``), the frozen weights are
        referenced in that file, not copied: the checkpoint holds the adapters and their optimizer state."""
        export.save_checkpoint(self._step, self._buffers, self.steps, path, external_data_threshold, metadata)

    def inference_model(self, eval_mode: bool = True, adapters: str = "merged") -> onnx.ModelProto:
        """ModelProto.graph with the trained weights and no training_info; with ``eval_mode``,
        training-mode BatchNormalization/Dropout nodes switch to inference behaviour. LoRA adapters
        (``make_training_model(lora=...)``) are ``"merged"`` into their weights (W + B A alpha/rank), or
        with ``"inputs"`` stay beside them as graph inputs whose defaults are zero (the base model), the
        form onnxruntime's ``LoraAdapter`` files feed (``onnx-autodiff export-adapter``)."""
        m, tensors = export.inference_light(self._step, self._buffers, eval_mode, adapters)
        attach_weights(m, tensors)
        return m

    def export_inference(self, path, external_data_threshold: int = EXTERNAL_DATA_THRESHOLD,
                         eval_mode: bool = True, adapters: str = "merged") -> None:
        """Write ``inference_model(eval_mode, adapters)`` atomically; stock onnxruntime loads it."""
        m, tensors = export.inference_light(self._step, self._buffers, eval_mode, adapters)
        save_model_atomic(m, path, external_data_threshold, weights=tensors)


__all__ = ["TrainingSession", "TrainingState", "TrainingDivergedError", "gradient_names"]
