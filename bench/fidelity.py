"""Reproduce Decoupled DiLoCo's quorum table and DiLoCo's parity with DDP, with real daemons.

    diloco-bench fidelity [--quick | --smoke] [--seeds N] [--only NAME,...] [--resume] --out DIR

One harness, same model, data, seeds and token budget for every scenario of a
group (`bench.fidelity_plan`): group A compares DDP, synchronous DiLoCo at H =
10, 30, 100 and this system on homogeneous islands; group B is the quorum table
(K = all, K = 1, K = 1 + eq3 grace; mean and RDA merges; K = 1 + grace with
fp32 deltas, the overwrite fold, or the exchange inside `step` instead of
beside training) on the v6e/v5p speed mix and on a mix with one island 2x
slower. Every scenario runs once per seed with real `diloco-server` shards and
`diloco-worker` islands on loopback (`bench.runs`); the numbers come from
`bench.fidelity_claims`.

Writes DIR/runs/seed<k>/<name>.json per run, DIR/fidelity.json (pinned keys:
`scenarios`, `claims`; also `price_of_staleness`: `bench.fidelity_staleness`),
DIR/fidelity.md (claims table first, then the price of staleness) and PNGs (loss
against tokens per group, staleness histograms, goodput/loss bars of the quorum
table); prints
fidelity.json on stdout. Progress (scenario, seed, tokens) goes to stderr.
`--quick`: tiny model, 1 seed, group B's core (ddp, sync, k_all, k1, k1_grace),
under 10 minutes on 2 cores; the full run takes about 90 minutes. `--resume`
reuses the runs an interrupted invocation of the same plan already wrote.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench import (
    child,
    cli,
    fidelity_claims,
    fidelity_plan,
    fidelity_report,
    fidelity_staleness,
    outdir,
    plots,
    runs,
)
from bench.common import emit_json, progress
from bench.launcher import LaunchError, PortTaken


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench fidelity`."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="tiny model, 1 seed, group B's core")
    size.add_argument("--smoke", action="store_true", help="a 3-scenario check of the harness")
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds per scenario (default: 2 full, 1 quick/smoke)")  # fmt: skip
    parser.add_argument("--only", default="", help="comma-separated scenario names to run")
    parser.add_argument("--resume", action="store_true",
                        help="keep DIR and reuse every run whose runs/seed<k>/<name>.json exists "
                        "(an interrupted run of the same plan)")  # fmt: skip
    parser.add_argument("--out", default="runs/fidelity",
                        help="output directory (new, empty, or one this command made)")  # fmt: skip


def _select(groups: list, only: str) -> list:
    if not only:
        return groups
    wanted = set(only.split(","))
    known = {s.name for g in groups for s in g.scenarios}
    if wanted - known:
        raise ValueError(f"unknown scenario(s) {sorted(wanted - known)}; known: {sorted(known)}")
    return [
        dataclasses.replace(g, scenarios=tuple(s for s in g.scenarios if s.name in wanted))
        for g in groups
        if any(s.name in wanted for s in g.scenarios)
    ]


def run(args: argparse.Namespace) -> int:
    """Run the harness; returns the exit code."""
    if args.smoke:
        groups, kind = fidelity_plan.smoke(), "smoke"
    elif args.quick:
        groups, kind = fidelity_plan.quick(), "quick"
    else:
        groups, kind = fidelity_plan.full(), "full"
    seeds_n = args.seeds if args.seeds is not None else (2 if kind == "full" else 1)
    if seeds_n < 1:
        print(f"diloco-bench fidelity: --seeds {seeds_n} must be >= 1", file=sys.stderr)
        return 2
    try:
        groups = _select(groups, args.only)
    except ValueError as exc:
        print(f"diloco-bench fidelity: {exc}", file=sys.stderr)
        return 2
    out = outdir.claim(Path(args.out), "fidelity", keep=args.resume)
    child.sigterm_unwinds()  # every daemon is stopped
    seeds = list(range(seeds_n))
    started = time.monotonic()
    entries: dict[str, dict] = {}
    total = sum(len(g.scenarios) for g in groups) * len(seeds)
    done = 0
    try:
        with progress() as p:
            overall = p.add_task("fidelity", total=total)
            for group in groups:
                for scenario in group.scenarios:
                    budget = dataclasses.replace(
                        group.budget, inner_steps=scenario.inner_steps or group.budget.inner_steps
                    )
                    records = []
                    for seed in seeds:
                        seeded = dataclasses.replace(budget, seed=seed)
                        label = f"[{done + 1}/{total}] {scenario.name} seed {seed}"
                        task = p.add_task(label, total=seeded.tokens)

                        def update(tokens: int, note: str, task=task, label=label,
                                   cap=seeded.tokens) -> None:  # fmt: skip
                            p.update(task, completed=min(tokens, cap),
                                     description=f"{label}: {note}")  # fmt: skip

                        runs_dir = out / "runs" / f"seed{seed}"
                        runs_dir.mkdir(parents=True, exist_ok=True)
                        done_json = runs_dir / f"{scenario.name}.json"
                        if args.resume and done_json.exists():
                            record = json.loads(done_json.read_text())  # an earlier run's
                        else:
                            record = _run_once(scenario, seeded, runs_dir, update)
                        records.append(record)
                        p.remove_task(task)
                        done += 1
                        p.update(overall, completed=done)
                        p.console.log(f"{label}: eval loss {_fmt(record.get('eval_final'))}, "
                                      f"{record['duration_s']:.0f} s")  # fmt: skip
                    entries[scenario.name] = fidelity_claims.summarize(
                        scenario, budget, records, seeds
                    )
    except LaunchError as exc:
        print(f"diloco-bench fidelity: {exc}", file=sys.stderr)
        return 1
    claims = fidelity_claims.evaluate(entries)
    meta = {
        "command": f"diloco-bench fidelity{'' if kind == 'full' else ' --' + kind} "
        f"--seeds {seeds_n} --out {out}",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "elapsed_s": time.monotonic() - started,
        "groups": [
            {"name": g.name, "title": g.title, "budget": {**dataclasses.asdict(g.budget),
                                                          "tokens": g.budget.tokens}}
            for g in groups
        ],
    }  # fmt: skip
    staleness = fidelity_staleness.price(entries)
    report = {**meta, "claims": claims, "price_of_staleness": staleness,
              "scenarios": list(entries.values())}  # fmt: skip
    (out / "fidelity.json").write_text(json.dumps(report, indent=2))
    (out / "fidelity.md").write_text(fidelity_report.render(meta, claims, entries))
    plots.write_fidelity_plots(groups, entries, out)
    print(f"wrote {out / 'fidelity.md'}", file=sys.stderr)
    scenarios = [{k: v for k, v in e.items() if k != "eval_curves"} for e in entries.values()]
    emit_json({**report, "scenarios": scenarios})  # the curves are in fidelity.json
    return 0


def _run_once(scenario: Any, budget: Any, runs_dir: Path, update: Any) -> dict[str, Any]:
    """One scenario run in a fresh directory; a port taken meanwhile by another process
    (between picking a free port and binding it) is retried once on new ports."""
    for attempt in (1, 2):
        partial = runs_dir / scenario.name
        if partial.exists():  # an interrupted attempt of ours: its server data must not be reused
            shutil.rmtree(partial)
        try:
            return runs.run_scenario(scenario, budget, None, runs_dir, update)
        except PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


if __name__ == "__main__":
    sys.exit(cli.main(["fidelity", *sys.argv[1:]]))
