"""The runs `diloco-bench report` makes: one budget and a list of scenarios, quick or full.

This module owns what is compared (methods, codecs, island speeds) and the
shared budget (model, data, seeds, tokens, link); `bench.runs` executes a
scenario and `bench.report` strings them together.
"""

from __future__ import annotations

import dataclasses

from bench.wan import LinkSpec

METHODS = ("ddp", "sync", "quorum")
COMM_CODECS = ("int8", "int4", "topk")  # the H=100 runs of the full report


@dataclasses.dataclass(frozen=True)
class Budget:
    """What every run of one report shares."""

    islands: int = 2  # islands (DiLoCo) or ranks (DDP)
    model: str = "tiny"  # worker.model config
    inner_steps: int = 20  # H: inner steps per round (DDP: steps per metrics row)
    steps_per_island: int = 200  # token budget = islands * steps_per_island * batch * seq_len
    batch_size: int = 16  # sequences per step and island
    seq_len: int = 128  # bytes per sequence
    eval_batches: int = 4  # held-out batches per evaluation (the same set everywhere)
    shards: int = 2  # parameter-server shards
    seed: int = 0  # model init seed (data seeds derive from island names)
    link: LinkSpec = LinkSpec()  # the emulated WAN link of every island
    wall_cap_s: float = 600.0  # any run stops after this many seconds of training

    @property
    def tokens(self) -> int:
        """The cluster's token budget."""
        return self.islands * self.steps_per_island * self.batch_size * self.seq_len


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One run."""

    name: str
    method: str  # ddp | sync | quorum
    group: str  # report table: methods | codecs | slow | mix
    codec: str = "int8"  # delta codec (DiLoCo)
    weighting: str = "default"  # server merge weighting (DiLoCo)
    slow_speed: float = 1.0  # speed of the last island
    slow_jitter: float = 0.0  # step-time jitter of the last island
    wan: bool = True  # on the emulated WAN link (False: loopback)
    wall_cap_s: float = 0.0  # stop after this many seconds of training (0: budget's cap)
    quorum: int = 0  # quorum mode: distinct islands per step (0: all islands but one)
    grace_rule: str = "eq3"  # quorum grace window: eq3 | fraction (paramserver.server.policy)
    merge: str = "mean"  # combining island deltas on the server: mean | rda
    merge_rule: str = "keep-progress"  # islands folding a new version: keep-progress | overwrite
    topk_density: float = 0.0  # codec topk: share of entries sent (0: the worker's default)
    island_speeds: tuple[tuple[float, float], ...] = ()  # (speed, jitter) each; () = slow_*
    inner_steps: int = 0  # H of this run (0: the budget's)
    steps_per_island: int = 0  # inner steps each island trains in this run (0: the budget's)
    overlap_rounds: int | None = None  # islands' --overlap-rounds (None: the worker's default)

    def budget_of(self, budget: Budget) -> Budget:
        """The budget of this run: the shared one with this run's H and steps, if it sets them."""
        return dataclasses.replace(
            budget,
            inner_steps=self.inner_steps or budget.inner_steps,
            steps_per_island=self.steps_per_island or budget.steps_per_island,
        )

    @property
    def downlink(self) -> str:
        """Published updates: int8 for quantized or sparse deltas, float32 for raw ones."""
        return "int8" if self.codec in ("int8", "int4", "topk") else "float32"

    def speeds(self, islands: int) -> list[tuple[float, float]]:
        """(speed, jitter) per island: `island_speeds`, else all full speed but the last."""
        if self.island_speeds:
            if len(self.island_speeds) != islands:
                raise ValueError(
                    f"{self.name}: {len(self.island_speeds)} speeds, {islands} islands"
                )
            return list(self.island_speeds)
        return [(1.0, 0.0)] * (islands - 1) + [(self.slow_speed, self.slow_jitter)]

    def quorum_of(self, islands: int) -> int:
        """Distinct islands per outer step in quorum mode."""
        return self.quorum or max(1, islands - 1)


def quick() -> tuple[Budget, list[Scenario]]:
    """The CI smoke report: 2 islands, few rounds, the core comparison only."""
    budget = Budget(
        islands=2,
        inner_steps=5,  # 4 rounds (uptime needs whole rounds after the first merge)
        steps_per_island=20,
        link=LinkSpec(rate_mbit=5.0, delay_ms=25.0),
        wall_cap_s=120.0,
    )
    return budget, [
        Scenario("ddp", "ddp", "methods", wan=False),
        Scenario("ddp-wan", "ddp", "methods", wall_cap_s=10.0),
        Scenario("sync", "sync", "methods"),
        Scenario("quorum", "quorum", "methods"),
    ]


def full(islands: int = 3) -> tuple[Budget, list[Scenario]]:
    """The full report: every method, codec and heterogeneity scenario (~30 min on 2 cores)."""
    budget = Budget(
        islands=islands,
        inner_steps=30,
        steps_per_island=150,
        link=LinkSpec(rate_mbit=2.0, delay_ms=25.0),
        wall_cap_s=420.0,
    )
    return budget, [
        Scenario("ddp", "ddp", "methods", wan=False),
        Scenario("ddp-wan", "ddp", "methods", wall_cap_s=45.0),
        Scenario("sync", "sync", "methods"),
        Scenario("quorum", "quorum", "methods"),
        Scenario("quorum-fp32", "quorum", "codecs", codec="float32"),
        Scenario("quorum-bf16", "quorum", "codecs", codec="bfloat16"),
        Scenario("quorum-int4", "quorum", "codecs", codec="int4"),
        Scenario("sync-slow", "sync", "slow", slow_speed=0.5),
        Scenario("quorum-slow", "quorum", "slow", slow_speed=0.5),
        Scenario("quorum-slow-uniform", "quorum", "slow", weighting="uniform", slow_speed=0.5),
        Scenario("quorum-mix", "quorum", "mix", slow_speed=0.833, slow_jitter=0.1),
        # communication at H=100 (Streaming DiLoCo / SparseLoCo territory), equal tokens each
        *(
            Scenario(f"h100-{c}", "quorum", "comm", codec=c, inner_steps=100, steps_per_island=600)
            for c in COMM_CODECS
        ),
        # what the topk loss miss depends on: a denser top-k, and islands that restart each
        # round from the global model (the unsent rest stays in error feedback only)
        Scenario("h100-topk-d10", "quorum", "comm", codec="topk", inner_steps=100,
                 steps_per_island=600, topk_density=0.1),
        Scenario("h100-topk-overwrite", "quorum", "comm", codec="topk", inner_steps=100,
                 steps_per_island=600, merge_rule="overwrite"),
        # the same tokens in 60 rounds of H=10: error feedback needs ~1/density rounds
        Scenario("h10-int8", "quorum", "comm", codec="int8", inner_steps=10, steps_per_island=600),
        Scenario("h10-topk", "quorum", "comm", codec="topk", inner_steps=10, steps_per_island=600),
        # SparseLoCo at H=30, 20 synchronous rounds: topk (per-entry merge, outer SGD) vs int8
        Scenario("h30-int8", "sync", "comm", codec="int8", inner_steps=30, steps_per_island=600),
        Scenario("h30-topk", "sync", "comm", codec="topk", inner_steps=30, steps_per_island=600),
    ]  # fmt: skip
