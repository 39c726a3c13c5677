"""The mutable tensors of a ``TrainingSession`` as OrtValues: two buffers per updated tensor.

``StateBuffers`` holds, for every key of the update bindings, the OrtValue the next step reads. A step
writes the new value of a buffered key into the other buffer of the pair (``output_buffer``) or, when
every reader of the key runs before its update (``in_place_keys``), into the same one; ``commit``
makes the written buffer the state and keeps the other as the spare, so a step allocates no state and
copies none to numpy unless asked. The first buffer of a key is ours from the start: memory-mapped from
a file, it is copied and the file's pages are given back; from a ModelProto (``private``) it is a copy only
we hold; an all-zero one (fresh optimizer state) is made as zeros here. So a key updated in place never
gets a second buffer. Only a stored array the caller holds (``weights=`` in memory) is read, not written:
the first step writes its new value into a buffer of ours.
"""
from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator, Mapping, MutableMapping

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from ..errors import TrainingSpecError
from ..graph import node_inputs
from ..model.weights import Weights, fresh_zeros, is_detached, is_fresh_zeros, owned_copy, top_graphs


class Transfers:
    """How many tensors crossed between host memory and the device since ``reset``: ``up``, an array made
    an OrtValue (``to_device``); ``down``, an OrtValue read into numpy (``to_host``). Every crossing of a step
    goes through these two functions. On the CPU neither copies (an OrtValue views its array) but both count,
    so a test on a machine without a GPU counts what a step on one copies."""

    def __init__(self):
        self.up = self.down = 0

    def reset(self) -> None:
        self.up = self.down = 0


TRANSFERS = Transfers()


def to_device(array, device: str = "cpu", device_id: int = 0) -> ort.OrtValue:
    """An OrtValue of ``array`` on ``device`` (a copy there; on the CPU a view of the array, which the
    caller keeps alive)."""
    TRANSFERS.up += 1
    return ort.OrtValue.ortvalue_from_numpy(c_array(array), device, device_id)


def to_host(value: ort.OrtValue) -> np.ndarray:
    """The numpy array of an OrtValue (a copy from a device; on the CPU a view of its memory)."""
    TRANSFERS.down += 1
    return value.numpy()


def c_array(value) -> np.ndarray:
    """A C-contiguous, aligned array that keeps the rank (np.ascontiguousarray turns a scalar into shape
    (1,)); a tensor memory-mapped from inside a protobuf file may start at any byte and is copied."""
    arr = np.asarray(value)
    return arr if arr.flags.c_contiguous and arr.flags.aligned else arr.copy(order="C")


def release_pages(array) -> None:
    """Give back the pages of a memory-mapped stored value the first step has read: they are kept
    only for ``reset()``, which maps them in again from the file when it runs."""
    mm = getattr(array, "_mmap", None)
    if isinstance(array, np.memmap) and mm is not None and hasattr(mm, "madvise"):
        try:
            mm.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError, AttributeError):
            pass


def _all_zero(array, chunk: int = 1 << 16) -> bool:
    """Whether ``array`` holds only zeros, read a chunk at a time: a weight that is not zero answers in its first
    chunk (``any()`` over all of BERT-base's weights read 440 MB to learn it, a quarter of a CPU second)."""
    flat = np.asarray(array).reshape(-1)
    return not any(flat[i:i + chunk].any() for i in range(0, flat.size, chunk))


_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Neg", "Sqrt", "Where", "Max", "Min", "Abs", "Cast"}


