"""Pure figures of a long chaos run (the soak): memory slope per daemon, bounded directories.

`bench.chaos_samplers.ResourceSampler` polls, every few seconds, each shard's
and island's resident memory (RSS, per process: a daemon killed and restarted
is a new process) and the sizes of each shard's write-ahead log segments and
checkpoints. This module turns those samples into the soak's numbers, with no
processes or files:

- `rss_slope`: one daemon's memory growth in MB (10^6 bytes) per 10 minutes: a
  least-squares slope shared by all its processes, each with its own level
  (a restarted process starts from its own baseline), over each minute's
  median RSS (an island's RSS has transient peaks of 15-35 MB) after the
  run's settling time and each process's own warm-up, up to the run's end;
- `growth`: whether a directory's size stays bounded: its level (median)
  over the second half of the measured span against the first half, its
  peaks and its slope;
- `soak_summary` and `soak_table`: the report's section and its text table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

MB = 1e6
TEN_MIN_S = 600.0
SETTLE_S = 600.0  # the run's first 10 minutes are not fitted (JAX, caches, first checkpoints)
BUCKET_S = 60.0  # the slope is fitted to each minute's median RSS of each process
WARM_S = 120.0  # nor each process's first 2 minutes (a restarted island compiles, joins,
# and its heap grows for a minute or two: 340 -> 430 MB in one run, 580 -> 626 MB in another)
RSS_TARGET_MB = 1.0  # per 10 minutes, every shard and island (issue 23)
GROWTH_TOLERANCE = 1.25  # a bounded directory's late level stays within this of its early one
GROWTH_FLOOR_BYTES = 1_000_000  # ... plus this, for directories of a few log records


def settle_s(duration_s: float) -> float:
    """Seconds of a run left out of the fits: 10 minutes, or a third of a shorter run.

    Args:
        duration_s: the run's measured length.

    Returns:
        min(SETTLE_S, duration_s / 3).
    """
    return min(SETTLE_S, duration_s / 3)


def rss_slope(
    samples: Sequence[tuple[float, int, float]],
    after: float,
    end: float = math.inf,
    warm_s: float = WARM_S,
    bucket_s: float = BUCKET_S,
) -> float | None:
    """One daemon's memory growth: MB per 10 minutes, shared by its processes.

    Each process's samples are cut into `bucket_s` buckets, each reduced to its
    median (time, RSS): a transient peak (a step's scratch, a flush) is no
    trend. Each process keeps its own level; the slope is fitted to every
    process's deviations from its own means at once (pooled within-process least
    squares), so a restart's drop or jump is no growth, and a leak inside each
    process is.

    Args:
        samples: (time, pid, rss bytes) of one daemon, any order.
        after: only samples from this time on (e.g. the run's start + 10 minutes).
        end: and up to this time (the run's end: not its shutdown).
        warm_s: and only from each process's first sample + this.
        bucket_s: bucket length (0: every sample as it is).

    Returns:
        The slope in MB per 10 minutes; None without a process of two or more
        buckets in the fitted span.
    """
    num = den = 0.0
    for points in _fitted(samples, after, end, warm_s).values():
        points = _medians(points, bucket_s) if bucket_s > 0 else points
        if len(points) < 2:
            continue
        mt = sum(t for t, _ in points) / len(points)
        my = sum(y for _, y in points) / len(points)
        num += sum((t - mt) * (y - my) for t, y in points)
        den += sum((t - mt) ** 2 for t, _ in points)
    if den <= 0:
        return None
    return num / den * TEN_MIN_S / MB


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _medians(points: list[tuple[float, float]], bucket_s: float) -> list[tuple[float, float]]:
    """(median time, median value) of each `bucket_s` bucket, from the first point on; a
    bucket whose points span less than half of it (the cut-off last one) is left out."""
    buckets: dict[int, list[tuple[float, float]]] = {}
    for t, y in points:
        buckets.setdefault(int((t - points[0][0]) // bucket_s), []).append((t, y))
    return [
        (_median([t for t, _ in b]), _median([y for _, y in b]))
        for _k, b in sorted(buckets.items())
        if b[-1][0] - b[0][0] >= bucket_s / 2
    ]


def _fitted(
    samples: Sequence[tuple[float, int, float]], after: float, end: float, warm_s: float
) -> dict[int, list[tuple[float, float]]]:
    """pid -> its sorted (time, rss) samples in [after, end] and from its first + `warm_s`."""
    first: dict[int, float] = {}
    for t, pid, _rss in samples:
        first[pid] = min(t, first.get(pid, t))
    by_pid: dict[int, list[tuple[float, float]]] = {}
    for t, pid, rss in sorted(samples):
        if after <= t <= end and t >= first[pid] + warm_s:
            by_pid.setdefault(pid, []).append((t, rss))
    return by_pid


def fitted_s(
    samples: Sequence[tuple[float, int, float]],
    after: float,
    end: float = math.inf,
    warm_s: float = WARM_S,
) -> float:
    """Seconds of samples `rss_slope` fits: each process's fitted span, summed.

    Args:
        samples: (time, pid, rss bytes) of one daemon.
        after: as for `rss_slope`.
        end: as for `rss_slope`.
        warm_s: as for `rss_slope`.

    Returns:
        The sum over processes of (last - first fitted sample time).
    """
    return sum(p[-1][0] - p[0][0] for p in _fitted(samples, after, end, warm_s).values())


def growth(samples: Sequence[tuple[float, float]], after: float, end: float) -> dict[str, Any]:
    """Whether a size over time stays bounded (a directory: log segments, checkpoints).

    A shard back from a kill takes the deltas the islands queued meanwhile into
    its log at once: its log peaks for a checkpoint or two (twice its usual
    size in one run) and is cut back. So two halves are compared by their
    levels (medians), which such peaks do not move and a log that is never cut
    back does.

    Args:
        samples: (time, bytes), any order.
        after: the measured span's start (the run's start + its settling time).
        end: its end.

    Returns:
        dict: level_first_mb and level_second_mb (medians over the two halves of
        [after, end]), peak_first_mb and peak_second_mb (their peaks),
        slope_mb_per_10min (least squares over the span), and bounded:
        level_second <= GROWTH_TOLERANCE x level_first + GROWTH_FLOOR_BYTES (None
        without samples in both halves).
    """
    mid = (after + end) / 2
    first = sorted(b for t, b in samples if after <= t < mid)
    second = sorted(b for t, b in samples if mid <= t <= end)
    span = [(t, 0, b) for t, b in samples if after <= t <= end]
    out: dict[str, Any] = {
        "level_first_mb": round(_median(first) / MB, 3) if first else None,
        "level_second_mb": round(_median(second) / MB, 3) if second else None,
        "peak_first_mb": round(first[-1] / MB, 3) if first else None,
        "peak_second_mb": round(second[-1] / MB, 3) if second else None,
        "slope_mb_per_10min": _round(rss_slope(span, after, end, warm_s=0.0, bucket_s=0.0)),
        "bounded": None,
    }
    if first and second:
        limit = GROWTH_TOLERANCE * _median(first) + GROWTH_FLOOR_BYTES
        out["bounded"] = _median(second) <= limit
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def soak_summary(
    rss: Mapping[str, Sequence[tuple[float, int, float]]],
    dirs: Mapping[str, Sequence[tuple[float, Mapping[str, float]]]],
    t0: float,
    duration_s: float,
) -> dict[str, Any]:
    """The soak section of one run's report.

    Args:
        rss: daemon name ("shard-0", "island-1", ...) -> its (time, pid, rss bytes) samples.
        dirs: shard name -> (time, sizes) samples; sizes has wal_bytes, checkpoint_bytes,
            checkpoints (files) and wal_segments (files).
        t0: the run's start.
        duration_s: its measured length.

    Returns:
        dict: settle_s; rss: name -> slope_mb_per_10min, fitted_s (seconds of samples
        fitted, over its processes), processes, samples, last_mb, peak_mb, met (slope under RSS_TARGET_MB; None when not measurable); dirs: name
        -> wal and checkpoints (`growth` of their bytes) and the most files seen
        of each; rss_met and dirs_bounded over all of them (None when not measured).
    """
    after, end = t0 + settle_s(duration_s), t0 + duration_s
    out_rss: dict[str, Any] = {}
    for name, samples in sorted(rss.items()):
        slope = rss_slope(samples, after, end)
        out_rss[name] = {
            "slope_mb_per_10min": _round(slope),
            "fitted_s": round(fitted_s(samples, after, end), 1),
            "processes": len({pid for _t, pid, _b in samples}),
            "samples": len(samples),
            "last_mb": round(samples[-1][2] / MB, 1) if samples else None,
            "peak_mb": round(max(b for _t, _p, b in samples) / MB, 1) if samples else None,
            "met": None if slope is None else slope < RSS_TARGET_MB,
        }
    out_dirs: dict[str, Any] = {}
    for name, samples in sorted(dirs.items()):
        out_dirs[name] = {
            "wal": growth([(t, s["wal_bytes"]) for t, s in samples], after, end),
            "checkpoints": growth([(t, s["checkpoint_bytes"]) for t, s in samples], after, end),
            "wal_segments_max": max((int(s["wal_segments"]) for _t, s in samples), default=0),
            "checkpoints_max": max((int(s["checkpoints"]) for _t, s in samples), default=0),
        }
    rss_met = [v["met"] for v in out_rss.values()]
    bounded = [d[k]["bounded"] for d in out_dirs.values() for k in ("wal", "checkpoints")]
    return {
        "settle_s": round(after - t0, 3),
        "rss": out_rss,
        "dirs": out_dirs,
        "rss_met": None if not rss_met or None in rss_met else all(rss_met),
        "dirs_bounded": None if not bounded or None in bounded else all(bounded),
    }


def soak_table(runs: Mapping[str, Mapping[str, Any]]) -> str:
    """The soak figures of each run as a text table (for the README and the log).

    Args:
        runs: run name -> its report (with a "soak" section).

    Returns:
        One line per daemon and run: RSS slope, processes, last and peak RSS; then
        one per shard directory: WAL and checkpoint levels (first / second half),
        the WAL's peak, the most files seen and whether both stay bounded.
    """
    lines = [
        f"{'run':<11} {'daemon':<10} {'RSS MB/10min':>12} {'procs':>5} {'last MB':>8} "
        f"{'peak MB':>8}"
    ]
    for run, report in runs.items():
        for name, r in report.get("soak", {}).get("rss", {}).items():
            slope = "-" if r["slope_mb_per_10min"] is None else f"{r['slope_mb_per_10min']:+.3f}"
            lines.append(
                f"{run:<11} {name:<10} {slope:>12} {r['processes']:>5} "
                f"{r['last_mb'] or 0:>8.1f} {r['peak_mb'] or 0:>8.1f}"
            )
    lines.append(
        f"{'run':<11} {'shard dir':<10} {'WAL MB level 1st/2nd':>20} {'peak':>6} "
        f"{'ckpt MB level':>14} {'segs':>4} {'ckpts':>5} bounded"
    )
    for run, report in runs.items():
        for name, d in report.get("soak", {}).get("dirs", {}).items():
            wal, ckpt = d["wal"], d["checkpoints"]
            peak = max(wal["peak_first_mb"] or 0.0, wal["peak_second_mb"] or 0.0)
            lines.append(
                f"{run:<11} {name:<10} {_pair(wal):>20} {peak:>6.2f} {_pair(ckpt):>14} "
                f"{d['wal_segments_max']:>4} {d['checkpoints_max']:>5} "
                f"{wal['bounded'] and ckpt['bounded']}"
            )
    return "\n".join(lines)


def _pair(g: Mapping[str, Any]) -> str:
    a, b = g["level_first_mb"], g["level_second_mb"]
    return "-" if a is None or b is None else f"{a:.2f} / {b:.2f}"
