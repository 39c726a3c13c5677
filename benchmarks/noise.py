"""How quiet the machine is around a benchmark's timed rounds: the load average and the CPU time other processes
used (``benchmarks.run`` marks a row noisy by it), and a bounded, spoken wait for the load to drop."""
from __future__ import annotations

import os
import sys
import time


def _proc_cpu_ticks(pid: int) -> int:
    """utime + stime of a process (all its threads), in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (FileNotFoundError, ProcessLookupError):
        return 0


def _busy_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of the whole machine from /proc/stat."""
    with open("/proc/stat") as f:
        cpu = [int(v) for v in f.readline().split()[1:]]
    idle = cpu[3] + cpu[4]  # idle + iowait
    return sum(cpu[:8]) - idle, sum(cpu[:8])


class Noise:
    """Load average and foreign CPU around one set of timed rounds."""

    def __init__(self, workers: list):  # benchmarks.run.Worker: each has .proc
        self.pids = [w.proc.pid for w in workers] + [os.getpid()]
        self.load_before = os.getloadavg()[0]
        self._ours = sum(_proc_cpu_ticks(p) for p in self.pids)
        self._busy, self._total = _busy_ticks()

    def finish(self, threads: int, max_load: float, max_foreign: float) -> dict:
        self.load_after = os.getloadavg()[0]
        busy, total = _busy_ticks()
        ours = sum(_proc_cpu_ticks(p) for p in self.pids) - self._ours
        cores = os.cpu_count() or 1
        elapsed = max(total - self._total, 1) / cores  # ticks of wall time
        foreign = max(busy - self._busy - ours, 0) / elapsed  # busy cores not ours, on average
        reasons = []
        if self.load_before > max_load:
            reasons.append(f"load {self.load_before:.1f} at start > {max_load}")
        moved = self.load_after - self.load_before
        if moved > threads + 0.5 or moved < -1.0:
            reasons.append(f"load moved {self.load_before:.1f} -> {self.load_after:.1f}")
        if foreign > max_foreign:
            reasons.append(f"{foreign:.2f} cores busy elsewhere > {max_foreign}")
        return {"load_before": self.load_before, "load_after": self.load_after, "foreign_cores": foreign,
                "noisy": "; ".join(reasons)}


def wait_quiet(max_load: float, patience: float, what: str = "") -> float:
    """Wait up to ``patience`` seconds for the 1-minute load average to drop to ``max_load``, saying so on
    stderr (when it starts waiting, every 15 s, and when it gives up and times anyway); the seconds waited."""
    start = time.time()
    load = os.getloadavg()[0]
    if load <= max_load or patience <= 0:
        return 0.0
    say = lambda text: print(f"{what}{text}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"load {load:.2f} > --max-load {max_load}: waiting up to {patience:.0f} s (--settle) for it to drop")
    told = start
    while load > max_load and time.time() - start < patience:
        time.sleep(min(2.0, max(patience - (time.time() - start), 0.0)))
        load = os.getloadavg()[0]
        if time.time() - told >= 15 and load > max_load:
            told = time.time()
            say(f"load {load:.2f} after {told - start:.0f} s, still waiting")
    waited = time.time() - start
    say(f"load {load:.2f} after {waited:.0f} s: " + ("timing now" if load <= max_load else
                                                       "timing anyway; the row will be marked noisy"))
    return waited
