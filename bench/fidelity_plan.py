"""What `diloco-bench fidelity` runs: the parity group, the quorum table, quick and full.

This module owns the scenario catalogue of the fidelity harness (names pinned
by the issue: `ddp`, `sync`, `k_all`, `k1`, `k1_grace`, plus variants) and the
budgets. Every scenario of a group shares the model, data, seeds, token budget
and eval set; only the method, the merge settings, H and the island speeds
change. Runs are on loopback: the harness measures training quality and
waiting, not the link (bytes are still counted at the islands' sockets).

Group A (parity): homogeneous islands; DDP vs synchronous DiLoCo at H = 10,
30, 100 vs this system (quorum 1 + eq3 grace). Group B (the Decoupled DiLoCo
table): 4 islands, two at speed 1 and two at 1/1.18 with 10% jitter (the
v6e/v5p mix), and a harsher mix with one island 2x slower; K = all, K = 1 and
K = 1 + grace, each with the mean and the RDA merge.
"""

from __future__ import annotations

import dataclasses

from bench.scenarios import Budget, Scenario

V5P = 1 / 1.18  # v5p relative to v6e in the Decoupled DiLoCo table
MIX = ((1.0, 0.0), (1.0, 0.0), (V5P, 0.1), (V5P, 0.1))  # two fast, two slow with jitter
HARSH = ((1.0, 0.0), (1.0, 0.0), (1.0, 0.0), (0.5, 0.0))  # one island 2x slower


@dataclasses.dataclass(frozen=True)
class Group:
    """Scenarios that share one budget (and are compared with each other)."""

    name: str
    title: str
    budget: Budget
    scenarios: tuple[Scenario, ...]


def _table(prefix: str, speeds: tuple, islands: int, rda: bool, group: str = "B") -> list[Scenario]:
    """K = all, K = 1 and K = 1 + grace (eq3) on one speed mix, mean and optionally RDA."""
    out = []
    for merge in ("mean", "rda") if rda else ("mean",):
        suffix = "" if merge == "mean" else "_rda"
        common = {"group": group, "island_speeds": speeds, "merge": merge}
        out += [
            # K = all: every live island pending steps at once, so no grace window applies
            Scenario(
                f"{prefix}k_all{suffix}", "quorum", quorum=islands, grace_rule="fraction", **common
            ),  # fmt: skip
            Scenario(f"{prefix}k1{suffix}", "quorum", quorum=1, grace_rule="fraction", **common),
            Scenario(f"{prefix}k1_grace{suffix}", "quorum", quorum=1, grace_rule="eq3", **common),
        ]
    return out


def _parity(budget: Budget, hs: tuple[int, ...]) -> Group:
    scenarios = [Scenario("ddp_a", "ddp", "A", wan=False)]
    scenarios += [Scenario(f"sync_h{h}", "sync", "A", wan=False, inner_steps=h) for h in hs]
    scenarios.append(
        Scenario("k1_grace_h30", "quorum", "A", wan=False, quorum=1, grace_rule="eq3",
                 inner_steps=30)
    )  # fmt: skip
    return Group("A", "parity: DDP vs synchronous DiLoCo vs this system", budget, tuple(scenarios))


def _loopback(scenarios: list[Scenario]) -> tuple[Scenario, ...]:
    return tuple(dataclasses.replace(s, wan=False) for s in scenarios)


def quick() -> list[Group]:
    """The quick harness: tiny model, group B's core on the v6e/v5p mix (< 10 min on 2 cores)."""
    budget = Budget(islands=4, inner_steps=10, steps_per_island=120, batch_size=8,
                    eval_batches=2, wall_cap_s=150.0)  # fmt: skip
    core = [
        Scenario("ddp", "ddp", "B"),
        Scenario("sync", "sync", "B", island_speeds=MIX),
        *_table("", MIX, 4, rda=False),
    ]
    return [Group("B", "the quorum table (v6e/v5p mix)", budget, _loopback(core))]


def smoke() -> list[Group]:
    """The CI smoke test of the harness: 2 islands, a few rounds, three scenarios."""
    budget = Budget(islands=2, inner_steps=5, steps_per_island=15, batch_size=4, seq_len=64,
                    eval_batches=1, wall_cap_s=60.0)  # fmt: skip
    speeds = ((1.0, 0.0), (0.8, 0.0))
    scenarios = [
        Scenario("ddp", "ddp", "B"),
        Scenario("k1", "quorum", "B", quorum=1, island_speeds=speeds),
        Scenario("k1_grace", "quorum", "B", quorum=1, grace_rule="eq3", island_speeds=speeds),
    ]
    return [Group("B", "smoke", budget, _loopback(scenarios))]


def full() -> list[Group]:
    """The full harness: group A and group B with their variants (run with 2 seeds)."""
    parity = Budget(islands=2, inner_steps=30, steps_per_island=2000, batch_size=8,
                    eval_batches=4, wall_cap_s=600.0)  # fmt: skip
    table = Budget(islands=4, inner_steps=15, steps_per_island=300, batch_size=8,
                   eval_batches=4, wall_cap_s=600.0)  # fmt: skip
    mix = [
        Scenario("ddp", "ddp", "B"),
        Scenario("sync", "sync", "B", island_speeds=MIX),
        *[s for s in _table("", MIX, 4, rda=True) if s.name not in ("k1_rda", "k_all_rda")],
        Scenario("k1_grace_overwrite", "quorum", "B", quorum=1, grace_rule="eq3",
                 merge_rule="overwrite", island_speeds=MIX),
        Scenario("k1_grace_fp32", "quorum", "B", quorum=1, grace_rule="eq3", codec="float32",
                 island_speeds=MIX),
        # the exchange inside `step` (no push thread): the overlap's price in quality, if any
        Scenario("k1_grace_no_overlap", "quorum", "B", quorum=1, grace_rule="eq3",
                 overlap_rounds=0, island_speeds=MIX),
    ]  # fmt: skip
    harsh = [
        *[s for s in _table("harsh_", HARSH, 4, rda=False, group="B2") if s.name != "harsh_k1"],
        Scenario("harsh_k1_grace_uniform", "quorum", "B2", quorum=1, grace_rule="eq3",
                 weighting="uniform", island_speeds=HARSH),
    ]  # fmt: skip
    return [
        _parity(parity, (10, 30, 100)),
        Group("B", "the quorum table (v6e/v5p mix)", table, _loopback(mix)),
        Group("B2", "the quorum table (one island 2x slower)", table, _loopback(harsh)),
    ]
