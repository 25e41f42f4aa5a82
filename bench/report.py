"""Benchmarks that reproduce the seed's claims: DDP vs synchronous DiLoCo vs this system on WAN links.

    diloco-bench report [--quick] --out DIR [--islands N] [--only NAME,...] [--force-relay]

Runs every scenario of `bench.scenarios` (quick: the CI smoke set, ~3 min on
2 cores; full: methods, codecs, slow and mixed islands, < 30 min) with real
daemons on emulated WAN links (`bench.wan`), then writes DIR/runs/<name>.json
per run, DIR/report.json, DIR/report.md and the PNG plots, and prints the
summary JSON on stdout. Progress goes to stderr. DIR must be new, empty or the
output of an earlier bench run (see `bench.outdir`); anything else is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from bench import child, claims, cli, outdir, plots, projection, report_md, runs, scenarios
from bench.common import emit_json, progress
from bench.launcher import LaunchError
from bench.wan import Wan, WanError
from worker import island_files


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench report`."""
    parser.add_argument("--quick", action="store_true", help="the small CI smoke report")
    parser.add_argument(
        "--out",
        default="runs/report",
        help="output directory (default runs/report); must be new, empty or an earlier report's",
    )
    parser.add_argument(
        "--islands", type=int, default=3, help="islands in the full report (default 3)"
    )
    parser.add_argument("--only", default="", help="comma-separated scenario names to run")
    parser.add_argument(
        "--force-relay",
        action="store_true",
        help="shape in bench.children.relay, not network namespaces",
    )


def _machine() -> str:
    return f"{platform.node()}, {os.cpu_count()} CPUs, {platform.machine()}, Python " + (
        platform.python_version()
    )


def run(args: argparse.Namespace) -> int:
    """Run the report; returns the exit code."""
    budget, chosen = scenarios.quick() if args.quick else scenarios.full(args.islands)
    if args.islands < 2:
        print("diloco-bench report: --islands must be >= 2", file=sys.stderr)
        return 2
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {s.name for s in chosen}
        if unknown:
            print(f"diloco-bench report: unknown scenario(s) {sorted(unknown)}", file=sys.stderr)
            return 2
        chosen = [s for s in chosen if s.name in wanted]
    out = outdir.claim(Path(args.out), "report")
    (out / "runs").mkdir()
    child.sigterm_unwinds()  # daemons and namespaces go away
    started = time.monotonic()
    records: dict[str, dict[str, Any]] = {}
    try:
        with Wan(budget.islands, budget.link, force_relay=args.force_relay) as wan, progress() as p:
            link = wan.describe()
            for scenario in chosen:
                total = scenario.budget_of(budget).tokens
                task = p.add_task(f"{scenario.name}: starting", total=total)

                def update(tokens: int, note: str, task=task, name=scenario.name, total=total):
                    p.update(task, completed=min(tokens, total), description=f"{name}: {note}")

                what = "fp32 gradients" if scenario.method == "ddp" else f"{scenario.codec} deltas"
                p.console.log(f"{scenario.name}: starting ({scenario.method}, {what})")
                records[scenario.name] = record = runs.run_scenario(
                    scenario, budget, wan, out / "runs", update
                )
                p.console.log(
                    f"{scenario.name}: done in {record['duration_s']:.0f} s of training, eval loss "
                    f"{_loss(record['eval_initial'])} -> {_loss(record['eval_final'])}"
                )
                p.update(task, description=f"{scenario.name}: done")
                p.stop_task(task)
    except (LaunchError, WanError) as exc:
        print(f"diloco-bench report: {exc}", file=sys.stderr)
        return 1
    summary = claims.evaluate(records)
    params = _param_count(out)
    summary["projection"] = projection.project(
        records, params, claims.ddp_bytes_per_token(records), budget.batch_size * budget.seq_len
    )
    meta = {
        "command": "diloco-bench report" + (" --quick" if args.quick else "") + f" --out {out}",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(),
        "elapsed_s": time.monotonic() - started,
        "budget": {**dataclasses.asdict(budget), "tokens": budget.tokens},
        "link": link,
        "params": params,
    }
    report = {**meta, **summary, "scenarios": [dataclasses.asdict(s) for s in chosen]}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(report_md.render(meta, records, summary))
    plots.write_plots(records, summary, claims.ddp_wan_tokens_per_s(records), out)
    print(f"wrote {out / 'report.md'}", file=sys.stderr)
    emit_json(report)
    return 0


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _param_count(out: Path) -> int | None:
    for path in sorted((out / "runs").glob(f"*/islands/*/{island_files.METRICS_FILE}")):
        for row in island_files.read_rows(path.parent):
            if "params" in row:
                return row["params"]
    return None


if __name__ == "__main__":
    sys.exit(cli.main(["report", *sys.argv[1:]]))
