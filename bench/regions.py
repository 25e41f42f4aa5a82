"""Emulated multi-region deployment: regions in network namespaces over shaped, delayed WAN links, probed first.

    diloco-bench regions --probe-only [--regions 4] [--scale 0.01] [--shard-regions 0]
                         [--probe-seconds 2] [--probe-rounds 3] [--prefix P] [--out DIR]
    diloco-bench regions [same flags] [--params 2000000] [--rounds 3] [--compute-s 1.0]
    diloco-bench regions --methods ddp,sync,quorum [--quick] [--target-loss L]
                         [--big-step-s 1.0] [--run-step-s 0.06] [--steps 30] [--inner-steps 10]
    diloco-bench regions --faults [--fault-scale 1.0] [same run flags]
    diloco-bench regions --cleanup [--prefix P]

Builds one network namespace per region joined through a WAN namespace
(`bench.netns`), with the links of `bench.regions_plan` (4 US regions,
30-80 ms RTT, 2-5 Gbit/s, 0.1% loss on us-east - us-west), each rate
multiplied by `--scale`. Then its own TCP probe measures, per link, what it
carries and its round-trip time through the relay, and reports achieved
against configured; a link under 90% of its rate scales every link down
(`regions_plan.rescale`), stated in the report, and the links are probed
again (up to `--probe-rounds`). Without `--probe-only` it then runs shards
and one island per region pushing synthetic int8 deltas through the real
client (`bench.regions_run`: round time against bytes / bandwidth, control
latency while transfers are in flight). With `--methods` it instead trains
DDP, synchronous DiLoCo and this system over the same links
(`bench.regions_compare`), at the link scale that gives DDP the
communication / compute ratio of a 12B model on the real links
(`bench.regions_claims.link_scale`; `--scale` is then ignored), and reports
each method's time to a target held-out loss and its loss at DDP's tokens
(the claims table; also written to `--out DIR`/regions.md). With `--faults`
the run's islands push until three faults were injected and recovered from
(`bench.regions_fault_run`: an island killed with -9 mid-push and restarted,
a region's links cut to a tenth for 60 s, a region partitioned for 30 s;
`--fault-scale` multiplies the durations) and the report scores them
(`bench.regions_faults`: acked = applied, training during each fault,
round times after against before, goodput per region). With `--out`, the
run writes its plots next to regions.json (`bench.plots.write_regions_plots`:
link utilisation over time, the round-time breakdown, and with `--faults`
round times with the fault windows shaded); "plots" in the JSON lists them. `--quick` is a
harness check, not the claim: 6 DDP steps, H = 3, batch 8, and a 10 s step
for the big model (DDP's ratio 10x lower); it took 8-10 minutes under
load 12-14 on 2 cores (3 JAX starts of 4 processes each dominate). Prints the report as JSON (and writes it to
`--out DIR`/regions.json), then tears everything down.

Everything lives in namespaces named after the run's prefix and is deleted
on exit, Ctrl-C, SIGTERM and SIGHUP; after a kill -9 the next run (or
`--cleanup`) deletes what the dead run left, and nothing else. Needs root:
without it, exit 2 with one line.

Exit status: 0 when every link held its rate and RTT after the last round, 1
otherwise (the report says which), 2 for a refused start.
"""

from __future__ import annotations

import argparse
import datetime
import json
import signal
import sys
from pathlib import Path
from typing import Any

from bench import (
    child,
    netns,
    outdir,
    plots,
    regions_claims,
    regions_compare,
    regions_fault_run,
    regions_plan,
    regions_run,
)
from bench.regions_plan import LINKS, REGIONS, Link
from bench.scenarios import Budget

