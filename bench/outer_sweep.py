"""Outer lr x momentum by mode, H and island count, with the daemon's fold rule (picks `outer_defaults`).

JSON on stdout, progress on stderr. In process, no sockets: a real
`ShardState` (the shard's own policy, round clock, merge and outer step) is
driven on a simulated clock by K islands that train the repo's model (a micro
shape of `worker.model`, the inner AdamW of `worker.train`, the embedded
corpus, each island its own shard of it). What the islands do is what
`worker.session.Session` does:

- a push at the end of each round of H inner steps: the delta is the work
  since the anchor (``anchor - local``), and the anchor moves to the local
  values (`worker.exchange.FragmentSync.take`);
- every version a shard published before the end of an inner step is folded
  in at that step, keep-progress (``new_global + (local - anchor)``, then
  anchor = base = the new global: `worker.exchange.folded`), in every mode:
  an island adopts other islands' steps while it trains, not only at its own
  push. (`bench.step_rule` folds at the island's own push only.)
- sync mode: the island waits for its round's merge before it trains on, as
  `Session` does, so rounds run in lock step;
- quorum mode: with ``--push-skip on`` a fragment whose last push is not yet
  merged skips its push and carries the work into the next one
  (`worker.push_thread.unblocked`); the last round always pushes.

Island i needs ``step_s * (1 + i / (2K))`` seconds per inner step (a mild
speed mix), which it reports to the shard for the eq3 grace window. A step's
version is visible ``publish_latency_s`` after it (``--latency-rounds`` adds
that many of the fastest island's rounds, a slow shard). Every cell spends
the same token budget: ``--budget`` inner steps summed over the islands,
split into whole rounds (an island starts a round only while the budget has
room for it). The figure is the held-out loss (nats/byte) of the global
parameters after the last merge; lower is better.

Parts: ``grid`` (every mode x H x K x lr x momentum; `best` per mode, H, K,
flagged when it sits on the grid's edge), ``async_price`` (each K's best
async against its best sync, and quorum against sync), ``push_skip``
(quorum at its best settings with the skip on and off), and
``momentum_dtype`` (with ``--momentum-dtypes float32,bfloat16``: every cell
with the shard's momentum kept in each dtype, the held-out loss of each
against the first, per seed too).
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import heapq
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import codec
from bench import cli
from bench.async_outer import InnerSteps, replace_args
from bench.common import emit_json, progress
from paramserver.server.config import ShardConfig
from paramserver.server.state import ShardState
from paramserver.wire.plan import leaf_specs, make_plan
from worker import data, model
from worker.train import InnerConfig

T0 = 1_000_000.0
# A micro shape of the repo's model: a sweep of ~150 cells must fit in minutes of one CPU.
MICRO = model.ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=128)
MODES = ("sync", "quorum", "async")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench outer_sweep`.

    Args:
        parser: the subcommand's parser.
    """
    parser.add_argument("--modes", default="sync,quorum,async", help="merge modes to sweep")
    parser.add_argument(
        "--merge",
        default="mean",
        choices=("mean", "median"),
        help="the shards' merge rule (median: the robust rule for untrusted islands)",
    )
    parser.add_argument("--islands", default="2,4,8", help="island counts K")
    parser.add_argument(
        "--inner-steps",
        default="10,30,100",
        help="comma-separated inner steps per round (H) to sweep",
    )
    parser.add_argument("--lrs", default="0.4,0.7,1.0", help="outer lr grid (sync, quorum)")
    parser.add_argument("--momenta", default="0.8,0.9", help="outer momentum grid (sync, quorum)")
    parser.add_argument("--async-lrs", default="0.4,0.7,1.0", help="outer lr grid of async")
    parser.add_argument("--async-momenta", default="0.0", help="outer momentum grid of async")
    parser.add_argument(
        "--pairs",
        default="",
        help="lr/momentum pairs of sync and quorum, comma-separated (instead of --lrs x "
        "--momenta); 'default': the shard's own defaults (`outer_defaults` of mode, H and K)",
    )
    parser.add_argument(
        "--async-pairs",
        default="",
        help="lr/momentum pairs of async (instead of --async-lrs x --async-momenta); 'default' "
        "as in --pairs",
    )
    parser.add_argument(
        "--budget", type=int, default=2400, help="inner steps summed over the islands, per cell"
    )
    parser.add_argument(
        "--min-rounds",
        type=int,
        default=3,
        help="leave out (H, K) whose budget gives each island fewer rounds (listed as too_short)",
    )
    parser.add_argument("--seeds", type=int, default=1, help="data orders per cell")
    parser.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="the first data order (seeds first, first + 1, ...)",
    )
    parser.add_argument(
        "--push-skip",
        default="off",
        choices=("off", "on", "both"),
        help="quorum islands skip a push while their last is unmerged (both: the push_skip part)",
    )
    parser.add_argument("--step-s", type=float, default=0.1, help="seconds per inner step")
    parser.add_argument(
        "--latency-rounds",
        type=float,
        default=0.0,
        help="extra publish latency in rounds of the fastest island (a slow shard)",
    )
    parser.add_argument("--batch", type=int, default=8, help="sequences per inner step")
    parser.add_argument("--seq-len", type=int, default=32, help="bytes per sequence")
    parser.add_argument("--eval-batches", type=int, default=16, help="held-out batches")
    parser.add_argument(
        "--momentum-dtypes",
        default="float32",
        help="dtypes the shard keeps its outer momentum in (ShardConfig.momentum_dtype), "
        "comma-separated; with more than one, every cell runs with each and the "
        "momentum_dtype table compares each to the first (best and push_skip: the first)",
    )
    parser.add_argument(
        "--downlink",
        default="float32",
        choices=("float32", "int8"),
        help="the shard's published updates (int8: with its bfloat16 residual)",
    )


