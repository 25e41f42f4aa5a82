"""The price of staleness in `diloco-bench fidelity`, measured as quality (pure).

Goodput does not count staleness (`worker.goodput`): a stale delta's work entered
the model, only with a smaller step. What staleness costs shows in the loss, so
each asynchronous scenario is compared with its group's synchronous DiLoCo and
DDP runs at equal tokens and at equal wall time (per seed, then the mean), next
to the staleness histogram its shards kept (merged deltas by versions behind).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bench import analysis

Curve = Sequence[Sequence[float]]  # (seconds, tokens, loss) points


def histogram(records: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The merged deltas by staleness, summed over a scenario's seeds.

    Args:
        records: run records (`bench.run_record.summarize`), each with
            server.staleness_histogram when the shards answered.

    Returns:
        str staleness -> count, in staleness order ({} for DDP).
    """
    total = analysis.sum_counts(
        [(r.get("server") or {}).get("staleness_histogram", {}) for r in records]
    )
    return dict(sorted(total.items(), key=lambda kv: int(kv[0])))


def mean_staleness(hist: Mapping[str, int]) -> float | None:
    """The mean staleness of the merged deltas, or None without any."""
    n = sum(hist.values())
    return sum(int(s) * c for s, c in hist.items()) / n if n else None


def at_equal(ours: Curve, ref: Curve) -> dict[str, float | None]:
    """Both curves' losses at the tokens and at the wall time both reached.

    Args:
        ours: one seed's eval curve of the scenario.
        ref: the same seed's curve of the reference.

    Returns:
        tokens, seconds (the smaller end of the two curves) and the four losses
        ours_at_tokens, ref_at_tokens, ours_at_time, ref_at_time (None each when
        a curve is empty).
    """
    if not ours or not ref:
        return dict.fromkeys(
            ("tokens", "seconds", "ours_at_tokens", "ref_at_tokens", "ours_at_time", "ref_at_time")
        )
    tokens = min(max(p[1] for p in ours), max(p[1] for p in ref))
    seconds = min(max(p[0] for p in ours), max(p[0] for p in ref))
    return {
        "tokens": tokens,
        "seconds": seconds,
        "ours_at_tokens": analysis.loss_at(ours, tokens, axis=1),
        "ref_at_tokens": analysis.loss_at(ref, tokens, axis=1),
        "ours_at_time": analysis.loss_at(ours, seconds, axis=0),
        "ref_at_time": analysis.loss_at(ref, seconds, axis=0),
    }


def _reference(entries: Mapping[str, dict], entry: dict, mode: str) -> dict | None:
    """The group's run of `mode` to compare with: same H if there is one, else the best."""
    refs = [e for e in entries.values() if e["group"] == entry["group"] and e["mode"] == mode]
    same_h = [e for e in refs if e["inner_steps"] == entry["inner_steps"]] if mode == "sync" else []
    pool = [e for e in (same_h or refs) if e.get("final_eval_loss") is not None]
    return min(pool, key=lambda e: e["final_eval_loss"]) if pool else None


def _versus(entry: dict, ref: dict) -> dict[str, Any]:
    per_seed = [
        at_equal(o, r) for o, r in zip(entry["eval_curves"], ref["eval_curves"], strict=False)
    ]
    keys = ("ours_at_tokens", "ref_at_tokens", "ours_at_time", "ref_at_time")
    out: dict[str, Any] = {"ref": ref["name"]}
    out.update({k: analysis.mean([s[k] for s in per_seed]) for k in keys})
    return out


def price(entries: Mapping[str, dict]) -> list[dict[str, Any]]:
    """The price of staleness of every non-synchronous DiLoCo scenario.

    Args:
        entries: scenario name -> `bench.fidelity_claims.summarize` output (with
            eval_curves and staleness_histogram).

    Returns:
        One dict per scenario: name, group, staleness_histogram, mean_staleness,
        and vs_sync / vs_ddp (None without that reference in the group): ref
        (its name) and the mean over seeds of ours_at_tokens, ref_at_tokens,
        ours_at_time, ref_at_time.
    """
    rows = []
    for entry in entries.values():
        if entry["mode"] in ("sync", "ddp"):
            continue
        hist = entry.get("staleness_histogram") or {}
        row: dict[str, Any] = {
            "name": entry["name"],
            "group": entry["group"],
            "staleness_histogram": hist,
            "mean_staleness": mean_staleness(hist),
        }
        for mode in ("sync", "ddp"):
            ref = _reference(entries, entry, mode)
            row[f"vs_{mode}"] = None if ref is None else _versus(entry, ref)
        rows.append(row)
    return rows
