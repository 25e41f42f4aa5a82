"""The step rule as islands multiply: round movement for K = 1..16, async vs sync loss (push-only folds), the harsh mix.

JSON on stdout, progress on stderr. In process, no sockets: a real
`ShardState` (default outer settings of its mode, async movement at lr 0.7,
float32 downlink) driven on a simulated clock, as `bench.async_outer` does.
Three parts:

- ``movement``: K islands each push the same delta d (base version 0) in one
  round, arriving one per second; the shard steps whenever its merge policy
  says so (async: every delta; quorum: the default quorum 2 and its grace
  window, so a big round takes several steps). The figure is |params after
  the round - params before| / |d|, and its ratio to K = 1's (the target:
  within 20%). Also "quorum_together": every delta arrives at once.
- ``loss``: K islands train the real tiny model (worker.model, the inner
  AdamW, the embedded corpus) for the same island rounds in sync mode (every
  round, one step on all K) and in async mode (island i needs 1 + i/(2K) time
  units per inner step, so slower islands push staler deltas); held-out loss
  of the global parameters at the end, at equal tokens. What it models:
  an island adopts the global model only at its own push (it pushes, the
  shard steps, the island takes the newest version and starts its next
  round from it), not the daemon's fold rule, under which a real island
  folds every published version at its next inner step (`worker.session`).
  With push-only folds async reads worse than the daemons do (the issue-32
  audit: +3.1% against +0.2% at K=8); `bench.outer_sweep` simulates the
  daemon's fold rule and is the one to read for the async price.
- ``harsh``: quorum mode (quorum 2, eq3 grace) on the harsh speed mix of
  `bench.fidelity_plan.HARSH` (one island of 4 at half speed), same loss.

Each step rule of `--rules` (paramserver.server.weighting.STEP_RULES) and the
extra candidates "delayed-nesterov" (delayed Nesterov with delay = K, Async
Local-SGD's N = live islands) and "fedbuff" (buffer K deltas: quorum = K) run
the same scenario. On a tree without `step_rule` (the code before issue 22)
every candidate runs that code's one rule.
"""

from __future__ import annotations

import argparse
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
from bench.fidelity_plan import HARSH
from paramserver.server.config import ShardConfig
from paramserver.server.state import ShardState
from paramserver.wire.plan import leaf_specs, make_plan
from worker import data, model
from worker.train import InnerConfig