@dataclasses.dataclass(frozen=True)
class Cell:
    """One simulated run's settings."""

    mode: str
    islands: int
    inner_steps: int
    lr: float | None  # None: the shard's default (`outer_defaults` of mode, H, K)
    momentum: float | None
    push_skip: bool
    seed: int
    momentum_dtype: str = "float32"  # ShardConfig.momentum_dtype


class Published:
    """Each fragment's published versions: (visible from, version, values), in time order."""

    def __init__(self) -> None:
        self.times: dict[int, list[float]] = {}
        self.entries: dict[int, list[tuple[int, np.ndarray]]] = {}

    def add(self, fragment: int, visible: float, version: int, values: np.ndarray) -> None:
        """Record a step's version of a fragment, visible from `visible`."""
        self.times.setdefault(fragment, []).append(visible)
        self.entries.setdefault(fragment, []).append((version, values))

    def latest(self, fragment: int, now: float) -> tuple[int, np.ndarray] | None:
        """The newest version visible at `now`, or None."""
        at = bisect.bisect_right(self.times.get(fragment, []), now)
        return self.entries[fragment][at - 1] if at else None


class Island:
    """One island: its params, AdamW state, data, and the exchange's anchors and bases."""

    def __init__(self, index: int, k: int, seed: int, sim: Sim) -> None:
        self.name = f"i{index}"
        train, self.heldout = data.split_corpus(sim.corpus, k, index)
        self.sampler = data.BatchSampler(
            train, sim.icfg.batch_size, sim.icfg.seq_len, seed * 100 + index
        )
        self.params = jax.tree.map(jnp.asarray, codec.unflatten(sim.init))
        self.opt = sim.inner.tx.init(self.params)
        plan = sim.plan
        self.anchor = {f.index: plan.gather(sim.init, f.index).copy() for f in plan.fragments}
        self.base_version = {f.index: 0 for f in plan.fragments}
        self.last_push: dict[int, int] = {}  # fragment -> round of its last push
        self.unsent_steps = {f.index: 0 for f in plan.fragments}
        self.round = 0
        self.pushes = 0
        self.skipped = 0
        self.folds = 0

    def flat(self) -> dict[str, np.ndarray]:
        """The local parameters as flat numpy arrays."""
        return {k: np.array(v, dtype=np.float32) for k, v in codec.flatten(self.params).items()}