def in_place_keys(graph: onnx.GraphProto, key_of: Mapping[str, str], reach: int = 64) -> set[str]:
    """Keys whose new value may be written into their own buffer: every node of ``graph`` that reads
    the key runs before the node writing the new value (an ancestor of it, found within ``reach``
    nodes), or is that node itself and elementwise; and the key is no output of the graph."""
    nodes = list(graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    readers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for x in set(node_inputs(n)):
            readers.setdefault(x, []).append(i)
    outputs = {o.name for o in graph.output}
    safe = set()
    for value, key in key_of.items():
        if value not in producer or key in outputs:
            continue
        p = producer[value]
        waiting = set(readers.get(key, []))
        if p in waiting:
            if nodes[p].op_type not in _ELEMENTWISE or nodes[p].domain not in ("", "ai.onnx"):
                continue
            waiting.discard(p)
        seen, stack = set(), [producer[x] for x in node_inputs(nodes[p]) if x in producer]
        while stack and waiting and len(seen) < reach:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            waiting.discard(i)
            stack.extend(producer[x] for x in node_inputs(nodes[i]) if x in producer)
        if not waiting:
            safe.add(key)
    return safe


class StateBuffers:
    """name -> OrtValue of every mutable tensor, with the spare buffers a step writes into.

    ``values[key]``: what the next step reads. ``spare[key]``: the other buffer of the pair (None until
    needed). ``owned``: keys whose current buffer is ours (written by a step), not a stored array.
    ``inplace``: keys a step may update in their own buffer when it is ours. ``private``: keys whose
    stored array is a copy only we hold; ``reload()`` gives those arrays again (for ``reset``, since the
    steps overwrote them). ``zeros``: keys stored as all zeros, made as fresh zeros at every load."""

    def __init__(self, model: onnx.ModelProto, weights: Weights, names: list[str], dtypes: dict[str, int],
                 shapes: dict[str, tuple], device: str, device_id: int, private: set[str] = frozenset(),
                 reload: Callable[[], Weights] | None = None):
        self.model, self.weights, self.names = model, weights, names
        self.dtypes, self.shapes, self.device, self.device_id = dtypes, shapes, device, device_id
        self.private, self.reload = set(private) & set(names), reload
        self.mirrored: set[str] = set()  # small integer keys whose value the host follows (the step counter)
        self.host_values: dict[str, int] = {}  # their values as last set from the host
        self.zeros: set[str] = set()
        self.values: dict[str, ort.OrtValue] = {}
        self.spare: dict[str, ort.OrtValue | None] = {}
        self.owned: set[str] = set()
        self.inplace: set[str] = set()
        self._loaded = False

    def ortvalue(self, array: np.ndarray) -> ort.OrtValue:
        return to_device(array, self.device, self.device_id)

    def _mirror(self, name: str, array) -> None:
        if name in self.mirrored:
            self.host_values[name] = int(np.asarray(array).reshape(-1)[0])

    def array(self, name: str) -> np.ndarray:
        """The stored value of an initializer: from the weights store, else the inline tensor."""
        if name in self.weights:
            return self.weights[name]
        for g in top_graphs(self.model):
            for t in g.initializer:
                if t.name == name:
                    if is_detached(t):
                        raise TrainingSpecError(f"initializer {name!r} is detached and no array was given for "
                                                "it; pass the model's path, or weights={name: array}")
                    if t.data_location == onnx.TensorProto.EXTERNAL:
                        where = next((e.value for e in t.external_data if e.key == "location"), "?")
                        raise TrainingSpecError(f"initializer {name!r} keeps its bytes in the external-data file "
                                                f"{where!r}, which a ModelProto does not locate (onnx.load does not "
                                                "load the external data of training_info graphs); open the model "
                                                "by its path: TrainingSession(path)")
                    return numpy_helper.to_array(t)
        raise KeyError(name)

    def load_stored(self) -> None:
        """Every mutable tensor from its stored value (the model's initializer or the weights store)."""
        self.values, self.spare, self.owned = {}, {}, set()
        if self._loaded and self.private and self.reload is not None:  # the steps wrote into them
            fresh = self.reload()
            self.weights.update({n: fresh[n] for n in self.private})
        for n in self.names:
            arr, ours = self._first_buffer(n)
            if ours:
                self.owned.add(n)
            self.values[n] = self.ortvalue(arr)
            self._mirror(n, arr)
        self._loaded = True

    def _first_buffer(self, n: str) -> tuple[np.ndarray, bool]:
        """The array a key starts from, and whether it is ours to update in place."""
        if n in self.zeros:
            arr = fresh_zeros(self.shapes[n], helper.tensor_dtype_to_np_dtype(self.dtypes[n]))
        else:
            stored = self.array(n)
            if is_fresh_zeros(stored) or (stored.size > 1024 and _all_zero(stored)):
                self.zeros.add(n)
                arr = fresh_zeros(stored.shape, stored.dtype)  # fresh optimizer state: no memory until written
            elif n in self.private or isinstance(stored, np.memmap):
                arr = owned_copy(stored)  # writable; the read-only bytes it came from are dropped
            else:
                return stored, False
            if isinstance(stored, np.memmap):
                # the file's pages go now (``reset`` maps them again): otherwise the first step would hold
                # both the pages it reads and the buffer it writes (BERT-base: +440 MB)
                release_pages(stored)
                return arr, True
        self.weights[n] = arr
        return arr, True

    def tensor(self, name: str) -> np.ndarray:
        """The current value of a mutable tensor (a copy), else the stored array of a frozen one."""
        return self.get(name) if name in self.values else self.array(name)

    def value(self, name: str) -> ort.OrtValue:
        if name not in self.values:
            raise KeyError(f"{name!r} is not a mutable tensor of this model; mutable tensors: {self.names}")
        return self.values[name]

    def get(self, name: str) -> np.ndarray:
        """A numpy copy of one mutable tensor (OrtValue.numpy() is a view of memory a step updates in place)."""
        return np.array(to_host(self.value(name)), copy=True)

    def set(self, name: str, value) -> None:
        """Replace one mutable tensor; the shape and element type must stay the same."""
        old = self.value(name)
        arr = np.asarray(value)
        want = helper.tensor_dtype_to_np_dtype(self.dtypes[name])
        if arr.dtype != want or tuple(arr.shape) != tuple(old.shape()):
            raise ValueError(
                f"state {name!r} is {want} of shape {tuple(old.shape())}, got {arr.dtype} of shape {arr.shape}"
            )
        if name in self.owned:
            self.spare[name] = old
        self.values[name] = self.ortvalue(np.array(arr, order="C"))  # our own copy: the caller keeps theirs
        self.owned.discard(name)
        self._mirror(name, arr)

    def output_buffer(self, key: str) -> ort.OrtValue:
        """Where the step writes the new value of ``key``: its own buffer when the update may run in
        place and the buffer is ours, else the spare buffer (allocated once)."""
        if key in self.inplace and key in self.owned:
            return self.values[key]
        buf = self.spare.get(key)
        if buf is None:
            dtype = helper.tensor_dtype_to_np_dtype(self.dtypes[key])
            buf = ort.OrtValue.ortvalue_from_shape_and_type(list(self.shapes[key]), dtype, self.device,
                                                            self.device_id)
            self.spare[key] = buf
        return buf

    def commit(self, key: str, new: ort.OrtValue) -> None:
        """``new`` (a buffer ``output_buffer`` gave) is the value of ``key`` from now on."""
        if new is self.values[key]:
            return
        old = self.values[key]
        self.values[key] = new
        self.spare[key] = old if key in self.owned and key not in self.inplace else None
        if key not in self.owned:
            release_pages(self.weights.get(key))
        self.owned.add(key)

    def take(self, key: str, value: ort.OrtValue) -> None:
        """``value`` (an output of a run, not one of our buffers) is the value of ``key`` from now on."""
        self.values[key] = value
        self.owned.discard(key)


class TrainingState(MutableMapping):
    """Name -> numpy view of the mutable tensors. Reading copies one tensor; assigning replaces it."""

    def __init__(self, buffers: StateBuffers):
        self._b = buffers

    def __getitem__(self, name: str) -> np.ndarray:
        return self._b.get(name)

    def __setitem__(self, name: str, value) -> None:
        self._b.set(name, value)

    def __delitem__(self, name: str) -> None:
        raise TypeError("state tensors cannot be deleted")

    def __iter__(self) -> Iterator[str]:
        return iter(self._b.names)

    def __len__(self) -> int:
        return len(self._b.names)


class LazyTensors(Mapping):
    """name -> numpy array, computed when asked (a checkpoint's writer takes one tensor at a time)."""

    def __init__(self, get: Callable[[str], np.ndarray], names):
        self._get, self._names = get, list(names)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        return self._get(name)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


__all__ = ["StateBuffers", "TrainingState", "LazyTensors", "in_place_keys", "c_array", "release_pages", "to_device",
           "to_host", "TRANSFERS", "Transfers"]
