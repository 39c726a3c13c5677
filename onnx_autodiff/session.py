"""``TrainingSession``: run a training-spec model with stock onnxruntime.

The model is lowered once (plain ONNX, ``training_info`` kept), split into a step model and
initialization models (see ``step_model.py``), and driven by a small loop. The mutable state (every
key of the bindings) lives in OrtValues between steps and is bound with IOBinding, so no tensor is
copied to numpy unless the caller asks for it.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, MutableMapping
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from .errors import TrainingDivergedError, TrainingSpecError
from .io import EXTERNAL_DATA_THRESHOLD, load_model, save_model_atomic
from .lower import finalize, lower
from .passes.eval_mode import to_eval_mode
from .passes.training import training_nodes_left
from .step_model import STATE_KEY, UPDATE_BINDING_KEY, build_init_model, build_step_model, validate_training_info

STEPS_KEY = "onnx_autodiff.steps"
_PROBE = "onnx_autodiff/nonfinite_probe"
_FLOATS = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16}


class TrainingState(MutableMapping):
    """Name -> numpy view of the mutable tensors. Reading copies one tensor; assigning replaces it."""

    def __init__(self, session: "TrainingSession"):
        self._s = session

    def __getitem__(self, name: str) -> np.ndarray:
        return self._s.get_state(name)

    def __setitem__(self, name: str, value) -> None:
        self._s.set_state(name, value)

    def __delitem__(self, name: str) -> None:
        raise TypeError("state tensors cannot be deleted")

    def __iter__(self) -> Iterator[str]:
        return iter(self._s._names)

    def __len__(self) -> int:
        return len(self._s._names)


def _load(model_or_path) -> onnx.ModelProto:
    if isinstance(model_or_path, onnx.ModelProto):
        m = onnx.ModelProto()
        m.CopyFrom(model_or_path)
        return m
    if isinstance(model_or_path, (str, os.PathLike)):
        return load_model(model_or_path)
    raise TypeError(f"TrainingSession takes an onnx.ModelProto or a path, got {type(model_or_path).__name__}")


def _c_array(value) -> np.ndarray:
    """A C-contiguous array that keeps the rank (np.ascontiguousarray turns a scalar into shape (1,))."""
    arr = np.asarray(value)
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def _all_initializers(model: onnx.ModelProto):
    yield from model.graph.initializer
    for ti in model.training_info:
        yield from ti.algorithm.initializer


def _probe_model(step: onnx.ModelProto, values: list[tuple[str, int]]) -> tuple[onnx.ModelProto, list[str]]:
    """The step model plus one scalar output per float tensor that is NaN iff the tensor has a NaN or Inf."""
    m = onnx.ModelProto()
    m.CopyFrom(step)
    names = []
    for k, (value, dtype) in enumerate(values):
        zero = helper.make_tensor(f"{_PROBE}/zero{k}", dtype, [], [0])
        m.graph.initializer.append(zero)
        prod = f"{_PROBE}/mul{k}"
        out = f"{_PROBE}/{k}"
        m.graph.node.append(helper.make_node("Mul", [value, zero.name], [prod], name=prod))
        m.graph.node.append(helper.make_node("ReduceSum", [prod], [out], name=out, keepdims=0))
        m.graph.output.append(helper.make_tensor_value_info(out, dtype, []))
        names.append(out)
    return m, names


class TrainingSession:
    """Train a model that carries a TrainingInfoProto with onnxruntime.

    ``TrainingSession(model_or_path, providers=None, index=0)`` starts from the stored initializers
    (a checkpoint written by ``save`` resumes where it stopped); call ``reset()`` to run the
    initialization graphs instead. ``step(feeds)`` runs ``training_info[index].algorithm`` once.
    """

    def __init__(self, model_or_path, providers=None, index: int = 0, *,
                 session_options: ort.SessionOptions | None = None, loss: str | None = None):
        model = _load(model_or_path)
        if not len(model.training_info):
            raise TrainingSpecError("the model has no training_info: there is no training step to run")
        validate_training_info(model)
        self.model = lower(model) if training_nodes_left(model) else model
        self.index = index
        self.step_model = build_step_model(self.model, index)
        self.init_models = [build_init_model(self.model, k) for k in range(len(self.model.training_info))]
        meta = {p.key: p.value for p in self.step_model.metadata_props}
        self.update_binding: dict[str, str] = json.loads(meta[UPDATE_BINDING_KEY])
        self._names: list[str] = json.loads(meta[STATE_KEY])
        stored = {p.key: p.value for p in self.model.metadata_props}
        self.steps = int(stored.get(STEPS_KEY, 0))

        self.device, self.providers = self._pick_device(providers)
        if session_options is None:
            session_options = ort.SessionOptions()
            session_options.log_severity_level = 3  # the lifted state inputs make onnxruntime warn
        self._options = session_options
        inits = {t.name: t for t in self.step_model.graph.initializer}
        self._dtypes = {n: inits[n].data_type for n in self._names}
        probed = [(v, self._dtypes[k]) for k, v in self.update_binding.items() if self._dtypes[k] in _FLOATS]
        self._probe_of = {f"{_PROBE}/{i}": v for i, (v, _) in enumerate(probed)}
        run_model, probe_names = _probe_model(self.step_model, probed)
        self._sess = ort.InferenceSession(run_model.SerializeToString(), session_options, providers=self.providers)
        self._probe_names = probe_names
        state_values = set(self.update_binding.values())
        self.output_names = [o.name for o in self.step_model.graph.output if o.name not in state_values]
        self._run_outputs = [o.name for o in self.step_model.graph.output] + probe_names
        defaults = {t.name for t in self.step_model.graph.initializer}
        # inputs step() needs; an input with an initializer default (a learning rate) may be fed or not
        self.feed_names = [i.name for i in self.step_model.graph.input
                           if i.name not in set(self._names) and i.name not in defaults]
        self.loss_name = loss if loss is not None else self._guess_loss()
        self._state: dict[str, ort.OrtValue] = {}
        self._load_stored_state()

    # ---- setup -----------------------------------------------------------------------------------
    @staticmethod
    def _pick_device(providers):
        available = ort.get_available_providers()
        wanted = list(providers or ["CPUExecutionProvider"])
        names = [p[0] if isinstance(p, tuple) else p for p in wanted]
        if "CUDAExecutionProvider" in names and "CUDAExecutionProvider" in available:
            return "cuda", wanted
        return "cpu", ["CPUExecutionProvider"]

    def _guess_loss(self) -> str | None:
        alg_outputs = {o.name for o in self.model.training_info[self.index].algorithm.output}
        scalars = []
        for o in self.step_model.graph.output:
            tt = o.type.tensor_type
            dims = [d.dim_value for d in tt.shape.dim] if tt.HasField("shape") else None
            if o.name in self.output_names and tt.elem_type in _FLOATS and dims is not None and all(d == 1 for d in dims):
                scalars.append(o.name)
        for name in scalars:
            if name in alg_outputs:
                return name
        return scalars[0] if scalars else None

    def _ortvalue(self, array: np.ndarray) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_numpy(_c_array(array), self.device, 0)

    def _load_stored_state(self) -> None:
        inits = {t.name: t for t in self.step_model.graph.initializer}
        self._state = {n: self._ortvalue(numpy_helper.to_array(inits[n])) for n in self._names}

    # ---- state -----------------------------------------------------------------------------------
    @property
    def state(self) -> TrainingState:
        return TrainingState(self)

    def get_state(self, name: str) -> np.ndarray:
        """A numpy copy of one mutable tensor."""
        return self._state_value(name).numpy()

    def get_ortvalue(self, name: str) -> ort.OrtValue:
        """The OrtValue holding one mutable tensor (no copy; do not modify it in place)."""
        return self._state_value(name)

    def _state_value(self, name: str) -> ort.OrtValue:
        if name not in self._state:
            raise KeyError(f"{name!r} is not a mutable tensor of this model; mutable tensors: {self._names}")
        return self._state[name]

    def set_state(self, name: str, value) -> None:
        """Replace one mutable tensor; the shape and element type must stay the same."""
        old = self._state_value(name)
        arr = np.asarray(value)
        want = helper.tensor_dtype_to_np_dtype(self._dtypes[name])
        if arr.dtype != want or tuple(arr.shape) != tuple(old.shape()):
            raise ValueError(
                f"state {name!r} is {want} of shape {tuple(old.shape())}, got {arr.dtype} of shape {arr.shape}"
            )
        self._state[name] = self._ortvalue(arr)

    def reset(self) -> None:
        """Restore every mutable tensor to the initializer stored in the model, then run every
        initialization graph and apply its initialization_binding (the spec's initialization step)."""
        self._load_stored_state()
        for k, init in enumerate(self.init_models):
            if init is None:
                continue
            binding = json.loads({p.key: p.value for p in init.metadata_props}["onnx_autodiff.initialization_binding"])
            sess = ort.InferenceSession(init.SerializeToString(), self._options, providers=self.providers)
            wanted = [v for key, v in binding.items() if key in self._state]
            values = dict(zip(wanted, sess.run(wanted, {}))) if wanted else {}
            for key, v in binding.items():
                if key in self._state:
                    self.set_state(key, values[v])
        self.steps = 0

    # ---- running ---------------------------------------------------------------------------------
    def step(self, feeds: dict) -> dict[str, np.ndarray]:
        """Run one training step; returns the step graph's outputs that are not bound to state."""
        io = self._sess.io_binding()
        keep = []
        for name, value in feeds.items():
            if name in self._state:
                raise ValueError(f"{name!r} is a mutable tensor of the model; set it with set_state, not as a feed")
            if isinstance(value, ort.OrtValue):
                io.bind_ortvalue_input(name, value)
            else:
                # through an OrtValue (a view of the array on CPU): bind_cpu_input cannot bind an input
                # that has an initializer default, such as a learning rate with a default value
                arr = _c_array(value)
                keep.append(arr)
                io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))
        missing = [n for n in self.feed_names if n not in feeds]
        if missing:
            raise ValueError(f"step() needs feeds for {missing}")
        for name, value in self._state.items():
            io.bind_ortvalue_input(name, value)
        for name in self._run_outputs:
            io.bind_output(name, self.device)
        self._sess.run_with_iobinding(io)
        produced = dict(zip(self._run_outputs, io.get_outputs()))
        step = self.steps + 1
        result = {n: produced[n].numpy() for n in self.output_names}
        first = [self.loss_name] if self.loss_name in result else []
        for name in first + [n for n in result if n != self.loss_name]:
            arr = result[name]
            if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
                raise TrainingDivergedError(name, step)
        by_value = {v: k for k, v in self.update_binding.items()}
        for probe in self._probe_names:
            if not np.isfinite(produced[probe].numpy()):
                value = self._probe_of[probe]
                raise TrainingDivergedError(value, step, by_value[value])
        for key, value in self.update_binding.items():
            self._state[key] = produced[value]
        self.steps = step
        return result

    def train(self, batches, epochs: int = 1, callback: Callable | None = None, progress: bool = True) -> list:
        """Run ``step`` over ``batches`` (an iterable of feed dicts, or a callable returning one per
        epoch) ``epochs`` times. ``callback(step, outputs)`` runs after each step; returning False stops.
        A one-line progress bar with the loss goes to stderr. Returns the loss of every step."""
        losses = []
        for epoch in range(epochs):
            data = batches() if callable(batches) else batches
            if epoch and isinstance(data, Iterator):
                raise ValueError("batches is an iterator and was used up by the first epoch; pass a list or "
                                 "a callable returning a fresh iterable")
            total = len(data) if hasattr(data, "__len__") else None
            for i, feeds in enumerate(data):
                out = self.step(feeds)
                loss = float(np.asarray(out[self.loss_name]).reshape(-1)[0]) if self.loss_name else None
                losses.append(loss)
                if progress:
                    self._progress(epoch, epochs, i, total, loss)
                if callback is not None and callback(self.steps, out) is False:
                    if progress:
                        sys.stderr.write("\n")
                    return losses
            if progress:
                sys.stderr.write("\n")
                sys.stderr.flush()
        return losses

    @staticmethod
    def _progress(epoch: int, epochs: int, i: int, total: int | None, loss: float | None) -> None:
        if total:
            done = int(20 * (i + 1) / total)
            bar = f"[{'#' * done}{'.' * (20 - done)}] {i + 1}/{total}"
        else:
            bar = f"step {i + 1}"
        text = f"\repoch {epoch + 1}/{epochs} {bar}" + (f" loss {loss:.6g}" if loss is not None else "")
        sys.stderr.write(text)
        sys.stderr.flush()

    # ---- saving ----------------------------------------------------------------------------------
    def _with_state(self, model: onnx.ModelProto) -> None:
        for t in _all_initializers(model):
            if t.name in self._state:
                t.CopyFrom(numpy_helper.from_array(self.get_state(t.name), t.name))

    @property
    def metadata(self) -> dict[str, str]:
        """The model's ``metadata_props`` as loaded (a checkpoint's extra metadata included)."""
        return {p.key: p.value for p in self.model.metadata_props}

    def checkpoint(self, metadata: dict[str, str] | None = None) -> onnx.ModelProto:
        """The lowered model with every mutable initializer set to the current state, training_info kept;
        ``metadata`` entries are added to (or replace) its ``metadata_props``."""
        m = onnx.ModelProto()
        m.CopyFrom(self.model)
        self._with_state(m)
        extra = {STEPS_KEY: str(self.steps), **(metadata or {})}
        props = [p for p in m.metadata_props if p.key not in extra]
        del m.metadata_props[:]
        m.metadata_props.extend(props)
        m.metadata_props.extend(onnx.StringStringEntryProto(key=k, value=str(v)) for k, v in extra.items())
        return m

    def save(self, path, external_data_threshold: int = EXTERNAL_DATA_THRESHOLD, *,
             metadata: dict[str, str] | None = None) -> None:
        """Write a checkpoint atomically; ``TrainingSession(path)`` resumes from it exactly. ``metadata``
        (str -> str) is stored in the checkpoint's ``metadata_props``, replaced together with the weights."""
        save_model_atomic(self.checkpoint(metadata), path, external_data_threshold)

    def inference_model(self, eval_mode: bool = True) -> onnx.ModelProto:
        """ModelProto.graph with the trained weights and no training_info; with ``eval_mode``,
        training-mode BatchNormalization/Dropout nodes switch to inference behaviour."""
        m = onnx.ModelProto()
        m.CopyFrom(self.model)
        del m.training_info[:]
        self._with_state(m)
        if eval_mode:
            to_eval_mode(m)
        props = [p for p in m.metadata_props if not p.key.startswith("onnx_autodiff.")]
        del m.metadata_props[:]
        m.metadata_props.extend(props)
        finalize(m)
        onnx.checker.check_model(m, full_check=True)
        return m

    def export_inference(self, path, external_data_threshold: int = EXTERNAL_DATA_THRESHOLD,
                         eval_mode: bool = True) -> None:
        """Write ``inference_model(eval_mode)`` atomically; stock onnxruntime loads it."""
        save_model_atomic(self.inference_model(eval_mode), path, external_data_threshold)


__all__ = ["TrainingSession", "TrainingState", "TrainingDivergedError"]
