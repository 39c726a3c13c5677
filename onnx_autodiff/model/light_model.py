"""``LightModel``: a model whose tensors stay where they are, standing in for the whole ModelProto.

``make_training_model`` returns one. Its graph is a light ModelProto (``weights.py``: the large tensors
are detached, no bytes inside) and its arrays are read from where they already live: the file the model
came from (memory-mapped), the ModelProto the caller gave (read when needed, never copied ahead), or
fresh zeros (the optimizer's state: untouched zero pages cost no memory). Building a training model
thus copies no weight, and ``TrainingSession`` holds the only copy that trains.

It still behaves as the ModelProto it stands for. ``save`` writes it atomically (external data past
the threshold, as ``io.save_model_atomic``); ``onnx.save``, ``onnx.checker.check_model`` and
``SerializeToString`` see the whole model (serialized with every tensor inline, then dropped);
``TrainingSession``, ``export_step`` and ``lower`` take it as it is. Reading or setting a field of the
ModelProto (``.graph``, ``.training_info``, ``.metadata_props``...) turns it into that whole ModelProto in
memory, kept from then on (``proto()``): every tensor inline, as a ModelProto holds them. ``light``
shows the graph without that cost.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import onnx

from .io import EXTERNAL_DATA_THRESHOLD, save_model_atomic
from .weights import array_of, attach_weights, split_model


class SourceArrays(Mapping):
    """name -> the array of an initializer of ``source`` (a ModelProto the caller holds), read when
    asked: a new copy each time, none kept. ``names``: our name -> the tensor's name in ``source``
    (several names may read one tensor: untied aliases start from the same values)."""

    def __init__(self, source: onnx.ModelProto, names: Mapping[str, str]):
        self._source, self._names = source, dict(names)
        self._tensors: dict[str, onnx.TensorProto] | None = None

    def __getitem__(self, name: str) -> np.ndarray:
        if self._tensors is None:
            self._tensors = {t.name: t for t in self._source.graph.initializer}
        return array_of(self._tensors[self._names[name]])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class Arrays(Mapping):
    """The arrays of a light model: ``own`` (memory maps, zeros, new arrays), then ``read`` (copies
    read from the caller's ModelProto when asked)."""

    def __init__(self, own: Mapping[str, np.ndarray], read: SourceArrays | None = None):
        self.own, self.read = own, read

    @property
    def copied_on_read(self) -> set[str]:
        """Names whose every read gives a fresh copy (a session may write into it)."""
        return set(self.read or ()) - set(self.own)

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self.own:
            return self.own[name]
        if self.read is not None and name in self.read:
            return self.read[name]
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        yield from self.own
        yield from (n for n in (self.read or ()) if n not in self.own)

    def __len__(self) -> int:
        return len(set(self.own) | set(self.read or ()))


class LightModel:
    """A light ModelProto and its arrays, behaving as the whole ModelProto (module docstring)."""

    __slots__ = ("_light", "_arrays", "_whole", "_path")

    def __init__(self, light: onnx.ModelProto, arrays: Mapping[str, np.ndarray], path: str | None = None):
        object.__setattr__(self, "_light", light)
        object.__setattr__(self, "_arrays", arrays if isinstance(arrays, Arrays) else Arrays(arrays))
        object.__setattr__(self, "_whole", None)
        object.__setattr__(self, "_path", path)

    @property
    def source_path(self) -> str | None:
        """The absolute path of the model file whose weights it maps (None when built from a ModelProto):
        a LoRA session's checkpoints reference its frozen weights there instead of copying them. None too
        once a field was used: the whole model may since have been changed."""
        return self._path if self._whole is None else None

    # ---- what stays light ------------------------------------------------------------------------
    @property
    def is_whole(self) -> bool:
        """Whether a ModelProto field was used, so the whole ModelProto is held (``proto()``)."""
        return self._whole is not None

    @property
    def light(self) -> onnx.ModelProto:
        """The ModelProto without the large tensors' bytes (detached tensors; ``weights.py``). After a field
        was used, a light copy of the whole model, which may since have been changed."""
        return self._light if self._whole is None else split_model(self._whole)[0]

    @property
    def arrays(self) -> Mapping[str, np.ndarray]:
        """name -> array of every detached tensor of ``light``."""
        return self._arrays if self._whole is None else split_model(self._whole)[1]

    def parts(self) -> tuple[onnx.ModelProto, Mapping[str, np.ndarray], set[str]]:
        """``(light, arrays, names whose arrays are fresh copies on every read)``, without copying a weight
        while no field was used."""
        if self._whole is None:
            return self._light, self._arrays, self._arrays.copied_on_read
        light, found = split_model(self._whole)
        return light, found, set(found)

    def whole_copy(self) -> onnx.ModelProto:
        """A new ModelProto with every tensor inline (the memory of all of them); this object stays light."""
        if self._whole is not None:
            m = onnx.ModelProto()
            m.CopyFrom(self._whole)
            return m
        m = onnx.ModelProto()
        m.CopyFrom(self._light)
        attach_weights(m, self._arrays)
        return m

    def save(self, path, external_data_threshold: int | None = None) -> None:
        """Write the model atomically (``io.save_model_atomic``): tensors go to one external-data file
        beside it past ``external_data_threshold`` bytes; the weights are streamed, not copied into protobuf."""
        limit = EXTERNAL_DATA_THRESHOLD if external_data_threshold is None else external_data_threshold
        if self._whole is not None:
            save_model_atomic(self._whole, path, limit)
        else:
            save_model_atomic(self._light, path, limit, weights=self._arrays)

    def SerializeToString(self, **kwargs) -> bytes:  # noqa: N802  (the protobuf method it stands in for)
        """The whole model's bytes (what ``onnx.save`` and ``onnx.checker`` read)."""
        return (self._whole if self._whole is not None else self.whole_copy()).SerializeToString(**kwargs)

    # ---- everything else: the whole ModelProto ---------------------------------------------------
    def proto(self) -> onnx.ModelProto:
        """The whole ModelProto, made once and held from then on (every tensor inline)."""
        if self._whole is None:
            object.__setattr__(self, "_whole", self.whole_copy())
            object.__setattr__(self, "_light", None)
            object.__setattr__(self, "_arrays", None)
        return self._whole

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.proto(), name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.proto(), name, value)

    def __repr__(self) -> str:
        state = "whole" if self._whole is not None else f"light, {len(self._arrays)} arrays outside protobuf"
        return f"<onnx_autodiff.LightModel ({state})>"


def model_parts(model) -> tuple[onnx.ModelProto, Mapping[str, np.ndarray], set[str]] | None:
    """``LightModel.parts()`` of a LightModel, else None."""
    return model.parts() if isinstance(model, LightModel) else None


__all__ = ["LightModel", "SourceArrays", "Arrays", "model_parts"]
