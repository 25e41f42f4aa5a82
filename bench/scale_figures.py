"""The figures of `diloco-bench scale` and issue 21's targets for them: pure functions.

Everything here takes numbers and returns numbers (no processes, no clock):
the targets of the issue's table (`TARGETS`) and the verdict on a figure
(`judged`), the fit of RSS against pending deltas (`slope`), which ack
latencies overlapped a checkpoint (`split_by_overlap`), the largest model a
machine holds at given bytes per parameter (`largest_model`), and the memory
a size needs before it is run (`memory_need`, `skip_note`). The runs that
produce the inputs are `bench.scale_shard` and `bench.scale_island`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

GIB = 1 << 30

# figure -> (issue 21's row, "<=" or ">=", the target). Reported with each figure as
# {"value", "target", "met"} so the output reads as the table.
TARGETS: dict[str, tuple[str, str, float]] = {
    "bytes_per_param_steady": ("steady shard memory, B/param", "<=", 10.0),
    "bytes_per_param_per_pending": ("each pending int8 delta, B/param", "<=", 1.1),
    "step_vs_memcpy": ("step vs memcpy (64M, 2 deltas, int8 downlink)", "<=", 15.0),
    "ack_p99_checkpoint_vs_quiet": ("ack p99 during a checkpoint vs quiet (256M)", "<=", 3.0),
    "largest_model_params": ("largest model on one 24 GiB machine, 16 pending", ">=", 1.2e9),
    "host_device_bytes_per_param": ("island host-device bytes per round, int8", "<=", 2.5),
    "exchange_device_vs_host": (
        "island exchange vs today's (host path), same run; issue: base",
        "<=",
        0.33,
    ),
}

MACHINE_BYTES = 24 * GIB  # "one 24 GiB machine" of the table
PENDING_FOR_LARGEST = 16  # "16 pending deltas" of the table


def met(value: float | None, op: str, target: float) -> bool | None:
    """Whether a figure meets its target.

    Args:
        value: the measured figure (None: not measured).
        op: "<=" (lower is better) or ">=".
        target: the bound.

    Returns:
        True / False, or None when there is no value.
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if op == "<=":
        return value <= target
    if op == ">=":
        return value >= target
    raise ValueError(f"op {op!r}: use '<=' or '>='")


def judged(name: str, value: float | None, digits: int = 3, **extra: Any) -> dict[str, Any]:
    """A figure with its target from `TARGETS` and whether it is met.

    Args:
        name: a key of `TARGETS`.
        value: the figure (None: not measured).
        digits: significant digits kept of the value.
        **extra: further fields (how it was measured, raw inputs).

    Returns:
        {"value", "target": "<= 10", "met", "row": the issue's row, **extra}.
    """
    row, op, target = TARGETS[name]
    shown = None if value is None else float(f"{value:.{digits}g}")
    return {
        "value": shown,
        "target": f"{op} {target:g}",
        "met": met(value, op, target),
        "row": row,
        **extra,
    }


def slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of ys against xs (None with fewer than two distinct xs).

    Args:
        xs: e.g. pending deltas held.
        ys: e.g. the shard's RSS at each.

    Returns:
        d ys / d xs.
    """
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} xs but {len(ys)} ys")
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def split_by_overlap(
    samples: Sequence[tuple[float, float]], windows: Sequence[tuple[float, float]]
) -> tuple[list[float], list[float]]:
    """Split (start, duration) samples into those overlapping no window and those overlapping one.

    Args:
        samples: (start, seconds) of each ack wait (wall-clock seconds).
        windows: (start, end) of each checkpoint.

    Returns:
        (quiet durations, durations that overlapped a window).
    """
    quiet, during = [], []
    for start, seconds in samples:
        end = start + seconds
        hit = any(start < w_end and w_start < end for w_start, w_end in windows)
        (during if hit else quiet).append(seconds)
    return quiet, during


def largest_model(
    steady_bpp: float | None,
    pending_bpp: float | None,
    idle_bytes: float,
    machine_bytes: float = MACHINE_BYTES,
    pending: int = PENDING_FOR_LARGEST,
) -> float | None:
    """Parameters one shard holds in a machine's memory at the measured bytes per parameter.

    Args:
        steady_bpp: steady bytes per parameter.
        pending_bpp: bytes per parameter of each pending delta.
        idle_bytes: the shard's RSS before init (what it costs at any size).
        machine_bytes: the memory (24 GiB in the issue).
        pending: pending deltas held at once (16 in the issue).

    Returns:
        machine_bytes - idle over steady + pending x per-pending, or None without figures.
    """
    if steady_bpp is None or pending_bpp is None:
        return None
    per_param = steady_bpp + pending * max(pending_bpp, 0.0)
    if per_param <= 0:
        return None
    return (machine_bytes - idle_bytes) / per_param


# Before a size is run, its memory is estimated from the last measured size's bytes per
# parameter; with none measured yet, from the shard's figures at 256M after issue 21's
# changes (12.9 B/param steady, 1.09 B/param per pending int8 delta), rounded up.
DEFAULT_STEADY_BPP = 13.0
DEFAULT_PENDING_BPP = 1.1
# A step's temporaries on top of the steady state, when no peak was measured (a measured
# peak, the shard's VmHWM, already holds them and the pending deltas of that run). At 16M
# and 64M both runs' peaks were within 0.1 B/param of the steady figure: a margin of 1.
STEP_SCRATCH_BPP = 1.0
# This process, the islands' side, per parameter. The islands keep no replica
# (ClientConfig(keep="versions"): no float32 copy per island, no update decoded; with one,
# 2 islands cost ~48 B/param at 16M) and the init's zeros are never-written pages. With 2
# islands it grew 246 MiB at 16M and 323 MiB at 64M: ~1.6 B/param, the rest fixed.
FRAMES_BPP = 1.1  # the int8 frames the islands push (one set, sent zero-copy by every island)
CLIENT_BPP = 0.3  # per island: its updates in flight, allocator slack (no replica)
FIXED_BYTES = 1.5 * GIB  # both processes' code, imports and fixed buffers (init pieces)


def memory_need(
    params: int,
    islands: int,
    pending: int,
    steady_bpp: float | None = None,
    pending_bpp: float | None = None,
    peak_bpp: float | None = None,
) -> float:
    """Bytes a size needs at its peak: the shard (steady, pending, a step) and the islands.

    Args:
        params: parameters of the size.
        islands: client islands in this process.
        pending: pending deltas the run holds at once.
        steady_bpp: measured steady B/param of a smaller size (None: the default figure).
        pending_bpp: measured B/param per pending delta (None: the default figure).
        peak_bpp: the shard's measured peak B/param of that size, both runs (None: steady
            + STEP_SCRATCH_BPP + the pending deltas).

    Returns:
        Bytes.
    """
    steady = DEFAULT_STEADY_BPP if steady_bpp is None else steady_bpp
    per_pending = DEFAULT_PENDING_BPP if pending_bpp is None else max(pending_bpp, 0.0)
    shard = steady + STEP_SCRATCH_BPP + pending * per_pending
    if peak_bpp is not None:
        shard = max(peak_bpp, steady + pending * per_pending)
    here = islands * CLIENT_BPP + FRAMES_BPP
    return params * (shard + here) + FIXED_BYTES


def skip_note(need: float, available: float, what: str = "") -> str | None:
    """Why a size is skipped, or None when it fits.

    Args:
        need: bytes the size needs.
        available: bytes available now.
        what: "" for memory, or e.g. " disk in DIR".

    Returns:
        "needs ~X GiB, Y free" or None.
    """
    if need <= available:
        return None
    return f"needs ~{need / GIB:.1f} GiB{what}, {available / GIB:.1f} free"


def disk_need(params: int, islands: int, pending: int) -> float:
    """Bytes of data dir a size writes: log of every push, and two checkpoints.

    Args:
        params: parameters of the size.
        islands: islands pushing.
        pending: pending deltas of the pending phase.

    Returns:
        Bytes (a checkpoint holds params, momentum and the downlink's residual).
    """
    pushes = 2 * islands + max(islands - 1, 1) * pending + 1
    return params * (pushes * FRAMES_BPP + 2 * 12.0) + GIB


def size_figures(
    params: int, memcpy_s: float, steady: dict[str, Any], checkpoints: dict[str, Any]
) -> dict[str, Any]:
    """One size's figures, each with its target, from what the two shard runs measured.

    Args:
        params: the size.
        memcpy_s: seconds of one memcpy of `params` float32 values, this run.
        steady: `bench.scale_shard.measure_steady`'s result (RSS in bytes, seconds).
        checkpoints: `bench.scale_shard.measure_checkpoints`'s result (pending RSS too).

    Returns:
        {"bytes_per_param_steady", "bytes_per_param_per_pending", "step_vs_memcpy",
        "ack_p99_ms", "checkpoint_s", "largest_model_params"}.
    """
    from bench.load_meters import milliseconds, percentile

    idle = steady["rss_idle"]
    steady_bpp = (steady["rss_steady"] - idle) / params
    held = checkpoints["pending_rss"]
    growth = slope([p for p, _ in held], [rss for _, rss in held])
    pending_bpp = None if growth is None else growth / params
    step_s = statistics.median(steady["step_s"][1:])  # the first also compiles the outer step
    windows = [(c["start"], c["end"]) for c in checkpoints["checkpoints"]]
    quiet, during = split_by_overlap(checkpoints["probes"], windows)
    quiet_p99, during_p99 = percentile(quiet, 99), percentile(during, 99)
    ratio = during_p99 / quiet_p99 if quiet_p99 and during_p99 is not None else None
    seconds = [c["seconds"] for c in checkpoints["checkpoints"]]
    mib = 1 << 20
    anon = (steady.get("anon_idle"), steady.get("anon_steady"))
    anon_bpp = None if None in anon else round((anon[1] - anon[0]) / params, 1)
    return {
        "bytes_per_param_steady": judged(
            "bytes_per_param_steady",
            steady_bpp,
            rss_idle_mib=round(idle / mib, 1),
            rss_steady_mib=round(steady["rss_steady"] / mib, 1),
            anon_bytes_per_param=anon_bpp,  # the same, less file-backed pages (library code)
        ),
        "bytes_per_param_per_pending": judged(
            "bytes_per_param_per_pending",
            pending_bpp,
            pending_rss_mib=[[p, round(rss / mib, 1)] for p, rss in held],
            allocator="MALLOC_MMAP_THRESHOLD_=1 MiB: RSS follows the arrays held",
        ),
        "step_vs_memcpy": judged(
            "step_vs_memcpy",
            step_s / memcpy_s,
            step_s=[round(s, 4) for s in steady["step_s"]],
            memcpy_ms=round(memcpy_s * 1e3, 3),
            release_of_pending_s=round(checkpoints["release_s"], 4),
        ),
        "ack_p99_ms": {
            "quiet": milliseconds(quiet_p99),
            "during_checkpoint": milliseconds(during_p99),
            "samples": {"quiet": len(quiet), "during_checkpoint": len(during)},
            **judged("ack_p99_checkpoint_vs_quiet", ratio),
            **_unmeasured_why(quiet, during),
        },
        "checkpoint_s": {
            "median": round(statistics.median(seconds), 3) if seconds else None,
            "max": max(seconds, default=None),
            "count": len(seconds),
            "bytes": checkpoints["checkpoints"][-1]["bytes"] if seconds else None,
        },
        "largest_model_params": judged(
            "largest_model_params", largest_model(steady_bpp, pending_bpp, idle)
        ),
        "bytes_per_param_peak": {
            "steady_run": _over(steady.get("rss_peak"), idle, params),
            "checkpoint_run": _over(checkpoints.get("rss_peak"), idle, params),
            "note": "the shard's peak RSS (VmHWM) minus its idle RSS, over N",
        },
        "island_side": {
            "bytes_per_param": _over(
                steady.get("bench_rss_steady"), steady.get("bench_rss_idle"), params
            ),
            "rss_idle_mib": _mib(steady.get("bench_rss_idle")),
            "rss_steady_mib": _mib(steady.get("bench_rss_steady")),
            "note": "this process (every island, no replica) after two steps minus before the"
            " joins, over N",
        },
    }


def _unmeasured_why(quiet: list[float], during: list[float]) -> dict[str, str]:
    """{"why": ...} when the checkpoint ratio has no sample on one side, else {}.

    A small model's checkpoint can be written before the first probe is pushed:
    then no probe overlapped one and the ratio is not measured (met None).
    """
    if not during:
        return {
            "why": "no probe overlapped a checkpoint (each was written before the first"
            " probe); the ratio is not measured"
        }
    if not quiet:
        return {"why": "no probe ran outside a checkpoint; the ratio is not measured"}
    return {}


def _over(value: float | None, base: float | None, params: int) -> float | None:
    """(value - base) / params to 3 digits, or None when either is missing."""
    if value is None or base is None or not value:
        return None
    return float(f"{(value - base) / params:.3g}")


def _mib(value: float | None) -> float | None:
    return None if value is None else round(value / (1 << 20), 1)