LOSS_PENALTY_MS = 200.0
RUN_PARAMS = 131_712  # worker.model "tiny" (count_params); the run's rows report it too
RUN_STEP_S = 0.06  # tiny, batch 16 x 128, AdamW, one core (MEASURED.md)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's flags."""
    parser.add_argument("--probe-only", action="store_true", help="build, probe, report, tear down")
    parser.add_argument("--cleanup", action="store_true", help="remove leftovers of dead runs")
    parser.add_argument("--prefix", default=None, help="the run's name prefix (drg...)")
    parser.add_argument(
        "--regions",
        type=int,
        default=len(REGIONS),
        help="how many regions of the default table (2..4)",
    )
    parser.add_argument(
        "--scale", type=float, default=0.01, help="emulated rate = real rate x scale"
    )
    parser.add_argument(
        "--shard-regions", default="0", help="regions that hold shards (indices or names)"
    )
    parser.add_argument("--probe-seconds", type=float, default=2.0, help="stream time per link")
    parser.add_argument("--probe-pings", type=int, default=15, help="pings per link")
    parser.add_argument("--probe-rounds", type=int, default=3, help="probe/rescale rounds at most")
    run = parser.add_argument_group("the run (without --probe-only)")
    run.add_argument("--params", type=int, default=2_000_000, help="float32 parameters pushed")
    run.add_argument("--rounds", type=int, default=3, help="rounds each island pushes")
    run.add_argument(
        "--compute-s", type=float, default=1.0, help="compute per round of a speed-1.0 island"
    )
    run.add_argument("--run-timeout", type=float, default=600.0, help="bound on the islands, s")
    run.add_argument("--faults", action="store_true",
                     help="inject a kill -9, a link cut and a partition into the run")  # fmt: skip
    run.add_argument("--fault-scale", type=float, default=1.0,
                     help="the faults' durations x this (1: 60 s cut, 30 s partition)")  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=None, help="also write the report to DIR/regions.json"
    )
    cmp = parser.add_argument_group("the comparison (--methods): DDP vs sync DiLoCo vs quorum")
    cmp.add_argument("--methods", default="", help="comma list of ddp,sync,quorum (or 'all')")
    cmp.add_argument("--quick", action="store_true", help="a small comparison, < 3 min")
    cmp.add_argument("--target-loss", type=float, default=None,
                     help="held-out loss to reach (default: DDP's final loss + 1%%)")  # fmt: skip
    cmp.add_argument("--big-params", type=float, default=regions_claims.BIG_PARAMS,
                     help="parameters of the model whose comm/compute ratio DDP gets")  # fmt: skip
    cmp.add_argument("--big-step-s", type=float, default=regions_claims.BIG_STEP_S,
                     help="its compute seconds per step at speed 1.0 (the assumption)")  # fmt: skip
    cmp.add_argument("--run-step-s", type=float, default=RUN_STEP_S,
                     help="the tiny model's compute seconds per step at speed 1.0, batch 16")  # fmt: skip
    cmp.add_argument("--steps", type=int, default=None, help="DDP steps per rank (30; quick 6)")
    cmp.add_argument("--inner-steps", type=int, default=None, help="DiLoCo H (10; quick 3)")
    cmp.add_argument("--token-factor", type=float, default=None,
                     help="DiLoCo runs train up to this x DDP's tokens (2; quick 1)")  # fmt: skip
    cmp.add_argument("--method-cap-s", type=float, default=None,
                     help="bound on each method's training wall time (900; quick 60)")  # fmt: skip


def _cleanup(prefix: str | None) -> int:
    if prefix is not None:
        state = netns.state_file(prefix)
        try:
            owner = json.loads(state.read_text())
        except (OSError, json.JSONDecodeError):
            owner = {}
        if owner and netns.owner_alive(owner):
            print(
                f"diloco-bench regions: run {prefix} is alive (pid {owner['pid']})", file=sys.stderr
            )
            return 2
        prefixes = [prefix]
    else:
        prefixes = netns.stale_prefixes()
    removed = {p: netns.cleanup_prefix(p) for p in prefixes}
    print(json.dumps({"removed": removed}))
    return 0


def _hangup_unwinds() -> None:
    child.sigterm_unwinds()

    def unwind(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGHUP, unwind)


