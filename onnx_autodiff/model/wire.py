"""Protobuf's wire format, read directly where parsing a model file would copy its weights.

``onnx.load`` copies every inline tensor's bytes into the message (BERT-base: 440 MB read, then copied, for a
light model of 300 KB). ``strip_raw_data`` walks the file's wire format instead and writes the model again
without the ``raw_data`` of its large initializers, noting where each one's bytes are in the file, so that
``io.load_split`` parses only the graph and maps the weights from the file. Only the fields that hold
initializers are descended into: ``ModelProto.graph`` and the graphs of ``ModelProto.training_info``; every other
field is copied byte for byte. Field numbers are onnx.proto's.
"""
from __future__ import annotations

# ModelProto.graph = 7, .training_info = 20; TrainingInfoProto.initialization = 1, .algorithm = 2;
# GraphProto.initializer = 5; TensorProto.name = 8, .raw_data = 9 (onnx.proto)
GRAPH, TRAINING_INFO, INITIALIZER, NAME, RAW_DATA = 7, 20, 5, 8, 9
TRAINING_GRAPHS = (1, 2)
_LENGTH_DELIMITED = 2


class WireError(ValueError):
    """Bytes that are not the protobuf wire format (the caller parses them the ordinary way, for its error)."""


def varint(buf, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise WireError(f"a varint runs past byte {pos}")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def fields(buf, start: int, end: int):
    """``(field number, wire type, key start, value start, value end)`` of every field of the message in
    ``buf[start:end]`` (a varint key, then a varint, 8 bytes, a length and bytes, or 4 bytes)."""
    pos = start
    while pos < end:
        first = pos
        key, pos = varint(buf, pos)
        kind = key & 7
        if kind == 0:
            _, after = varint(buf, pos)
        elif kind == 1:
            after = pos + 8
        elif kind == 5:
            after = pos + 4
        elif kind == _LENGTH_DELIMITED:
            size, pos = varint(buf, pos)
            after = pos + size
        else:
            raise WireError(f"protobuf wire type {kind} at byte {first}")
        if after > end:
            raise WireError(f"field {key >> 3} at byte {first} runs past its message")
        yield key >> 3, kind, first, pos, after
        pos = after


def length_fields(buf, start: int, end: int):
    """``(field number, start, end)`` of every length-delimited field of the message in ``buf[start:end]``."""
    for number, kind, _, a, b in fields(buf, start, end):
        if kind == _LENGTH_DELIMITED:
            yield number, a, b


class _Writer:
    """The stripped message as a list of byte chunks; ``cut[graph key]``: (initializer ordinal, offset, size) of
    each raw_data left out."""

    def __init__(self, buf, min_bytes: int):
        self.buf, self.min_bytes = buf, min_bytes
        self.cut: dict[tuple, list[tuple[int, int, int]]] = {}
        self.counts: dict[tuple, int] = {}  # initializers seen per graph (a message repeated in the wire merges)
        self.trainings = 0

    def message(self, start: int, end: int, descend) -> list:
        """Chunks of the message ``buf[start:end]``, each length-delimited field for which ``descend(number)``
        gives a function written by it (its chunks, under a new length), the rest copied as it is."""
        chunks: list = []
        copy_from = start
        for number, kind, first, a, b in fields(self.buf, start, end):
            inner = descend(number) if kind == _LENGTH_DELIMITED else None
            if inner is None:
                continue
            if first > copy_from:
                chunks.append(self.buf[copy_from:first])
            body = inner(a, b)
            chunks += [encode_varint((number << 3) | _LENGTH_DELIMITED), encode_varint(sum(len(c) for c in body))]
            chunks += body
            copy_from = b
        if end > copy_from:
            chunks.append(self.buf[copy_from:end])
        return chunks

    def model(self) -> bytes:
        return b"".join(self.message(0, len(self.buf), self._top))

    def _top(self, number: int):
        if number == GRAPH:
            return lambda a, b: self.graph(a, b, ("graph",))
        if number == TRAINING_INFO:
            k = self.trainings
            self.trainings += 1
            return lambda a, b: self.message(a, b, lambda n: (lambda c, d: self.graph(c, d, (k, n)))
                                             if n in TRAINING_GRAPHS else None)
        return None

    def graph(self, start: int, end: int, key: tuple) -> list:
        return self.message(start, end, lambda n: (lambda a, b: self.tensor(a, b, key)) if n == INITIALIZER else None)

    def tensor(self, start: int, end: int, key: tuple) -> list:
        ordinal = self.counts.get(key, 0)
        self.counts[key] = ordinal + 1
        kept: list = []
        copy_from = start
        for number, kind, first, a, b in fields(self.buf, start, end):
            if number == RAW_DATA and kind == _LENGTH_DELIMITED and b - a >= self.min_bytes:
                if first > copy_from:
                    kept.append(self.buf[copy_from:first])
                self.cut.setdefault(key, []).append((ordinal, a, b - a))
                copy_from = b
        if end > copy_from:
            kept.append(self.buf[copy_from:end])
        return kept


def strip_raw_data(buf, min_bytes: int) -> tuple[bytes, dict[tuple, list[tuple[int, int, int]]]]:
    """``buf`` (a serialized ModelProto) without the ``raw_data`` of the initializers whose raw_data holds at least
    ``min_bytes`` bytes, and where each was: ``{graph key: [(initializer ordinal, offset, size), ...]}``, the key
    ``("graph",)`` for the model's graph and ``(k, 1)`` / ``(k, 2)`` for the initialization / algorithm of its
    k-th TrainingInfoProto. ``WireError`` if ``buf`` is not the wire format of a message."""
    w = _Writer(buf, min_bytes)
    return w.model(), w.cut


__all__ = ["strip_raw_data", "fields", "length_fields", "varint", "encode_varint", "WireError",
           "GRAPH", "TRAINING_INFO", "INITIALIZER", "NAME", "RAW_DATA"]
