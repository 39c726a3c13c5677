"""One progress display for every training loop (the CLI, the demo, ``TrainingSession.train``).

In a terminal it is a tqdm bar (redrawn in place, cleared properly, so no stale digits); when stderr is a
file or a pipe (a log, CI) it writes plain lines instead, one every ``interval`` seconds and one at the end,
so no carriage returns end up in the log. Without tqdm (it is the optional ``progress`` extra) terminals get
the plain lines too.
"""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import TextIO


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """``Progress(total, "epoch 1/3")``; ``update(loss=...)`` after each step; ``close()`` (or ``with``).

    ``interval``: seconds between plain lines (a terminal bar redraws at most every 0.1 s, or ``interval``
    if shorter). ``TrainingSession.train`` uses it as::

        bar = Progress(total, f"epoch {epoch + 1}/{epochs}", enabled=progress)
        ... bar.update(loss=loss) after each step ...
        bar.close()
    """

    def __init__(self, total: int | None, desc: str, *, stream: TextIO | None = None, enabled: bool = True,
                 interval: float = 10.0, unit: str = "step"):
        self.total, self.desc, self.enabled, self.interval, self.unit = total, desc, enabled, interval, unit
        self.stream = stream if stream is not None else sys.stderr
        self.n = 0
        self.loss: float | None = None
        self.tokens = 0  # counted when update() is given tokens: shown as tokens/s
        self._start = time.monotonic()
        self._bar = None
        self._last = time.monotonic()
        if enabled and _is_terminal(self.stream):
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=desc, file=self.stream, leave=False, unit=unit,
                                 dynamic_ncols=True, mininterval=min(0.1, interval))

    def update(self, n: int = 1, loss: float | None = None, tokens: int | None = None) -> None:
        self.n += n
        if loss is not None:
            self.loss = float(loss)
        if tokens is not None:
            self.tokens += int(tokens)
        if not self.enabled:
            return
        if self._bar is not None:
            if loss is not None or tokens is not None:
                self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.update(n)
        elif time.monotonic() - self._last >= self.interval:
            self._line()

    def _postfix(self) -> str:
        parts = [f"loss {self.loss:.4g}"] if self.loss is not None else []
        if self.tokens:
            parts.append(f"{self.tokens / max(time.monotonic() - self._start, 1e-9):.0f} tokens/s")
        return ", ".join(parts)

    def _line(self) -> None:
        count = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        extra = self._postfix()
        self.stream.write(f"{self.desc}: {count} {self.unit}s{' ' + extra if extra else ''}\n")
        self.stream.flush()
        self._last = time.monotonic()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.n:
            self._line()
        self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextmanager
def stage(what: str, *, stream: TextIO | None = None, enabled: bool = True, after: float = 1.0):
    """A long step with no count to show (loading, lowering, opening a session): once it has run for
    ``after`` seconds, a line saying what it is doing, and its time when it ends (on stderr). Quick
    steps print nothing, so a large model never leaves the screen silent and a small one stays quiet."""
    out = stream if stream is not None else sys.stderr
    start = time.perf_counter()
    shown = threading.Event()

    def announce():
        out.write(f"{what} ...\n")
        out.flush()
        shown.set()

    timer = threading.Timer(after, announce) if enabled else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
            timer.join()
            if shown.is_set():
                out.write(f"{what}: done in {time.perf_counter() - start:.1f} s\n")
                out.flush()


__all__ = ["Progress", "stage"]
