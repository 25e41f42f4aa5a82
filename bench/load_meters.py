"""What `diloco-bench load` measures with: disk fsync rate, CPU, RSS, and the rates it reports.

Pure helpers (`percentile`, `rates`, `spread`, `milliseconds`) and three meters
(`fsync_rate`, `CpuMeter`, `RssSampler`); the run itself is `bench.load`.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

FSYNC_PROBE_S = 2.0  # each fsync measurement (before and after the pushes) lasts this long


def fsync_rate(directory: Path, nbytes: int, duration_s: float = FSYNC_PROBE_S) -> float:
    """Writes + fsyncs of `nbytes` per second in `directory` (what a shard's log does per push).

    Args:
        directory: a directory on the disk to measure (the shards' data dir).
        nbytes: bytes per write (appended: the file grows like a log).
        duration_s: how long to measure.

    Returns:
        Write+fsync pairs per second.
    """
    path = directory / ".fsync-probe"
    block = os.urandom(nbytes)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        count, start = 0, time.monotonic()
        while (elapsed := time.monotonic() - start) < duration_s:
            os.write(fd, block)
            os.fsync(fd)
            count += 1
    finally:
        os.close(fd)
        path.unlink()
    return count / elapsed


class CpuMeter:
    """CPU time used by some processes and by the whole machine between `start` and `stop`."""

    def __init__(self, pids: dict[str, int]) -> None:
        """Args:
        pids: name -> process (a vanished one reads as None).
        """
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self._t0 = 0.0
        self._cpu0: dict[str, float | None] = {}
        self._machine0 = psutil.cpu_times()

    def _cpu(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for name, proc in self.procs.items():
            try:
                times = proc.cpu_times()
                out[name] = times.user + times.system
            except psutil.Error:
                out[name] = None
        return out

    def start(self) -> None:
        """Start measuring."""
        self._t0, self._cpu0, self._machine0 = time.monotonic(), self._cpu(), psutil.cpu_times()

    def stop(self) -> dict[str, Any]:
        """Cores busy since `start`: per process (1.0 = one core), and the machine's share.

        Returns:
            {"cores": n, "machine_busy": share of all cores, "<name>": cores used, ...}.
        """
        elapsed = max(1e-9, time.monotonic() - self._t0)
        machine = psutil.cpu_times()
        idle = (machine.idle + getattr(machine, "iowait", 0.0)) - (
            self._machine0.idle + getattr(self._machine0, "iowait", 0.0)
        )
        total = sum(machine) - sum(self._machine0)
        out: dict[str, Any] = {
            "cores": psutil.cpu_count(),
            "machine_busy": round(1 - idle / total, 3) if total > 0 else None,
        }
        for name, used in self._cpu().items():
            before = self._cpu0.get(name)
            out[name] = (
                None if used is None or before is None else round((used - before) / elapsed, 3)
            )
        return out


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) of `values`, or None when empty.

    Args:
        values: samples.
        q: percentile in [0, 100].

    Returns:
        The percentile (linear interpolation), or None.
    """
    return float(np.percentile(values, q)) if values else None


def rates(pushes: int, elapsed_s: float, fsync_before: float, fsync_after: float) -> dict:
    """The load test's rates: pushes per second, fsyncs per second, and their ratio.

    Args:
        pushes: pushes acked in the measured window.
        elapsed_s: its length.
        fsync_before: fsyncs per second measured before the window.
        fsync_after: and after it.

    Returns:
        {"pushes_per_s", "fsync_per_s" (the mean of before and after),
        "pushes_per_fsync"}; the push figures are None for an empty window.
    """
    fsync_per_s = (fsync_before + fsync_after) / 2
    pushes_per_s = pushes / elapsed_s if elapsed_s > 0 else None
    return {
        "pushes_per_s": None if pushes_per_s is None else round(pushes_per_s, 1),
        "fsync_per_s": round(fsync_per_s, 1),
        "pushes_per_fsync": None
        if pushes_per_s is None or fsync_per_s <= 0
        else round(pushes_per_s / fsync_per_s, 3),
    }


class RssSampler(threading.Thread):
    """Samples the RSS of a set of processes until stopped; keeps the peak per process."""

    def __init__(self, pids: list[int], interval_s: float = 0.2) -> None:
        """Args:
        pids: processes to watch (a vanished one is skipped).
        interval_s: sampling period.
        """
        super().__init__(name="rss-sampler", daemon=True)
        self.procs = {pid: psutil.Process(pid) for pid in pids}
        self.peak: dict[int, int] = dict.fromkeys(pids, 0)
        self.interval_s = interval_s
        self.stop_event = threading.Event()

    def run(self) -> None:
        """Sample until `stop_event` is set."""
        while not self.stop_event.is_set():
            for pid, proc in self.procs.items():
                try:
                    self.peak[pid] = max(self.peak[pid], proc.memory_info().rss)
                except psutil.Error:
                    continue
            self.stop_event.wait(self.interval_s)


def milliseconds(seconds: float | None) -> float | None:
    """Seconds as milliseconds rounded to 0.01 (None stays None)."""
    return None if seconds is None else round(seconds * 1000, 2)


def spread(values: list[float]) -> dict[str, float] | None:
    """min / median / max of the islands' values (None when there are none)."""
    if not values:
        return None
    return {
        k: round(float(f(values)), 3) for k, f in (("min", min), ("p50", np.median), ("max", max))
    }