T0 = 1_000_000.0
# async movement at one lr for every K (the async default grows with the island count since
# bench.outer_sweep; the movement table measures the step rule, not the lr)
MOVEMENT_ASYNC_LR = 0.7
EXTRA = ("delayed-nesterov", "fedbuff")  # candidates that are settings, not step rules
HAS_RULE = any(f.name == "step_rule" for f in dataclasses.fields(ShardConfig))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench step_rule`.

    Args:
        parser: the subcommand's parser.
    """
    parser.add_argument(
        "--part",
        default="all",
        choices=("all", "movement", "loss", "harsh"),
        help="which measurement to run (all: the three)",
    )
    parser.add_argument(
        "--rules",
        default="round,version,share,round-staleness,delayed-nesterov,fedbuff",
        help="comma-separated candidates: step rules and delayed-nesterov, fedbuff",
    )
    parser.add_argument("--ks", default="1,2,4,8,16", help="island counts of the movement table")
    parser.add_argument("--loss-ks", default="2,4,8", help="island counts of the loss part")
    parser.add_argument(
        "--loss-rules", default="round,version", help="candidates of the loss and harsh parts"
    )
    parser.add_argument("--inner-steps", type=int, default=10, help="inner steps per round")
    parser.add_argument("--rounds", type=int, default=12, help="rounds per island (loss, harsh)")
    parser.add_argument("--seeds", type=int, default=1, help="repeats with other data orders")


def _config(candidate: str, mode: str, k: int) -> ShardConfig:
    kw: dict = {"mode": mode, "fsync": False, "dedup_window": 1 << 20, "downlink": "float32"}
    if candidate == "delayed-nesterov":
        # Async Local-SGD: momentum 0.9 moved once per K deltas, by their mean
        kw.update(outer_optimizer="delayed-nesterov", nesterov_delay=max(k, 1))
        kw.update(outer_lr=0.7, outer_momentum=0.9)
        candidate = "version"
    elif candidate == "fedbuff":  # buffer K contributions, step on their mean
        kw.update(mode="quorum", quorum=max(k, 1), grace_rule="fraction", grace_max_s=1e9)
        kw.update(grace_min_s=1e9)  # never close the window early: wait for all K
        candidate = "version"
    if HAS_RULE:
        kw["step_rule"] = candidate
    return ShardConfig(**kw)


def _shard(cfg: ShardConfig, init: dict, islands: int):
    plan = make_plan(leaf_specs(init), cfg.shards, cfg.num_fragments)
    state = ShardState(cfg, 0)
    tree = {str(f.index): plan.gather(init, f.index) for f in plan.fragments}
    state.initialize(plan.to_wire(), codec.raw("float32").encode(tree)[0])
    for i in range(islands):
        state.hello(f"i{i}", T0)
    return state, plan


def _push(state, plan, island: int, rnd: int, base, start: dict, local: dict, tokens, steps, t):
    raw32 = codec.raw("float32")
    for frag in plan.fragments:
        header = {
            "island": f"i{island}",
            "round": rnd,
            "fragment": frag.index,
            "base_version": base[frag.index],
            "tokens": tokens,
            "steps": steps,
            "plan_hash": plan.hash,
        }
        delta = plan.gather(start, frag.index) - plan.gather(local, frag.index)
        out = state.submit_delta(header, raw32.encode({"delta": delta})[0], t)
        assert out.status == "accepted", out


def _step_due(state, now: float) -> float | None:
    for _ in range(1000):
        due, wake = state.due_fragments(now)
        if not due:
            return wake
        for f in due:
            state.step(f, now)
    raise RuntimeError("the shard kept stepping")


def _global(state, plan, template: dict) -> dict:
    glob = {k: v.copy() for k, v in template.items()}
    for frag in plan.fragments:
        plan.scatter(frag.index, state.snapshot(frag.index)[1], glob)
    return glob


def movement(candidate: str, mode: str, k: int, together: bool = False) -> dict:
    """One round of K equal deltas; the movement over the round in units of |d|."""
    rng = np.random.default_rng(0)
    init = {"w": rng.standard_normal(4096).astype(np.float32)}
    d = (rng.standard_normal(4096) * 0.01).astype(np.float32)
    cfg = _config(candidate, mode, k)
    if mode == "async" and cfg.outer_lr is None:  # one lr at every K: the step rule alone
        cfg = dataclasses.replace(cfg, outer_lr=MOVEMENT_ASYNC_LR, outer_momentum=0.0)
    state, plan = _shard(cfg, init, k)
    local = {"w": init["w"] - d}
    base = state.versions()
    wake = None
    for i in range(k):
        now = T0 + (0.0 if together else float(i))
        while wake is not None and wake <= now:  # the grace window closed before this arrival
            wake = _step_due(state, wake)
        for j in range(k):  # every island is live (heartbeats)
            state.touch(f"i{j}", now)
        _push(state, plan, i, 1, base, init, local, 1000, 10, now)
        if not together or i == k - 1:
            wake = _step_due(state, now)
    while wake is not None:
        for j in range(k):
            state.touch(f"i{j}", wake)
        wake = _step_due(state, wake)
    moved = _global(state, plan, init)["w"] - init["w"]
    steps = sum(state.versions().values())
    return {"movement": float(np.linalg.norm(moved) / np.linalg.norm(d)), "steps": steps}


def movement_table(args: argparse.Namespace, p, task) -> dict:
    """The round movement for every candidate, mode and K."""
    ks = [int(k) for k in args.ks.split(",")]
    out: dict = {}
    for candidate in args.rules.split(","):
        rows = {}
        for mode, together in (("async", False), ("quorum", False), ("quorum", True)):
            if candidate == "fedbuff" and (mode, together) != ("async", False):
                continue  # buffering K is itself a quorum of K
            name = "quorum_together" if together else mode
            cells = {k: movement(candidate, mode, k, together) for k in ks}
            base = cells[ks[0]]["movement"]
            rows[name] = {
                str(k): {**c, "ratio_to_k1": c["movement"] / base} for k, c in cells.items()
            }
            rows[name]["max_deviation"] = max(abs(c["movement"] / base - 1) for c in cells.values())
            p.advance(task)
        out[candidate] = rows
    return out


class Islands:
    """K islands of the real model and inner optimizer, each with its data and AdamW state."""

    def __init__(self, k: int, seed: int, corpus: bytes, inner: InnerSteps, init: dict) -> None:
        icfg = InnerConfig()
        self.inner, self.init = inner, init
        self.params, self.opt, self.samplers = [], [], []
        for i in range(k):
            train, self.heldout = data.split_corpus(corpus, k, i)
            sampler = data.BatchSampler(train, icfg.batch_size, icfg.seq_len, seed * 100 + i)
            self.samplers.append(sampler)
            self.params.append(jax.tree.map(jnp.asarray, codec.unflatten(init)))
            self.opt.append(inner.tx.init(self.params[i]))
        self.tokens = icfg.batch_size * icfg.seq_len

    def train(self, i: int, steps: int) -> dict:
        """`steps` inner steps of island i; returns its flat local params."""
        for _ in range(steps):
            self.params[i], self.opt[i] = self.inner.step(
                self.params[i], self.opt[i], self.samplers[i].next()
            )
        return {k: np.asarray(v) for k, v in codec.flatten(self.params[i]).items()}

    def adopt(self, i: int, glob: dict) -> None:
        """Island i starts its next round from the global params (AdamW state kept)."""
        self.params[i] = jax.tree.map(jnp.asarray, codec.unflatten(glob))

    def loss(self, glob: dict) -> float:
        """Held-out loss of flat params."""
        icfg = InnerConfig()
        final = jax.tree.map(jnp.asarray, codec.unflatten(glob))
        batches = data.eval_batches(self.heldout, icfg.batch_size, icfg.seq_len, 8)
        return float(np.mean([float(self.inner.loss(final, b)) for b in batches]))


def train_run(args, candidate: str, mode: str, k: int, seed: int, speeds, corpus, inner) -> dict:
    """K islands for args.rounds rounds each; sync steps every round on all K."""
    mcfg = model.MODEL_CONFIGS["tiny"]
    init = {x: np.asarray(v) for x, v in codec.flatten(model.init_params(mcfg, 0)).items()}
    cfg = _config(candidate, mode, k)
    if mode == "quorum":
        cfg = dataclasses.replace(cfg, quorum=2, grace_rule="eq3")
    state, plan = _shard(cfg, init, k)
    isl = Islands(k, seed, corpus, inner, init)
    h = args.inner_steps
    starts = [(state.versions(), init) for _ in range(k)]
    rounds = [0] * k
    if mode == "sync":
        for _ in range(args.rounds):
            for i in range(k):
                local = isl.train(i, h)
                rounds[i] += 1
                _push(state, plan, i, rounds[i], *starts[i], local, h * isl.tokens, h, T0)
            assert _step_due(state, T0) is None
            glob = _global(state, plan, init)
            for i in range(k):
                isl.adopt(i, glob)
                starts[i] = (state.versions(), glob)
        return {"heldout_loss": isl.loss(_global(state, plan, init)), "rounds": rounds}
    queue = [(h * speeds[i], 0, i) for i in range(k)]  # (time, kind 0 = round end, island)
    wake = None
    while queue:
        now, _, i = heapq.heappop(queue)
        while wake is not None and wake <= now:  # a grace window closed before this
            w = _step_due(state, T0 + wake)
            wake = None if w is None else w - T0
        local = isl.train(i, h)
        rounds[i] += 1
        _push(state, plan, i, rounds[i], *starts[i], local, h * isl.tokens, h, T0 + now)
        state.touch(f"i{i}", T0 + now, {"kind": "push", "t_step": speeds[i], "steps": h})
        for j in range(k):  # every island is live (heard from this round)
            state.touch(f"i{j}", T0 + now)
        w = _step_due(state, T0 + now)
        wake = None if w is None else w - T0
        glob = _global(state, plan, init)
        isl.adopt(i, glob)
        starts[i] = (state.versions(), glob)
        if rounds[i] < args.rounds:
            heapq.heappush(queue, (now + h * speeds[i], 0, i))
    while wake is not None:
        for j in range(k):
            state.touch(f"i{j}", T0 + wake)
        w = _step_due(state, T0 + wake)
        wake = None if w is None else w - T0
    hist = state.status(T0)["staleness_histogram"]
    loss = isl.loss(_global(state, plan, init))
    return {"heldout_loss": loss, "rounds": rounds, "staleness_histogram": hist}


def loss_table(args, corpus, inner, p, task) -> dict:
    """Async vs sync held-out loss at equal tokens, per K and candidate."""
    out: dict = {}
    for k in (int(x) for x in args.loss_ks.split(",")):
        speeds = [1.0 + i / (2 * k) for i in range(k)]
        row: dict = {"speeds": speeds}
        sync = [
            train_run(args, "round", "sync", k, s, speeds, corpus, inner) for s in range(args.seeds)
        ]
        row["sync"] = float(np.mean([r["heldout_loss"] for r in sync]))
        p.advance(task)
        for candidate in args.loss_rules.split(","):
            runs = [
                train_run(args, candidate, "async", k, s, speeds, corpus, inner)
                for s in range(args.seeds)
            ]
            loss = float(np.mean([r["heldout_loss"] for r in runs]))
            row[f"async_{candidate}"] = {
                "heldout_loss": loss,
                "vs_sync": loss / row["sync"] - 1,
                "staleness_histogram": runs[0]["staleness_histogram"],
            }
            p.advance(task)
        out[str(k)] = row
    return out


def harsh_table(args, corpus, inner, p, task) -> dict:
    """Quorum mode (quorum 2, eq3) on the harsh mix, per candidate, with sync as reference."""
    speeds = [1.0 / s for s, _ in HARSH]  # time per inner step: the slow island takes 2
    out: dict = {"step_time": speeds}
    sync = [
        train_run(args, "round", "sync", 4, s, speeds, corpus, inner) for s in range(args.seeds)
    ]
    out["sync"] = float(np.mean([r["heldout_loss"] for r in sync]))
    p.advance(task)
    for candidate in args.loss_rules.split(","):
        runs = [
            train_run(args, candidate, "quorum", 4, s, speeds, corpus, inner)
            for s in range(args.seeds)
        ]
        loss = float(np.mean([r["heldout_loss"] for r in runs]))
        out[f"quorum_{candidate}"] = {"heldout_loss": loss, "vs_sync": loss / out["sync"] - 1}
        p.advance(task)
    return out


def run(args: argparse.Namespace) -> int:
    """Run the parts and print JSON.

    Args:
        args: parsed flags.

    Returns:
        exit status 0.
    """
    result: dict = {
        "command": " ".join(sys.argv),
        "settings": vars(replace_args(args)),
        "has_step_rule": HAS_RULE,
    }
    parts = ("movement", "loss", "harsh") if args.part == "all" else (args.part,)
    n_rules = len(args.rules.split(","))
    n_loss = len(args.loss_rules.split(","))
    total = {
        "movement": 3 * n_rules,
        "loss": len(args.loss_ks.split(",")) * (1 + n_loss),
        "harsh": 1 + n_loss,
    }
    with progress() as p:
        task = p.add_task("step rule", total=sum(total[x] for x in parts))
        start = time.perf_counter()
        if "movement" in parts:
            result["movement"] = movement_table(args, p, task)
        if "loss" in parts or "harsh" in parts:
            corpus = data.default_corpus()
            inner = InnerSteps(model.MODEL_CONFIGS["tiny"], InnerConfig())
            if "loss" in parts:
                result["loss"] = loss_table(args, corpus, inner, p, task)
            if "harsh" in parts:
                result["harsh"] = harsh_table(args, corpus, inner, p, task)
        result["seconds"] = time.perf_counter() - start
    emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(cli.main(["step_rule", *sys.argv[1:]]))