def probe_links(
    topo: netns.Topology, links: list[Link], scale: float, args: argparse.Namespace
) -> dict[str, Any]:
    """Probe every link alone, then all at once; rescale while one falls short; the probe part.

    A link's achieved rate, for the scaling rule, is the lower of the two: the
    run uses the links together, through relays that share this machine's CPUs.

    Args:
        topo: the built topology (its rates are changed in place when rescaled).
        links: the links at their real rates.
        scale: the starting scale.
        args: probe flags.

    Returns:
        {"scale", "scale_initial", "rounds": [...], "rescaled": [statements], "links": [...]}.
    """
    rounds: list[dict[str, Any]] = []
    statements: list[str] = []
    initial = scale
    for round_index in range(max(1, args.probe_rounds)):
        configured = {(ln.a, ln.b): regions_plan.emulated_mbit(ln, scale) for ln in links}
        alone = [topo.probe(s, args.probe_seconds, args.probe_pings) for s in topo.links]
        together = topo.probe_together(args.probe_seconds)
        lines, achieved = [], {}
        for ln, one, all_at_once in zip(links, alone, together, strict=True):
            achieved[(ln.a, ln.b)] = min(one["mbit_s"], all_at_once["mbit_s"])
            lines.append(
                regions_plan.link_report(ln, configured[(ln.a, ln.b)], one, all_at_once["mbit_s"])
            )
        decision = regions_plan.rescale(scale, configured, achieved)
        rounds.append({"round": round_index, "scale": scale, "links": lines})
        if decision.factor == 1.0:
            break
        a, b, ratio = decision.short[0]
        statements.append(
            f"round {round_index}: {REGIONS[a].name}-{REGIONS[b].name} carried {ratio:.1%} of "
            f"{configured[(a, b)]:.3g} Mbit/s; every link scaled by {decision.factor:.4f} "
            f"(scale {scale:.6g} -> {decision.scale:.6g})"
        )
        if round_index + 1 == max(1, args.probe_rounds):
            statements.append(
                f"no probe round left: the last round's rates stand at scale {scale:.6g}"
            )
            break
        scale = decision.scale
        topo.set_rates({(ln.a, ln.b): regions_plan.emulated_mbit(ln, scale) for ln in links})
    return {
        "scale": scale,
        "scale_initial": initial,
        "rounds": rounds,
        "rescaled": statements,
        "links": rounds[-1]["links"],
    }


def compare_plan(args: argparse.Namespace) -> dict[str, Any]:
    """The comparison's budget and link scale from the flags (`--quick` picks small defaults).

    Args:
        args: the parsed flags.

    Returns:
        {"budget": Budget, "scale", "token_factor", "cap_s", "statement", "inputs"}.
    """
    quick = args.quick
    steps = args.steps or (6 if quick else 30)
    inner = args.inner_steps or (3 if quick else 10)
    batch = 8 if quick else 16
    budget = Budget(islands=args.regions, inner_steps=inner, steps_per_island=steps,
                    batch_size=batch, eval_batches=1 if quick else 2, shards=1)  # fmt: skip
    # quick: a harness check, not the claim: 10x the compute per step of the big model
    big_step_s = args.big_step_s * (10.0 if quick else 1.0)
    scale = regions_claims.link_scale(RUN_PARAMS, args.run_step_s, args.regions, args.big_params,
                                      big_step_s)  # fmt: skip
    ratio_slowest = regions_claims.comm_compute_ratio(
        regions_claims.ring_bytes_per_param(args.regions) * args.big_params,
        regions_claims.REFERENCE_GBIT * 1000.0,
        big_step_s,
    )
    return {
        "budget": budget,
        "scale": scale,
        "token_factor": args.token_factor or (1.0 if quick else 2.0),
        "cap_s": args.method_cap_s or (60.0 if quick else 900.0),
        "quick": quick,
        "inputs": {
            "big_params": args.big_params,
            "big_step_s": big_step_s,
            "run_params": RUN_PARAMS,
            "run_step_s": args.run_step_s,
            "reference_bytes_per_param": regions_claims.ring_bytes_per_param(args.regions),
            "run_bytes_per_param": regions_claims.RUN_BYTES_PER_PARAM,
            "target_ratio_at_2gbit": round(ratio_slowest, 2),
            "target_ratio_at_5gbit": round(ratio_slowest * regions_claims.REFERENCE_GBIT / 5.0, 2),
        },
        "formula": "scale = (run_bytes_per_param x run_params / run_step_s) / "
        "(reference_bytes_per_param x big_params / big_step_s); reference: bf16 ring all-reduce, "
        "2(N-1)/N x 2 bytes per parameter; run: fp32 gradient to one reducer and the mean back",
    }


