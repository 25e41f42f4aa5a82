"""The fidelity harness's numbers: per-scenario summaries over seeds, and the claims table.

This module owns the arithmetic of `diloco-bench fidelity` (pure functions of
the run records `bench.runs.run_scenario` wrote): a scenario's final eval loss
is the mean over seeds of the loss the shards' global model reaches after every
acked delta was merged (DDP: rank 0's final parameters), its spread is max - min
over seeds, `goodput` is the share of an island's wall time spent on inner
steps whose work entered the model (`worker.goodput`: the shards' credited
tokens, staleness not counted, over the island's wall time x its own step rate),
averaged over islands and seeds, and `utilization` is the share of wall time an
island was not waiting for a sync merge (one of the losses goodput counts). The
price of staleness is `bench.fidelity_staleness`'s. A claim whose scenarios did
not run has `measured` None and `met` None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bench import analysis, fidelity_staleness, render

Record = Mapping[str, Any]


def summarize(scenario: Any, budget: Any, records: Sequence[Record], seeds: Sequence[int]) -> dict:
    """One scenario's entry of fidelity.json from its per-seed run records.

    Args:
        scenario: the bench.scenarios.Scenario.
        budget: the group's budget (islands, H).
        records: one run record per seed (bench.runs.summarize output).
        seeds: the seeds, in the order of `records`.

    Returns:
        JSON-ready dict with the pinned keys (name, mode, quorum, grace, merge,
        merge_rule, speeds, seeds, final_eval_loss, final_eval_loss_spread,
        goodput, uptime, bytes_per_island) and more (staleness_histogram: merged
        deltas by staleness, summed over seeds).
    """
    losses = [r["eval_final"] for r in records if r.get("eval_final") is not None]
    islands = [i for r in records for i in r["islands"].values()]
    goodputs = [i["goodput"] for i in islands if i.get("goodput") is not None]
    utilization = [
        1.0 - min(1.0, i.get("wait_s", 0.0) / r["duration_s"])
        for r in records
        for i in r["islands"].values()
        if r.get("duration_s")
    ]
    diloco = scenario.method != "ddp"
    return {
        "name": scenario.name,
        "group": scenario.group,
        "mode": scenario.method,
        "quorum": scenario.quorum_of(budget.islands) if scenario.method == "quorum" else None,
        "grace": scenario.grace_rule if scenario.method == "quorum" else None,
        "merge": scenario.merge if diloco else None,
        "merge_rule": scenario.merge_rule if diloco else None,
        "weighting": scenario.weighting if diloco else None,
        "overlap_rounds": scenario.overlap_rounds if diloco else None,
        "codec": scenario.codec if diloco else "float32 gradients",
        "inner_steps": scenario.inner_steps or budget.inner_steps,
        "islands": budget.islands,
        "speeds": [list(s) for s in scenario.speeds(budget.islands)],
        "seeds": list(seeds),
        "final_eval_loss": analysis.mean(losses),
        "final_eval_loss_spread": (max(losses) - min(losses)) if losses else None,
        "final_eval_losses": losses,
        "goodput": analysis.mean(goodputs) if diloco else None,
        "goodput_min": min(goodputs) if diloco and goodputs else None,
        "utilization": analysis.mean(utilization) if diloco else None,
        "uptime": analysis.mean([r["uptime"] for r in records if r.get("uptime") is not None]),
        "bytes_per_island": analysis.mean([i["bytes_sent"] + i["bytes_received"] for i in islands]),
        "tokens_total": analysis.mean([r["tokens_total"] for r in records]),
        "duration_s": analysis.mean([r["duration_s"] for r in records]),
        "eval_curves": [r["eval_curve"] for r in records],
        "staleness_histogram": fidelity_staleness.histogram(records) if diloco else {},
    }


def _loss(entries: Mapping[str, dict], name: str) -> float | None:
    return (entries.get(name) or {}).get("final_eval_loss")


def _pair(entries: Mapping[str, dict], ours: str, ref: str, within: float, claim: str) -> dict:
    rel = render.rel(_loss(entries, ours), _loss(entries, ref))
    measured = (
        None
        if rel is None
        else f"{ours} {_loss(entries, ours):.4f} vs {ref} "
        + (f"{_loss(entries, ref):.4f} ({rel:+.2%})")
    )
    return render.claim(claim, f"loss <= {ref} x (1 + {within:.1%})", measured,
                  None if rel is None else rel <= within)  # fmt: skip


def _gain_and_spread(
    entries: Mapping[str, dict], ref: str, ours: str
) -> tuple[float | None, float, str | None]:
    """loss(ref) - loss(ours), the larger seed spread of the two, and the measured text.

    The gain is None when either did not run or has fewer than 2 seeds (no spread).
    """
    a, b = entries.get(ref), entries.get(ours)
    if not (a and b and a.get("final_eval_loss") and b.get("final_eval_loss")):
        return None, 0.0, None
    if min(len(a["seeds"]), len(b["seeds"])) < 2:
        return None, 0.0, "needs >= 2 seeds for a spread"
    gain = a["final_eval_loss"] - b["final_eval_loss"]
    spread = max(a["final_eval_loss_spread"] or 0.0, b["final_eval_loss_spread"] or 0.0)
    return gain, spread, f"{ref} - {ours} = {gain:+.4f}, seed spread {spread:.4f}"


def evaluate(entries: Mapping[str, dict]) -> list[dict]:
    """The claims table.

    Args:
        entries: scenario name -> `summarize` output.

    Returns:
        Claims with claim, target, measured, met (and a note).
    """
    claims = []
    ddp, syncs = (
        _loss(entries, "ddp_a"),
        {n: _loss(entries, n) for n in entries if n.startswith("sync_h")},
    )
    rels = {n: render.rel(v, ddp) for n, v in syncs.items() if v is not None}
    best = min(rels, key=rels.get) if rels and ddp is not None else None  # type: ignore[arg-type]
    claims.append(render.claim(
        "synchronous DiLoCo within 2% of DDP's eval loss at equal tokens (group A)",
        "best H: loss <= DDP x 1.02",
        None if best is None else f"DDP {ddp:.4f}; " + ", ".join(
            f"{n} {syncs[n]:.4f} ({r:+.2%})" for n, r in sorted(rels.items())),
        None if best is None else rels[best] <= 0.02,
    ))  # fmt: skip
    claims.append(render.claim(
        "synchronous DiLoCo at most DDP's eval loss at 2 islands (group A)",
        "best H: loss <= DDP",
        None if best is None else f"best {best} {rels[best]:+.2%}",
        None if best is None else rels[best] <= 0.0,
    ))  # fmt: skip
    claims.append(
        _pair(
            entries, "sync", "ddp", 0.0, "synchronous DiLoCo at most DDP's eval loss at 4 islands"
        )
    )
    claims.append(_pair(entries, "k1_grace", "k_all", 0.01, "K=1 + grace within 1% of K=all"))
    k1g, kall = entries.get("k1_grace"), entries.get("k_all")
    measured, met = None, None
    if k1g and k1g.get("goodput") is not None:
        measured = f"k1_grace goodput {k1g['goodput']:.1%} (lowest island {k1g['goodput_min']:.1%})"
        met = k1g["goodput"] >= 0.99
    claims.append(render.claim("K=1 + grace at goodput >= 99% (islands that never wait)",
                         "k1_grace goodput >= 99%", measured, met,
                         "goodput = share of wall time on inner steps whose work was "
                         "merged (staleness not counted)"))  # fmt: skip
    # K=all waits for every island: as lost island time where islands block for it, as
    # lost model time (uptime: the share of the run in which the model advanced) where
    # they train on (this system's quorum mode)
    measured, met = None, None
    if k1g and kall and k1g.get("goodput") is not None and kall.get("goodput") is not None:
        measured = f"goodput k_all {kall['goodput']:.1%} vs k1_grace {k1g['goodput']:.1%}"
        met = kall["goodput"] < k1g["goodput"]
        if kall.get("uptime") is not None and k1g.get("uptime") is not None:
            measured += f"; uptime {kall['uptime']:.1%} vs {k1g['uptime']:.1%}"
            met = met or kall["uptime"] < k1g["uptime"]
    claims.append(render.claim("K=all's wait for every island shows (goodput or uptime)",
                         "k_all goodput or uptime < k1_grace's", measured, met,
                         "uptime = share of the run in which some version advanced"))  # fmt: skip
    gain, spread, measured = _gain_and_spread(entries, "k1", "k1_grace")
    claims.append(render.claim("K=1 + grace better than K=1 by more than the seed spread",
                         "loss(k1) - loss(k1_grace) > spread", measured,
                         None if gain is None else gain > spread))  # fmt: skip
    # the exchange beside training (the default) against the exchange inside `step`
    gain, spread, measured = _gain_and_spread(entries, "k1_grace_no_overlap", "k1_grace")
    claims.append(render.claim(
        "the exchange beside training costs no quality (within the seed spread)",
        "loss(k1_grace) - loss(k1_grace_no_overlap) <= spread", measured,
        None if gain is None else -gain <= spread,
    ))  # fmt: skip
    claims.append(
        _pair(
            entries,
            "harsh_k1_grace",
            "harsh_k1_grace_uniform",
            0.0,
            "weighted merge at least as good as uniform with the 2x island",
        )
    )
    claims.append(
        _pair(
            entries,
            "k1_grace_rda",
            "k1_grace",
            0.0,
            "RDA at least as good as mean at 4 islands",
        )
    )
    claims.append(
        _pair(entries, "k1_grace", "k1_grace_fp32", 0.005, "int8 deltas within 0.5% of fp32 deltas")
    )
    claims.append(
        _pair(
            entries,
            "k1_grace",
            "k1_grace_overwrite",
            0.0,
            "keep-progress fold at least as good as overwrite (alpha = 0)",
        )
    )
    return claims
