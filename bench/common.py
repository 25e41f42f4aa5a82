"""Helpers shared by bench modules: timing, memcpy reference, progress, JSON.

Owns how a measurement is taken (median of repeats, after a warm-up), the
memcpy reference every throughput is compared with, the stderr progress
display, and JSON output on stdout.
"""

import contextlib
import json
import statistics
import sys
import time

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


def timed(fn, repeats: int, warmup: int = 1) -> list[float]:
    """Wall-clock seconds of `fn()` over repeats.

    Args:
        fn: callable without arguments.
        repeats: measured calls.
        warmup: unmeasured calls first.

    Returns:
        list of seconds, one per measured call.
    """
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def gbps(nbytes: int, seconds: list[float]) -> dict:
    """Throughput summary.

    Args:
        nbytes: bytes processed per call.
        seconds: durations of the calls.

    Returns:
        {"median": GB/s at the median time, "best": GB/s at the fastest}.
    """
    return {
        "median": nbytes / statistics.median(seconds) / 1e9,
        "best": nbytes / min(seconds) / 1e9,
    }


def memcpy_gbps(nbytes: int, repeats: int = 9) -> dict:
    """numpy memcpy throughput: np.copyto into an existing array.

    Args:
        nbytes: bytes per copy (use the size of the data being measured).
        repeats: measured copies.

    Returns:
        gbps() summary.
    """
    src = np.ones(max(nbytes // 4, 1), np.float32)
    dst = np.empty_like(src)
    return gbps(src.nbytes, timed(lambda: np.copyto(dst, src), repeats))


@contextlib.contextmanager
def progress():
    """A rich progress display on stderr.

    Returns:
        context manager yielding a rich Progress.
    """
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=False,
    ) as p:
        yield p


def emit_json(obj) -> None:
    """Write a result as indented JSON on stdout.

    Args:
        obj: JSON-serializable object (numpy scalars allowed).
    """
    json.dump(obj, sys.stdout, indent=2, default=_plain)
    sys.stdout.write("\n")
    sys.stdout.flush()


def _plain(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def human_bytes(n: float | None) -> str:
    """A byte count for people: 950 B, 1.2 KB, 3.4 MB (powers of 1000); "-" for None.

    Args:
        n: bytes, or None.

    Returns:
        The formatted count.
    """
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
