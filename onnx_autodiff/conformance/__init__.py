"""The conformance run: every rule case, probes and random graphs through one or more runtimes, forward and
backward, each held against float64 (``run.py``), summed up per op into a table (``tables.py``) whose ``lacks`` the
targets read (``runtimes/targets.py``: ``onnx_autodiff/data/conformance/<runtime>.json``) and whose matrix
docs/runtimes.md shows.

Each runtime runs in a worker process of its own, so a runtime that takes its process down (tract panics on some
models) costs one result ("crashed"), not the run. The float64 reference of a subject is computed once, here, for
every runtime.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import multiprocessing
from collections.abc import Callable, Iterable
from pathlib import Path

from ..driver.progress import Progress
from ..errors import BundleError
from ..runtimes.targets import RUNTIMES, TABLES, get_target
from . import subjects
from .run import ERROR, NONE, Reference, Result, Subject, reference, run_subject
from .tables import CRASHED, build_table, markdown, text

TIMEOUT = 600.0  # seconds one subject may take on one runtime


def _serve(conn, runtime: str) -> None:
    """A worker: runs subjects on ``runtime`` until the pipe closes. Its stderr goes nowhere: a runtime's own
    log lines and a panic's backtrace would bury the progress (a crash is a result with its exit code)."""
    import os

    from ..runtimes.loop import load_runner

    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)

    target = RUNTIMES[runtime]
    load = load_runner(target)
    while True:
        try:
            subject, ref = conn.recv()
        except EOFError:
            return
        conn.send(run_subject(subject, ref, target, load))


class _Worker:
    """A process running subjects on one runtime, started again after a crash."""

    def __init__(self, runtime: str):
        self.runtime = runtime
        self.ctx = multiprocessing.get_context("spawn")
        self.proc = None

    def _start(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_serve, args=(child, self.runtime), daemon=True)
        self.proc.start()
        child.close()

    def run(self, subject: Subject, ref: Reference) -> Result:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        try:
            self.conn.send((subject, ref))
            if self.conn.poll(TIMEOUT):
                return self.conn.recv()
            why = f"no answer in {TIMEOUT:g} s"
        except (EOFError, OSError, BrokenPipeError):
            self.proc.join(10)
            why = f"the {self.runtime} process ended (exit code {self.proc.exitcode})"
        self.close()
        return _result(subject, CRASHED, why)

    def close(self) -> None:
        if self.proc is not None and self.proc.pid is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join()
        self.proc = None


def _result(subject: Subject, status: str, detail: str) -> Result:
    back = status if subject.wrt else NONE
    return Result(subject.name, subject.kind, subject.ops, subject.attrs, subject.domain, status, back, detail,
                  detail if subject.wrt else "", subject.token, subject.opset)


def conformance(runtimes: Iterable[str], *, graphs: int = 300, seed: int = 0, ops=None,
                source: Callable | None = None, progress: bool = True) -> dict[str, dict]:
    """``{runtime: table}``: every rule case (of ``ops`` only, if given), the probes, and ``graphs`` random graphs
    (``source(count, seed)``, default ``subjects.GRAPHS``) through each runtime."""
    from ..runtimes.loop import runtime_version

    names = list(dict.fromkeys(runtimes))
    for name in names:
        if get_target(name).runner is None or name not in RUNTIMES:
            raise BundleError(f"{name!r} has no runner to run a conformance on",
                              hint=f"choose among {', '.join(n for n, t in RUNTIMES.items() if t.runner)}")
    versions = {name: runtime_version(name) for name in names}
    source = source or subjects.GRAPHS
    cases = list(subjects.case_subjects(ops))
    probes = list(subjects.probes()) if ops is None else []
    todo = itertools.chain(cases, probes, source(graphs, seed))
    workers = {name: _Worker(name) for name in names}
    results: dict[str, list[Result]] = {name: [] for name in names}
    bar = Progress(len(cases) + len(probes) + graphs, f"conformance of {', '.join(names)}", enabled=progress,
                   unit="model")
    try:
        for subject in todo:
            try:
                ref = reference(subject, seed)
            except Exception as e:  # noqa: BLE001 - a subject the reference cannot run is a result too
                for name in names:
                    results[name].append(_result(subject, ERROR, f"the float64 reference failed: {e}"))
                bar.update()
                continue
            plain = dataclasses.replace(subject, expand=None)
            for name in names:
                results[name].append(workers[name].run(plain, ref))
            bar.update()
    finally:
        bar.close()
        for w in workers.values():
            w.close()
    return {name: build_table(name, versions[name], results[name], graphs=getattr(source, "__name__", "custom"),
                              seed=seed) for name in names}


def write_table(table: dict, folder=TABLES) -> list[Path]:
    """``<runtime>.json`` and ``<runtime>.txt`` in ``folder`` (by default the checked-in tables)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    base = folder / table["runtime"]
    json_path, text_path = base.with_suffix(".json"), base.with_suffix(".txt")
    json_path.write_text(json.dumps(table, indent=1, ensure_ascii=False) + "\n")
    text_path.write_text(text(table))
    return [json_path, text_path]


def checked_in_tables() -> list[dict]:
    """The checked-in tables, in the order of ``RUNTIMES``."""
    out = []
    for name in RUNTIMES:
        path = TABLES / f"{name}.json"
        if path.is_file():
            out.append(json.loads(path.read_text()))
    return out


def docs_section() -> str:
    """The generated section of docs/runtimes.md, from the checked-in tables."""
    return markdown(checked_in_tables())


__all__ = ["conformance", "write_table", "checked_in_tables", "docs_section", "TIMEOUT"]
