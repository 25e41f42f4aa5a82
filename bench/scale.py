"""Shard memory, step, checkpoint stalls and the island exchange at scale, against issue 21's targets.

    diloco-bench scale [--params N ...] [--islands K] [--pending P] [--steps S]
                       [--checkpoint-cycles C] [--fragments F]
                       [--presets NAME ...] [--island-rounds R] [--out DIR]

Per size (`--params`, default 16M 64M 256M; 1e9, 2e5, 16M and 16000000 all
parse), smallest first: a real shard (one process, started by
`diloco-server start`) in sync mode and K client-only islands pushing random
int8 deltas (`bench.scale_shard`), twice: once with checkpoints off for its
memory and step time, once checkpointing after every round for the memory
of pending deltas and its ack latencies. JSON on stdout (also DIR/scale.json), progress on stderr; per size:

- `bytes_per_param_steady`: the shard's RSS after init and two steps, minus
  its RSS before init, over N;
- `bytes_per_param_per_pending`: the slope of its RSS over 0..P whole-model
  int8 deltas held pending right after init (islands 1.. push, island 0
  stays silent; large arrays mapped one by one in that run, so RSS follows
  what the shard holds), over N;
- `step_vs_memcpy`: the median step after the first (which compiles; `--steps`
  in all), each from the last island's last push to the last fragment's
  published update, over one memcpy of N float32 values measured in this run
  (at most 256 MiB copied; the time scales with bytes);
- `ack_p99_ms`: p99 ack wait of probe pushes (one at a time, no step) that
  overlapped no checkpoint (`quiet`) or one (`during_checkpoint`), their
  ratio; checkpoint times from the shard's log; `checkpoint_s`;
- `largest_model_params`: what one 24 GiB machine holds at these figures with
  16 pending deltas;
- `bytes_per_param_peak`: the shard's peak RSS (VmHWM) of each run minus its
  idle RSS, over N (not judged; the next size's memory estimate uses it);
- `island_side`: this process's RSS growth from before the joins to after two
  steps, over N (the islands keep no replica: `ClientConfig(keep="versions")`).

Then per preset (`--presets`, default small base, `worker.model`): the
island's exchange per round (`exchange_ms`, against memcpy of its float32
bytes) and `host_device_bytes_per_param`, for each exchange path the island
has (`bench.scale_island`). Each figure carries the issue's target and
`met`; `table` lists them as the issue's table. A size whose memory (estimated
from the last measured size, else from default figures: `bench.scale_figures`)
or disk would not fit is skipped with a note; one that fails reports `error`.
Exit 0 when every size was measured or skipped, 1 when one failed.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any, TextIO

import psutil

from bench import cli, outdir, scale_figures
from bench.common import emit_json, memcpy_gbps
from bench.launcher import LaunchError
from bench.scale_figures import judged
from paramserver.client import ClientError

DEFAULT_PARAMS = (16_000_000, 64_000_000, 256_000_000)
FRAGMENT_PARAMS = 1 << 23  # auto --fragments: at most this many parameters per fragment
MEMCPY_CAP = 256 << 20  # memcpy reference: copy at most this many bytes, scale by size
SUFFIXES = {"K": 10**3, "M": 10**6, "G": 10**9}


def parse_count(text: str) -> int:
    """A parameter count: 1e9, 2e5, 16M (10^6), 1G, 16000000.

    Args:
        text: the flag's value.

    Returns:
        The count (>= 1).

    Raises:
        argparse.ArgumentTypeError: not a positive count.
    """
    scale = SUFFIXES.get(text[-1:].upper(), 1)
    body = text[:-1] if scale != 1 else text
    try:
        value = float(body) * scale
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a count of parameters (e.g. 16M, 1e9)")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench scale`."""
    parser.add_argument(
        "--params", type=parse_count, nargs="+", default=list(DEFAULT_PARAMS), metavar="N",
        help="shard sizes, run smallest first (default 16M 64M 256M)",
    )  # fmt: skip
    parser.add_argument("--islands", type=int, default=2, help="client islands, >= 2 (default 2)")
    parser.add_argument(
        "--pending", type=int, default=4, help="whole-model deltas held pending, 1-8 (default 4)"
    )
    parser.add_argument(
        "--steps", type=int, default=4, help="steps timed; the first compiles (default 4, >= 2)"
    )
    parser.add_argument(
        "--checkpoint-cycles",
        type=int,
        default=3,
        help="rounds of the shard run that each end with a checkpoint (default 3)",
    )
    parser.add_argument(
        "--fragments", type=int, default=0,
        help=f"fragments of the shard; 0 = one per {FRAGMENT_PARAMS} parameters, at least 2",
    )  # fmt: skip
    parser.add_argument(
        "--presets", nargs="*", default=["small", "base"],
        help="island model presets (default small base; none: skip the island side)",
    )  # fmt: skip
    parser.add_argument("--island-rounds", type=int, default=5, help="rounds timed per path")
    parser.add_argument("--out", default="runs/scale", help="data dirs and scale.json go here")


