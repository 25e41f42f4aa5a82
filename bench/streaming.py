"""Streaming fragments against round-end pushes: peak/average bytes per second at the island's socket, and loss.

    diloco-bench streaming [--quick] [--out DIR] [--fragments P] [--inner-steps H]
                           [--rounds R] [--islands N]

Runs the same local cluster twice, `--streaming false` (the baseline: every
fragment pushed at the round's end) and `--streaming true` (fragment p of P
pushed at inner step floor(p * H / P) of each round, `worker.push_thread`):
one shard with `--fragments P`, N islands of the same speed, the same seed,
data shards, H and rounds, so both runs put the same tokens into the model.
Each island reaches the shard's ROUTER through its own port of a counting
relay (`bench.children.meter`), so the bytes of each island's socket are
counted as they cross, in 10 ms buckets cut into 1 s windows here.

Per island and run: the peak window's bytes per second over the average
bytes per second, from the start barrier to the middle of the last round
("steady": the streaming run's final flush of unsent work, a one-off burst
when an island stops, is left out, while the baseline's last round-end push
stays in) and over the whole run (to the island's exit, flush included). The
average counts every second, idle ones too, so a round of R seconds whose
bytes all leave at once gives a peak/average of about R (about P when a round
lasts P seconds), and P fragments spread over it about 1 once their spacing
R / P is at most about half a window. Then the final eval loss of each run
(the global model once every acked delta is merged) and their relative
difference. Prints one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import child, outdir
from bench.common import emit_json
from bench.launcher import IslandSpec, LaunchError, LocalCluster, free_base_port

WINDOW_S = 1.0
TARGET_PEAK_TO_AVG = 1.5
TARGET_LOSS_DIFF = 0.01


@dataclasses.dataclass(frozen=True)
class Settings:
    """One comparison: the cluster and the training budget of both runs."""

    islands: int = 2
    fragments: int = 8
    inner_steps: int = 400  # rounds of about P seconds here: the baseline's burst is about P
    rounds: int = 4
    batch_size: int = 8
    seq_len: int = 64
    model: str = "tiny"
    seed: int = 0
    eval_batches: int = 8


# rounds must span a few 1 s windows (about 100 x 25 ms here) or no burst shows in them
QUICK = Settings(fragments=4, inner_steps=100, rounds=3, eval_batches=4)


def window_bytes(
    buckets: Mapping[str, int], bucket_s: float, t0: float, t1: float, window_s: float = WINDOW_S
) -> list[int]:
    """Bytes per window of `window_s` seconds from `t0`, for the buckets that start in [t0, t1).

    Args:
        buckets: bucket index (as text; bucket k covers [k * bucket_s, (k + 1) * bucket_s)) -> bytes.
        bucket_s: bucket width in seconds.
        t0: start of the first window (wall time).
        t1: end of the measured span (> t0).
        window_s: window width.

    Returns:
        ceil((t1 - t0) / window_s) byte counts, the last window possibly partial.
    """
    if not t1 > t0:
        raise ValueError(f"t1 must be after t0, got {t0} .. {t1}")
    out = [0] * math.ceil((t1 - t0) / window_s)
    for key, nbytes in buckets.items():
        start = int(key) * bucket_s
        if t0 <= start < t1:
            out[min(int((start - t0) // window_s), len(out) - 1)] += nbytes
    return out


def peak_to_average(windows: Sequence[int], seconds: float, window_s: float = WINDOW_S) -> dict:
    """Peak window rate against the average rate over `seconds`.

    Args:
        windows: bytes per window.
        seconds: the span the windows cover (the average divides by it).
        window_s: window width.

    Returns:
        {"peak_bps", "avg_bps", "peak_to_avg" (None without bytes), "seconds", "bytes"}.
    """
    total = sum(windows)
    peak = max(windows, default=0) / window_s
    avg = total / seconds if seconds > 0 else 0.0
    return {
        "peak_bps": round(peak, 1),
        "avg_bps": round(avg, 1),
        "peak_to_avg": round(peak / avg, 3) if avg > 0 else None,
        "seconds": round(seconds, 3),
        "bytes": total,
    }


def steady_end(rows: Sequence[Mapping[str, Any]]) -> float | None:
    """The middle of an island's last round (wall time), from its metrics rows.

    Args:
        rows: metrics.jsonl rows; round rows carry "round", "wall" and "loss".

    Returns:
        (end of the next-to-last round + end of the last round) / 2, or None with
        fewer than two rounds.
    """
    walls = [r["wall"] for r in sorted((r for r in rows if "loss" in r), key=lambda r: r["round"])]
    return (walls[-2] + walls[-1]) / 2 if len(walls) >= 2 else None


def _model_flags(s: Settings) -> list[str]:
    return ["--model", s.model, "--batch-size", str(s.batch_size), "--seq-len", str(s.seq_len),
            "--eval-batches", str(s.eval_batches), "--seed", str(s.seed)]  # fmt: skip


def _meter_argv(pairs: dict[int, int], out: Path) -> list[str]:
    argv = [sys.executable, "-m", "bench.children.meter", "--out", str(out)]
    for listen, target in pairs.items():
        argv += ["--pair", f"127.0.0.1:{listen}=127.0.0.1:{target}"]
    return argv


def run_once(s: Settings, streaming: bool, out: Path, timeout_s: float = 900.0) -> dict[str, Any]:
    """One run of the comparison: a 1-shard cluster, N islands behind the meter relay.

    Args:
        s: the settings.
        streaming: the islands' `--streaming`.
        out: the run's directory (new).
        timeout_s: bound on the islands' training.

    Returns:
        {"streaming", "islands": {name: per-island figures; bytes_up_total counts every
        byte the island's socket sent, its join included}, "peak_to_avg" (the largest
        steady figure over the islands), "whole_run_peak_to_avg", "bytes_up",
        "tokens", "final_eval_loss"} (or "error").
    """
    cluster = LocalCluster(out, shards=1, server_args=(
        "--fragments", str(s.fragments), "--fsync", "false",
        "--checkpoint-every-steps", "0", "--checkpoint-every-s", "0"))  # fmt: skip
    shard_router = cluster.port
    relay_base = free_base_port(s.islands)
    names = [f"island-{i}" for i in range(s.islands)]
    counts_file = out / "meter.json"
    start_file = out / "start"
    meter = None
    try:
        cluster.start_server()
        meter_argv = _meter_argv(
            {relay_base + i: shard_router for i in range(s.islands)}, counts_file
        )
        meter = child.start(meter_argv, "meter relay")
        specs = [
            IslandSpec(
                name,
                1.0,
                (
                    *_model_flags(s),
                    "--connect",
                    f"tcp://127.0.0.1:{relay_base + i}",
                    "--inner-steps",
                    str(s.inner_steps),
                    "--max-rounds",
                    str(s.rounds),
                    "--data-shard",
                    str(i),
                    "--eval-every",
                    "0",
                    "--warmup-steps",
                    "20",
                    "--streaming",
                    str(streaming).lower(),
                    "--start-file",
                    str(start_file),
                    "--flush-timeout-s",
                    "30",
                ),
            )  # fmt: skip
            for i, name in enumerate(names)
        ]
        cluster.start_islands(specs)
        start_file.touch()
        t0 = time.time()
        deadline = time.monotonic() + timeout_s
        while not all(any(r.get("final") for r in cluster.island_metrics(n)) for n in names):
            if time.monotonic() > deadline:
                raise LaunchError(f"islands did not finish {s.rounds} rounds in {timeout_s:g}s")
            time.sleep(0.2)
        meter.stop(30.0)
        final = cluster.final_eval(_model_flags(s))
    finally:
        if meter is not None:
            meter.stop(30.0)  # a no-op when it already stopped
        cluster.stop()
    counts = json.loads(counts_file.read_text())
    islands = {}
    for i, name in enumerate(names):
        rows = cluster.island_metrics(name)
        up = counts["links"][str(relay_base + i)]["up"]
        t_end = max(r["wall"] for r in rows)
        t_steady = steady_end(rows) or t_end
        round_s = sorted(r["round_s"] for r in rows if "round_s" in r)
        islands[name] = {
            "steady": peak_to_average(
                window_bytes(up, counts["bucket_s"], t0, t_steady), t_steady - t0
            ),
            "whole_run": peak_to_average(
                window_bytes(up, counts["bucket_s"], t0, t_end), t_end - t0
            ),
            "bytes_up_total": sum(up.values()),
            "round_s_median": round_s[len(round_s) // 2] if round_s else None,
            # seconds between two fragment pushes with streaming; the 1 s windows see
            # about 1 / spacing fragments each, so the figure nears 1 once it is <= 0.5 s
            "push_spacing_s": round(round_s[len(round_s) // 2] / s.fragments, 3)
            if round_s
            else None,
            "tokens": max((r.get("tokens", 0) for r in rows), default=0),
        }
    ratios = [v["steady"]["peak_to_avg"] for v in islands.values()]
    whole = [v["whole_run"]["peak_to_avg"] for v in islands.values()]
    return {
        "streaming": streaming,
        "islands": islands,
        "peak_to_avg": max((r for r in ratios if r is not None), default=None),
        "whole_run_peak_to_avg": max((r for r in whole if r is not None), default=None),
        "bytes_up": sum(v["bytes_up_total"] for v in islands.values()),
        "tokens": sum(v["tokens"] for v in islands.values()),
        "final_eval_loss": final.get("eval_loss"),
        **({"final_eval_error": final["error"]} if "error" in final else {}),
    }


def compare(s: Settings, out: Path, progress=lambda line: None) -> dict[str, Any]:
    """Both runs and the comparison.

    Args:
        s: the settings.
        out: directory for the two runs (baseline/, streaming/).
        progress: called with a line per stage.

    Returns:
        The JSON document `diloco-bench streaming` prints.
    """
    runs = {}
    for label, streaming in (("baseline", False), ("streaming", True)):
        progress(f"run {label} (--streaming {str(streaming).lower()})")
        runs[label] = run_once(s, streaming, out / label)
        progress(f"run {label}: peak/avg {runs[label]['peak_to_avg']}")
    base, stream = runs["baseline"]["final_eval_loss"], runs["streaming"]["final_eval_loss"]
    diff = (stream - base) / base if base and stream is not None else None
    ratio = runs["streaming"]["peak_to_avg"]
    return {
        "settings": dataclasses.asdict(s),
        "window_s": WINDOW_S,
        "runs": runs,
        "peak_to_avg": {k: v["peak_to_avg"] for k, v in runs.items()},
        "whole_run_peak_to_avg": {k: v["whole_run_peak_to_avg"] for k, v in runs.items()},
        "final_eval_loss": {k: v["final_eval_loss"] for k, v in runs.items()},
        "loss_relative_difference": round(diff, 5) if diff is not None else None,
        "equal_tokens": runs["baseline"]["tokens"] == runs["streaming"]["tokens"],
        "targets": {
            "peak_to_avg_max": TARGET_PEAK_TO_AVG,
            "peak_to_avg_met": ratio is not None and ratio <= TARGET_PEAK_TO_AVG,
            "loss_within": TARGET_LOSS_DIFF,
            "loss_met": diff is not None and abs(diff) <= TARGET_LOSS_DIFF,
            # the claim itself (timing: a bench figure, not a test): streaming spreads the burst
            "burst_flattened": ratio is not None
            and runs["baseline"]["peak_to_avg"] is not None
            and ratio < runs["baseline"]["peak_to_avg"],
        },
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench streaming`."""
    parser.add_argument(
        "--quick", action="store_true", help="small and fast (P=4, H=100, 3 rounds)"
    )
    parser.add_argument("--out", help="keep the runs here (a new or earlier bench output dir)")
    parser.add_argument("--fragments", type=int, help="P, fragments of the plan (8; quick 4)")
    parser.add_argument("--inner-steps", type=int, help="H (400; quick 100)")
    parser.add_argument("--rounds", type=int, help="rounds per island, >= 2 (4; quick 3)")
    parser.add_argument("--islands", type=int, help="island daemons of each run (default 2)")


def run(args: argparse.Namespace) -> int:
    """Run both and print the JSON document."""
    s = QUICK if args.quick else Settings()
    given = {"fragments": args.fragments, "inner_steps": args.inner_steps,
             "rounds": args.rounds, "islands": args.islands}  # fmt: skip
    s = dataclasses.replace(s, **{k: v for k, v in given.items() if v is not None})
    if s.fragments < 1 or s.inner_steps < 1 or s.rounds < 2 or s.islands < 1:
        print("diloco-bench streaming: need --fragments, --inner-steps, --islands >= 1 "
              "and --rounds >= 2", file=sys.stderr)  # fmt: skip
        return 2
    holder = contextlib.nullcontext(args.out) if args.out else tempfile.TemporaryDirectory()
    with holder as where:
        out = outdir.claim(Path(where), "streaming") if args.out else Path(where)
        result = compare(s, out, lambda line: print(f"streaming: {line}", file=sys.stderr))
    emit_json(result)
    return 0