class Sim:
    """One cell: a ShardState and K islands on a simulated clock."""

    def __init__(self, args, cell: Cell, corpus: bytes, inner: InnerSteps, init: dict) -> None:
        self.args, self.cell, self.corpus, self.inner, self.init = args, cell, corpus, inner, init
        self.icfg = InnerConfig(batch_size=args.batch, seq_len=args.seq_len)
        kw: dict = {"quorum": 1} if cell.mode == "quorum" else {}
        self.cfg = ShardConfig(
            mode=cell.mode,
            outer_lr=cell.lr,
            outer_momentum=cell.momentum,
            inner_steps=cell.inner_steps,  # the row of the defaults
            fsync=False,
            dedup_window=1 << 20,
            downlink=args.downlink,
            momentum_dtype=cell.momentum_dtype,
            merge=args.merge,
            **kw,
        )
        self.plan = make_plan(leaf_specs(init), self.cfg.shards, self.cfg.num_fragments)
        self.state = ShardState(self.cfg, 0)
        tree = {str(f.index): self.plan.gather(init, f.index) for f in self.plan.fragments}
        self.state.initialize(self.plan.to_wire(), codec.raw("float32").encode(tree)[0])
        k = cell.islands
        self.step_s = [args.step_s * (1 + i / (2 * k)) for i in range(k)]
        self.latency = 1e-6 + args.latency_rounds * cell.inner_steps * args.step_s
        self.islands = [Island(i, k, cell.seed, self) for i in range(k)]
        for isl in self.islands:
            self.state.hello(isl.name, T0)
        self.published = Published()
        self.merged: dict[tuple[str, int], float] = {}  # (island, round) -> visible from
        self.tokens_per_step = args.batch * args.seq_len
        self.outer_steps = 0

    # -- the shard -------------------------------------------------------------------------

    def step_due(self, now: float) -> float | None:
        """Every outer step the policy asks for at `now`; returns the next wake time."""
        for _ in range(10_000):
            due, wake = self.state.due_fragments(T0 + now)
            if not due:
                return None if wake is None else wake - T0
            for f in due:
                event, _ = self.state.step(f, T0 + now)
                version, values = self.state.snapshot(f)
                self.published.add(f, now + self.latency, version, values.copy())
                for island, rnd in event.keys:
                    self.merged[(island, int(rnd))] = now + self.latency
                self.outer_steps += 1
        raise RuntimeError("the shard kept stepping")

    def touch_all(self, now: float) -> None:
        """Every island is live (heartbeats)."""
        for isl in self.islands:
            self.state.touch(isl.name, T0 + now)

    # -- an island -------------------------------------------------------------------------

    def train_step(self, isl: Island) -> None:
        isl.params, isl.opt = self.inner.step(isl.params, isl.opt, isl.sampler.next())
        for f in isl.unsent_steps:
            isl.unsent_steps[f] += 1

    def push(self, i: int, now: float, last: bool) -> None:
        """Island i's round-end push (fragments whose last push is unmerged skip, if asked)."""
        isl = self.islands[i]
        isl.round += 1
        local = isl.flat()
        raw32 = codec.raw("float32")
        for frag in self.plan.fragments:
            f = frag.index
            previous = isl.last_push.get(f)
            unmerged = previous is not None and self.merged.get((isl.name, previous), np.inf) > now
            if self.cell.push_skip and self.cell.mode == "quorum" and unmerged and not last:
                isl.skipped += 1
                continue
            here = self.plan.gather(local, f)
            delta = isl.anchor[f] - here
            isl.anchor[f] = here.copy()
            steps = isl.unsent_steps[f]
            header = {
                "island": isl.name,
                "round": isl.round,
                "fragment": f,
                "base_version": isl.base_version[f],
                "tokens": steps * self.tokens_per_step,
                "steps": steps,
                "plan_hash": self.plan.hash,
            }
            out = self.state.submit_delta(header, raw32.encode({"delta": delta})[0], T0 + now)
            if out.status != "accepted":
                raise RuntimeError(f"push refused: {out}")
            isl.last_push[f], isl.unsent_steps[f] = isl.round, 0
            isl.pushes += 1
        header = {"kind": "push", "t_step": self.step_s[i], "steps": self.cell.inner_steps}
        self.state.touch(isl.name, T0 + now, header)

    def fold(self, isl: Island, now: float) -> None:
        """Fold every version visible at `now` that the island has not (keep-progress)."""
        local = None
        for frag in self.plan.fragments:
            f = frag.index
            seen = self.published.latest(f, now)
            if seen is None or seen[0] <= isl.base_version[f]:
                continue
            if local is None:
                local = isl.flat()
            here = self.plan.gather(local, f)
            self.plan.scatter(f, seen[1] + (here - isl.anchor[f]), local)
            isl.anchor[f] = seen[1].copy()
            isl.base_version[f] = seen[0]
            isl.folds += 1
        if local is not None:
            isl.params = jax.tree.map(jnp.asarray, codec.unflatten(local))

    # -- runs ------------------------------------------------------------------------------

    def run(self) -> dict:
        """The whole budget; returns the cell's figures."""
        h, budget = self.cell.inner_steps, self.args.budget
        if self.cell.mode == "sync":
            self._run_sync(h, budget)
        else:
            self._run_overlapped(h, budget)
        glob = {k: v.copy() for k, v in self.init.items()}
        for frag in self.plan.fragments:
            self.plan.scatter(frag.index, self.state.snapshot(frag.index)[1], glob)
        params = jax.tree.map(jnp.asarray, codec.unflatten(glob))
        heldout = self.islands[0].heldout
        batches = data.eval_batches(
            heldout, self.args.batch, self.args.seq_len, self.args.eval_batches
        )
        loss = float(np.mean([float(self.inner.loss(params, b)) for b in batches]))
        lr, momentum, _ = self.cfg.outer_settings(self.cell.islands)
        return {
            "heldout_loss": loss,
            "outer_in_effect": {"lr": lr, "momentum": momentum},  # at K pushing islands
            "outer_steps": self.outer_steps,
            "island_rounds": [isl.round for isl in self.islands],
            "pushes": sum(isl.pushes for isl in self.islands),
            "skipped_pushes": sum(isl.skipped for isl in self.islands),
            "folds": sum(isl.folds for isl in self.islands),
            "staleness_histogram": self.state.status(T0)["staleness_histogram"],
        }

    def _run_sync(self, h: int, budget: int) -> None:
        """Lock-step rounds: every island waits for its round's merge (Session in sync mode)."""
        k, now = self.cell.islands, 0.0
        for _ in range(budget // (k * h)):
            for isl in self.islands:
                for _ in range(h):
                    self.train_step(isl)
            now += h * max(self.step_s)
            self.touch_all(now)
            for i in range(k):
                self.push(i, now, last=True)
            if self.step_due(now) is not None:
                raise RuntimeError("sync round left a wake time")
            now += self.latency
            for isl in self.islands:
                self.fold(isl, now)

    def _run_overlapped(self, h: int, budget: int) -> None:
        """Quorum / async: islands at their own speeds, folding at every step."""
        k = self.cell.islands
        started = 0  # inner steps of the rounds started so far (the budget)
        in_round = [0] * k
        queue: list[tuple[float, int]] = []
        for i in range(k):
            if started + h <= budget:
                started += h
                heapq.heappush(queue, (self.step_s[i], i))
        wake: float | None = None
        while queue:
            now, i = heapq.heappop(queue)
            while wake is not None and wake <= now:  # a grace window closed before this
                self.touch_all(wake)
                wake = self.step_due(wake)
            isl = self.islands[i]
            self.train_step(isl)
            in_round[i] += 1
            self.touch_all(now)
            if in_round[i] == h:
                in_round[i] = 0
                more = started + h <= budget
                self.push(i, now, last=not more)
                wake = self.step_due(now)
                if more:
                    started += h
                else:
                    isl = None
            if isl is not None:
                self.fold(isl, now)
                heapq.heappush(queue, (now + self.step_s[i], i))
        while wake is not None:
            self.touch_all(wake)
            wake = self.step_due(wake)


def pairs_of(args, mode: str) -> list[tuple[float | None, float | None]]:
    """The (lr, momentum) cells of a mode: its --pairs, else its lr grid x momentum grid.

    --pairs default gives one cell (None, None): the shard's defaults.
    """
    given = args.async_pairs if mode == "async" else args.pairs
    if given == "default":
        return [(None, None)]
    if given:
        return [(float(a), float(b)) for a, b in (x.split("/") for x in given.split(","))]
    lrs = args.async_lrs if mode == "async" else args.lrs
    momenta = args.async_momenta if mode == "async" else args.momenta
    return [(float(lr), float(m)) for lr in lrs.split(",") for m in momenta.split(",")]


def grid_cells(args) -> list[Cell]:
    """Every cell of the grid, in mode, H, K, lr, momentum order."""
    cells = []
    skip_modes = {"on": (True,), "off": (False,), "both": (False, True)}[args.push_skip]
    for mode in args.modes.split(","):
        for h in (int(x) for x in args.inner_steps.split(",")):
            for k in (int(x) for x in args.islands.split(",")):
                if args.budget // (k * h) < args.min_rounds:
                    continue
                for lr, m in pairs_of(args, mode):
                    for skip in skip_modes if mode == "quorum" else (False,):
                        for seed in range(args.first_seed, args.first_seed + args.seeds):
                            for kept in dtypes_of(args):
                                cells.append(Cell(mode, k, h, lr, m, skip, seed, kept))
    return cells


def dtypes_of(args) -> list[str]:
    """The momentum dtypes of --momentum-dtypes, in order (the first is the reference)."""
    return [x.strip() for x in args.momentum_dtypes.split(",") if x.strip()]


def momentum_dtype_table(rows: list[dict], args) -> dict:
    """Each other momentum dtype against the first, per mode, H, K, lr/momentum and push skip.

    Returns:
        {mode: {H: {K: [{"lr", "momentum", "push_skip", dtype: mean loss, ...,
        "<dtype>_vs_<first>": ratio of the means minus 1, "<dtype>_paired": the
        per-seed ratios minus 1 (same data order)}]}}}; empty with one dtype.
    """
    dtypes = dtypes_of(args)
    if len(dtypes) < 2:
        return {}
    groups: dict[tuple, dict[str, dict[int, float]]] = {}
    for r in rows:
        key = (r["mode"], r["inner_steps"], r["islands"], r["lr"], r["momentum"], r["push_skip"])
        groups.setdefault(key, {}).setdefault(r["momentum_dtype"], {})[r["seed"]] = r[
            "heldout_loss"
        ]
    out: dict = {}
    first = dtypes[0]
    for (mode, h, k, lr, m, skip), by in groups.items():
        entry: dict = {"lr": lr, "momentum": m, "push_skip": skip}
        for kept in dtypes:
            if kept in by:
                entry[kept] = float(np.mean(list(by[kept].values())))
        for kept in dtypes[1:]:
            if kept in by and first in by:
                entry[f"{kept}_vs_{first}"] = entry[kept] / entry[first] - 1
                seeds = sorted(set(by[kept]) & set(by[first]))
                entry[f"{kept}_paired"] = [by[kept][s] / by[first][s] - 1 for s in seeds]
        out.setdefault(mode, {}).setdefault(str(h), {}).setdefault(str(k), []).append(entry)
    return out


def best_of(rows: list[dict], args) -> dict:
    """Per mode / H / K (push skip off, or on when only on ran): the lowest mean loss."""
    means: dict[tuple, list[float]] = {}
    for r in rows:
        key = (r["mode"], r["inner_steps"], r["islands"], r["lr"], r["momentum"], r["push_skip"])
        means.setdefault(key, []).append(r["heldout_loss"])
    best: dict = {}
    for (mode, h, k, lr, m, skip), losses in means.items():
        if skip and args.push_skip == "both":
            continue
        pairs = pairs_of(args, mode)
        lr_grid, m_grid = sorted({a for a, _ in pairs}), sorted({b for _, b in pairs})
        slot = best.setdefault(mode, {}).setdefault(str(h), {})
        mean = float(np.mean(losses))
        if str(k) not in slot or mean < slot[str(k)]["heldout_loss"]:
            edge = []
            if len(lr_grid) > 1 and lr in (min(lr_grid), max(lr_grid)):
                edge.append("lr")
            if len(m_grid) > 1 and m in (min(m_grid), max(m_grid)):
                edge.append("momentum")
            slot[str(k)] = {"lr": lr, "momentum": m, "heldout_loss": mean, "on_edge": edge}
    return best


def compare(best: dict, mode: str, against: str) -> dict:
    """Best of `mode` over best of `against`, minus 1, per H and K."""
    out: dict = {}
    for h, by_k in best.get(mode, {}).items():
        for k, cell in by_k.items():
            ref = best.get(against, {}).get(h, {}).get(k)
            if ref is not None:
                out.setdefault(h, {})[k] = cell["heldout_loss"] / ref["heldout_loss"] - 1
    return out


def push_skip_table(rows: list[dict]) -> dict:
    """Quorum with the skip on against off, per H, K, lr, momentum (when both ran)."""
    pairs: dict[tuple, dict] = {}
    for r in rows:
        if r["mode"] == "quorum":
            key = (r["inner_steps"], r["islands"], r["lr"], r["momentum"])
            pairs.setdefault(key, {}).setdefault(r["push_skip"], []).append(r)
    out: dict = {}
    for (h, k, lr, m), by in sorted(pairs.items()):
        if True in by and False in by:
            on = float(np.mean([r["heldout_loss"] for r in by[True]]))
            off = float(np.mean([r["heldout_loss"] for r in by[False]]))
            out.setdefault(str(h), {}).setdefault(str(k), []).append(
                {
                    "lr": lr,
                    "momentum": m,
                    "off": off,
                    "on": on,
                    "on_vs_off": on / off - 1,
                    "skipped_pushes": by[True][0]["skipped_pushes"],
                    "pushes_on": by[True][0]["pushes"],
                    "pushes_off": by[False][0]["pushes"],
                }
            )
    return out


def run(args: argparse.Namespace) -> int:
    """Run the grid and print JSON.

    Args:
        args: parsed flags.

    Returns:
        exit status 0.
    """
    corpus = data.default_corpus()
    icfg = InnerConfig(batch_size=args.batch, seq_len=args.seq_len)
    inner = InnerSteps(MICRO, icfg)
    init = {k: np.asarray(v) for k, v in codec.flatten(model.init_params(MICRO, 0)).items()}
    cells = grid_cells(args)
    rows = []
    start = time.perf_counter()
    with progress() as p:
        task = p.add_task("outer sweep", total=len(cells))
        for cell in cells:
            figures = Sim(args, cell, corpus, inner, init).run()
            rows.append({**dataclasses.asdict(cell), **figures})
            p.advance(task)
    reference = [r for r in rows if r["momentum_dtype"] == dtypes_of(args)[0]]
    best = best_of(reference, args)
    result = {
        "command": " ".join(sys.argv),
        "settings": vars(replace_args(args)),
        "model": dataclasses.asdict(MICRO),
        "too_short": [
            {"inner_steps": int(h), "islands": int(k), "rounds": args.budget // (int(k) * int(h))}
            for h in args.inner_steps.split(",")
            for k in args.islands.split(",")
            if args.budget // (int(k) * int(h)) < args.min_rounds
        ],
        "cells": rows,
        "best": best,
        "async_vs_sync": compare(best, "async", "sync"),
        "quorum_vs_sync": compare(best, "quorum", "sync"),
        "push_skip": push_skip_table(reference),
        "momentum_dtype": momentum_dtype_table(rows, args),
        "seconds": time.perf_counter() - start,
    }
    emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(cli.main(["outer_sweep", *sys.argv[1:]]))
