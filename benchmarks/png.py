"""A grouped bar chart as a PNG, with zlib and struct only (matplotlib is not a dependency).

One group per model, one bar per series; each series has a target drawn as a dashed line in the
series' colour. Values are ratios (1.0 = the target of the second series after scaling); the axis runs
from 0 to 2 with a grey grid line every 0.25.
"""
from __future__ import annotations

import struct
import zlib

COLOURS = [(52, 101, 164), (204, 102, 0), (78, 154, 6)]
W, H, PAD = 640, 360, 30
TOP = 2.0


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode(pixels: list[bytearray]) -> bytes:
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    header = struct.pack(">IIBBBBB", len(pixels[0]) // 3, len(pixels), 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")


def bar_chart(groups: list[tuple[str, list[float]]], targets: list[float]) -> bytes:
    px = [bytearray(b"\xff" * (3 * W)) for _ in range(H)]

    def put(x, y, c):
        if 0 <= x < W and 0 <= y < H:
            px[y][3 * x:3 * x + 3] = bytes(c)

    def y_of(v):
        return H - PAD - int(min(v, TOP) / TOP * (H - 2 * PAD))

    for k in range(int(TOP / 0.25) + 1):
        y = y_of(k * 0.25)
        for x in range(PAD, W - PAD):
            put(x, y, (200, 200, 200) if k else (0, 0, 0))
    n_series = max(len(v) for _, v in groups)
    slot = (W - 2 * PAD) // max(len(groups), 1)
    bar = max(slot // (n_series + 1), 2)
    for gi, (_, values) in enumerate(groups):
        for si, v in enumerate(values):
            x0 = PAD + gi * slot + bar // 2 + si * bar
            for x in range(x0, x0 + bar - 2):
                for y in range(y_of(v), H - PAD):
                    put(x, y, COLOURS[si % len(COLOURS)])
    for si, t in enumerate(targets):
        y = y_of(t)
        for x in range(PAD, W - PAD):
            if (x // 6) % 2 == si % 2:
                put(x, y, COLOURS[si % len(COLOURS)])
                put(x, y + 1, COLOURS[si % len(COLOURS)])
    return encode(px)