def fragments_for(params: int, requested: int) -> int:
    """The shard's fragments: `requested`, or one per FRAGMENT_PARAMS parameters (at least 2)."""
    return requested or max(2, math.ceil(params / FRAGMENT_PARAMS))


def _bad_flag(args: argparse.Namespace) -> str | None:
    checks = [
        ("islands", args.islands >= 2, "needs >= 2 (island 0 holds the others' deltas pending)"),
        ("pending", 1 <= args.pending <= 8, "must be 1-8 (the shard's max_pending_per_island)"),
        ("steps", args.steps >= 2, "must be >= 2 (the RSS is read after two)"),
        ("checkpoint-cycles", args.checkpoint_cycles >= 1, "must be >= 1"),
        ("fragments", args.fragments >= 0, "must be >= 0 (0: automatic)"),
        ("island-rounds", args.island_rounds >= 1, "must be >= 1"),
    ]
    for name, ok, why in checks:
        if not ok:
            return f"--{name}={getattr(args, name.replace('-', '_'))} {why}"
    if not args.presets:
        return None
    from worker.model import MODEL_CONFIGS

    unknown = [p for p in args.presets if p not in MODEL_CONFIGS]
    if unknown:
        return f"--presets {unknown[0]!r}: use some of {', '.join(MODEL_CONFIGS)}"
    return None


def measure_size(
    out: Path, params: int, args: argparse.Namespace, last: dict | None, log: TextIO
) -> dict[str, Any]:
    """One size: check memory and disk, measure memcpy and both shard runs, judge the figures."""
    from bench.scale_shard import measure_checkpoints, measure_steady, probe_rounds

    fragments = fragments_for(params, args.fragments)
    held = max(args.pending, (args.islands - 1) * probe_rounds(args.islands, fragments))
    measured = last or {}
    entry: dict[str, Any] = {
        "params": params,
        "fragments": fragments,
        "islands": args.islands,
        "memory_estimated_from": measured.get(
            "params", "default figures (256M after issue 21's changes)"
        ),
    }
    need = scale_figures.memory_need(
        params,
        args.islands,
        held,
        measured.get("steady_bpp"),
        measured.get("pending_bpp"),
        measured.get("peak_bpp"),
    )
    out.mkdir(parents=True, exist_ok=True)
    disk = scale_figures.disk_need(params, args.islands, held)
    note = scale_figures.skip_note(
        need, psutil.virtual_memory().available
    ) or scale_figures.skip_note(disk, shutil.disk_usage(out).free, f" of disk in {out}")
    if note:
        print(f"scale: {params} parameters skipped: {note}", file=log, flush=True)
        return {**entry, "skipped": note}
    print(f"scale: {params} parameters, {fragments} fragments", file=log, flush=True)
    memcpy_s = 4 * params / (memcpy_gbps(min(4 * params, MEMCPY_CAP))["median"] * 1e9)
    try:
        steady = measure_steady(out / "steady", params, fragments, args.islands, args.steps, log)
        ckpt = measure_checkpoints(
            out / "checkpoint",
            params,
            fragments,
            args.islands,
            args.pending,
            args.checkpoint_cycles,
            log,
        )
    except (LaunchError, ClientError) as exc:
        print(f"scale: {params} parameters failed: {exc}", file=log, flush=True)
        return {**entry, "error": str(exc)}
    finally:
        _drop_state_files(out)
    return {**entry, **scale_figures.size_figures(params, memcpy_s, steady, ckpt)}