def run(args: argparse.Namespace) -> int:
    """Entry point of `diloco-bench regions`."""
    why = netns.can_build()
    if why:
        print(f"diloco-bench regions: {why}", file=sys.stderr)
        return 2
    if args.cleanup:
        return _cleanup(args.prefix)
    if not 2 <= args.regions <= len(REGIONS):
        print(f"diloco-bench regions: --regions must be 2..{len(REGIONS)}", file=sys.stderr)
        return 2
    try:
        shard_regions = regions_plan.parse_regions_list(args.shard_regions, args.regions)
    except ValueError as exc:
        print(f"diloco-bench regions: --shard-regions: {exc}", file=sys.stderr)
        return 2
    if args.scale <= 0:
        print("diloco-bench regions: --scale must be > 0", file=sys.stderr)
        return 2
    if args.fault_scale <= 0:
        print("diloco-bench regions: --fault-scale must be > 0", file=sys.stderr)
        return 2
    if args.faults and (args.probe_only or args.methods):
        print("diloco-bench regions: --faults runs the islands: not with --probe-only or "
              "--methods", file=sys.stderr)  # fmt: skip
        return 2
    if args.prefix is not None and not (
        args.prefix.startswith(netns.PREFIX_START)
        and len(args.prefix) <= 7
        and args.prefix[len(netns.PREFIX_START) :].isalnum()
    ):
        print(
            f"diloco-bench regions: --prefix must be {netns.PREFIX_START} + 1-4 letters or digits",
            file=sys.stderr,
        )
        return 2
    try:
        methods = regions_compare.parse_methods(args.methods)
    except ValueError as exc:
        print(f"diloco-bench regions: --methods: {exc}", file=sys.stderr)
        return 2
    plan = None
    if methods:
        plan = compare_plan(args)
        args.scale = plan["scale"]
        if args.quick:
            args.probe_seconds, args.probe_pings = min(args.probe_seconds, 1.0), 3
    _hangup_unwinds()
    leftovers = {p: netns.cleanup_prefix(p) for p in netns.stale_prefixes()}
    links = [ln for ln in LINKS if ln.a < args.regions and ln.b < args.regions]
    shapes = [
        netns.LinkShape(
            ln.a, ln.b, regions_plan.emulated_mbit(ln, args.scale), ln.rtt_ms, ln.jitter_ms, ln.loss
        )
        for ln in links
    ]
    started = datetime.datetime.now(datetime.UTC)
    try:
        ports = [] if args.probe_only else regions_run.shard_ports(len(shard_regions))
        ports += [regions_compare.DDP_PORT] if methods and not args.probe_only else []
        with netns.Topology(args.regions, shapes, ports, args.prefix, LOSS_PENALTY_MS) as topo:
            report: dict[str, Any] = {
                "command": "regions",
                "date": started.isoformat(timespec="seconds"),
                "prefix": topo.prefix,
                "regions": [
                    {"name": r.name, "island_speed": r.island_speed, "shards": i in shard_regions}
                    for i, r in enumerate(REGIONS[: args.regions])
                ],
                "leftovers_removed": leftovers,
                "emulation": {
                    "rate": "kernel htb class per link and direction (WAN namespace)",
                    "delay_jitter": "bench.children.wan_relay: RTT/2 +- jitter per direction, order kept",
                    "loss": f"a chunk holding a lost packet stalls its stream {LOSS_PENALTY_MS:g} ms "
                    "(minimum RTO); congestion-window cuts are not emulated",
                    "not_scaled": "RTT, jitter and loss; only rates are multiplied by scale",
                    "achieved": "TCP payload at the receiver; htb counts whole frames, so a "
                    "1448-byte segment in a 1514-byte frame carries at most 95.6% of the rate",
                },
                **probe_links(topo, links, args.scale, args),
            }
            if not args.probe_only and plan is not None:
                report["compare"] = regions_compare.compare(
                    topo, methods, plan, report["scale"], shard_regions, args.target_loss
                )
            elif args.faults:
                report["run"] = regions_fault_run.run_faulted(
                    topo, links, report["scale"], shard_regions, args.params, args.compute_s,
                    args.fault_scale, args.run_timeout,
                )  # fmt: skip
            elif not args.probe_only:
                report["run"] = regions_run.run_islands(
                    topo, links, report["scale"], shard_regions, args.params, args.rounds,
                    args.compute_s, args.run_timeout,
                )  # fmt: skip
            if not args.probe_only:  # what the relays carried
                topo.stop_relays()
                report["relay_bytes"] = {
                    REGIONS[r].name: stats for r, stats in topo.relay_stats().items()
                }
    except netns.NetnsError as exc:
        print(f"diloco-bench regions: {exc}", file=sys.stderr)
        return 2
    report["held"] = all(ln["rate_held"] and ln["rtt_held"] for ln in report["links"])
    claimed = outdir.claim(args.out, "regions") if args.out is not None else None
    if claimed is not None and "run" in report:
        report["plots"] = plots.write_regions_plots(report["run"], claimed)
    text = json.dumps(report, indent=1)
    print(text)
    if claimed is not None:
        (claimed / "regions.json").write_text(text + "\n")
        if "compare" in report:
            (claimed / "regions.md").write_text(regions_claims.render_markdown(report["compare"]))
    return 0 if report["held"] else 1