def _peak(entry: dict[str, Any]) -> float | None:
    """The shard's peak B/param of a measured size, the larger of its runs (None: unread)."""
    peaks = [v for k, v in entry["bytes_per_param_peak"].items() if k != "note" and v]
    return max(peaks, default=None)


def _drop_state_files(out: Path) -> None:
    """Delete the checkpoints and logs this run's shards wrote below `out` (GBs at large sizes)."""
    for pattern in ("checkpoint-*.ckpt", "wal-*.log"):
        for path in out.rglob(pattern):
            path.unlink(missing_ok=True)


def island_figures(island: dict[str, Any]) -> dict[str, Any]:
    """The island rows of the table for one preset: device path if present, else the host path.

    Args:
        island: `bench.scale_island.measure_island`'s result.

    Returns:
        {"host_device_bytes_per_param": judged, "exchange_device_vs_host": judged}.
    """
    path = "device" if "device" in island else "host"
    ratio = None
    if "device" in island and "host" in island:
        ratio = island["device"]["exchange_ms"] / island["host"]["exchange_ms"]
    return {
        "host_device_bytes_per_param": judged(
            "host_device_bytes_per_param", island[path]["host_device_bytes_per_param"], path=path
        ),
        "exchange_device_vs_host": judged(
            "exchange_device_vs_host",
            ratio,
            **({} if ratio is not None else {"note": "no device exchange in this build"}),
        ),
    }


def table(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every judged figure as a row: which size or preset, the issue's row, value, target, met."""
    rows = []
    for where, figures in [
        *((entry["params"], entry) for entry in report["sizes"]),
        *((preset, entry.get("figures", {})) for preset, entry in report["island"].items()),
    ]:
        for figure in figures.values():
            if isinstance(figure, dict) and "met" in figure:
                rows.append(
                    {"at": where, **{k: figure[k] for k in ("row", "value", "target", "met")}}
                )
    return rows


def run(args: argparse.Namespace, log: TextIO = sys.stderr) -> int:
    """Run `diloco-bench scale`; prints the JSON report.

    Args:
        args: parsed flags.
        log: where progress lines go.

    Returns:
        0, or 1 when a size failed, 2 for a bad flag.
    """
    bad = _bad_flag(args)
    if bad:
        print(f"diloco-bench scale: {bad}", file=log)
        return 2
    out = outdir.claim(Path(args.out), "scale")
    report: dict[str, Any] = {"command": " ".join(sys.argv), "sizes": [], "island": {}}
    last = None
    for params in sorted(set(args.params)):
        entry = measure_size(out / f"p{params}", params, args, last, log)
        report["sizes"].append(entry)
        if "bytes_per_param_steady" in entry:
            last = {
                "params": params,
                "steady_bpp": entry["bytes_per_param_steady"]["value"],
                "pending_bpp": entry["bytes_per_param_per_pending"]["value"],
                "peak_bpp": _peak(entry),
            }
    from bench.scale_island import measure_island

    for preset in args.presets:
        island = measure_island(out / "island", preset, args.island_rounds, log)
        report["island"][preset] = {**island, "figures": island_figures(island)}
    _drop_state_files(out / "island")
    report["table"] = table(report)
    (out / "scale.json").write_text(json.dumps(report, indent=2))
    emit_json(report)
    return 1 if any("error" in entry for entry in report["sizes"]) else 0


if __name__ == "__main__":
    sys.exit(cli.main(["scale", *sys.argv[1:]]))
