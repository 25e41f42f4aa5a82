"""Outer lr / momentum sweep for fully asynchronous merging (picks the mode=async defaults).

JSON on stdout, progress on stderr. An in-process simulation, no sockets: a
real `ShardState` in mode "async" (every delta steps, staleness-weighted) and
`--islands` islands training the real model with the real inner optimizer
(worker.model, worker.train's AdamW, the embedded corpus) at different speeds. Time is simulated: island i needs `speeds[i]` time units
per inner step, so fast islands push more often and slow islands push stale
deltas; the islands run in the order their rounds finish. Every setting sees
the same total number of island rounds, data and seeds; the result is the
held-out loss of the global parameters at the end (lower is better).
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import codec
from bench import cli
from bench.common import emit_json, progress
from paramserver.server.config import ShardConfig
from paramserver.server.state import ShardState
from paramserver.wire.plan import leaf_specs, make_plan
from worker import data, model
from worker.train import InnerConfig, make_inner_optimizer

T0 = 1_000_000.0
# (outer lr, momentum, nesterov delay): plain Nesterov, momentum-free SGD, and delayed
# Nesterov (momentum moves once per `delay` deltas, by their mean: Async Local-SGD)
GRID = [
    (0.7, 0.9, 1),
    (0.35, 0.9, 1),
    (1.0, 0.0, 1),
    (0.7, 0.0, 1),
    (0.5, 0.0, 1),
    (0.7, 0.9, 3),
    (1.0, 0.9, 3),
    (0.5, 0.9, 3),
    (0.7, 0.8, 3),
    (0.7, 0.9, 6),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench async_outer`.

    Args:
        parser: the subcommand's parser.
    """
    parser.add_argument(
        "--model",
        default="tiny",
        choices=sorted(model.MODEL_CONFIGS),
        help="the islands' model preset (worker.model; default tiny)",
    )
    parser.add_argument(
        "--islands", type=int, default=3, help="in-process islands that train at once (default 3)"
    )
    parser.add_argument("--speeds", default="1.0,1.5,2.5", help="time units per inner step")
    parser.add_argument("--inner-steps", type=int, default=10, help="inner steps per round")
    parser.add_argument("--rounds", type=int, default=30, help="island rounds in total")
    parser.add_argument("--seeds", type=int, default=2, help="repeats with other data orders")
    parser.add_argument(
        "--grid",
        default=";".join(f"{lr},{m},{d}" for lr, m, d in GRID),
        help="lr,momentum[,nesterov delay] triples separated by ';'",
    )


class InnerSteps:
    """One jitted AdamW step shared by every island and run (compiled once per process)."""

    def __init__(self, mcfg: model.ModelConfig, icfg: InnerConfig) -> None:
        self.tx = make_inner_optimizer(icfg)

        def step(params, opt_state, tokens_BxT1):
            grads = jax.grad(model.loss_fn)(params, tokens_BxT1, mcfg)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self.step = jax.jit(step)
        self.loss = jax.jit(lambda params, tokens: model.loss_fn(params, tokens, mcfg))


def sim_cluster(cfg: ShardConfig, args, seed: int, corpus: bytes, inner: InnerSteps):
    """A ShardState initialised with the model and `args.islands` islands that said hello.

    Args:
        cfg: the shard's settings.
        args: the bench flags (model, islands).
        seed: the data order's seed.
        corpus: the training text.
        inner: the jitted inner step.

    Returns:
        (state, plan, initial flat values, per-island params, AdamW states, samplers,
        the held-out text).
    """
    icfg = InnerConfig()
    mcfg = model.MODEL_CONFIGS[args.model]
    init = {k: np.asarray(v) for k, v in codec.flatten(model.init_params(mcfg, 0)).items()}
    plan = make_plan(leaf_specs(init), cfg.shards, cfg.num_fragments)
    state = ShardState(cfg, 0)
    tree = {str(f.index): plan.gather(init, f.index) for f in plan.fragments}
    state.initialize(plan.to_wire(), codec.raw("float32").encode(tree)[0])
    params, opt_states, samplers = [], [], []
    heldout = None
    for i in range(args.islands):
        train, heldout = data.split_corpus(corpus, args.islands, i)
        samplers.append(data.BatchSampler(train, icfg.batch_size, icfg.seq_len, seed * 100 + i))
        params.append(jax.tree.map(jnp.asarray, codec.unflatten(init)))
        opt_states.append(inner.tx.init(params[i]))
        state.hello(f"i{i}", T0)
    return state, plan, init, params, opt_states, samplers, heldout


def simulate(
    args, lr: float, momentum: float, delay: int, seed: int, corpus: bytes, inner: InnerSteps
) -> dict:
    """One async run; returns the final held-out loss and what the shard saw."""
    icfg = InnerConfig()
    cfg = ShardConfig(
        mode="async",
        outer_lr=lr,
        outer_momentum=momentum,
        nesterov_delay=delay,
        outer_optimizer="nesterov" if momentum > 0 else "sgd",
        fsync=False,
        dedup_window=1 << 20,
    )
    state, plan, init, params, opt_states, samplers, heldout = sim_cluster(
        cfg, args, seed, corpus, inner
    )
    speeds = [float(s) for s in args.speeds.split(",")][: args.islands]
    starts = [(state.versions(), {k: v.copy() for k, v in init.items()}) for _ in params]
    queue = [(args.inner_steps * speeds[i], i) for i in range(args.islands)]
    heapq.heapify(queue)
    raw32 = codec.raw("float32")
    rounds = [0] * args.islands
    for _ in range(args.rounds):
        now, i = heapq.heappop(queue)
        for _ in range(args.inner_steps):
            params[i], opt_states[i] = inner.step(params[i], opt_states[i], samplers[i].next())
        local = {k: np.asarray(v) for k, v in codec.flatten(params[i]).items()}
        versions, start = starts[i]
        rounds[i] += 1
        for frag in plan.fragments:
            delta = plan.gather(start, frag.index) - plan.gather(local, frag.index)
            header = {
                "island": f"i{i}",
                "round": rounds[i],
                "fragment": frag.index,
                "base_version": versions[frag.index],
                "tokens": args.inner_steps * icfg.batch_size * icfg.seq_len,
                "steps": args.inner_steps,
                "plan_hash": plan.hash,
            }
            out = state.submit_delta(header, raw32.encode({"delta": delta})[0], T0 + now)
            assert out.status == "accepted", out
        for f in state.due_fragments(T0 + now)[0]:
            state.step(f, T0 + now)
        glob = global_params(state, plan, init)
        params[i] = jax.tree.map(jnp.asarray, codec.unflatten(glob))  # AdamW state kept
        starts[i] = (state.versions(), glob)
        heapq.heappush(queue, (now + args.inner_steps * speeds[i], i))
    final = jax.tree.map(jnp.asarray, codec.unflatten(global_params(state, plan, init)))
    batches = data.eval_batches(heldout, icfg.batch_size, icfg.seq_len, 8)
    loss = float(np.mean([float(inner.loss(final, b)) for b in batches]))
    status = state.status(T0)
    return {
        "heldout_loss": loss,
        "rounds_per_island": rounds,
        "staleness_histogram": status["staleness_histogram"],
    }


def global_params(state: ShardState, plan, template: dict) -> dict:
    """The shard's global parameters as a flat tree.

    Args:
        state: a shard owning every fragment of `plan`.
        plan: the fragment plan.
        template: a flat tree of the model's leaves (copied, then overwritten).

    Returns:
        {leaf name: array} of the shard's current parameters.
    """
    glob = {k: v.copy() for k, v in template.items()}
    for frag in plan.fragments:
        plan.scatter(frag.index, state.snapshot(frag.index)[1], glob)
    return glob


def run(args: argparse.Namespace) -> int:
    """Run the sweep and print JSON.

    Args:
        args: parsed flags.

    Returns:
        exit status 0.
    """
    grid = []
    for item in args.grid.split(";"):
        lr, momentum, *delay = item.split(",")
        grid.append((float(lr), float(momentum), int(delay[0]) if delay else 1))
    corpus = data.default_corpus()
    inner = InnerSteps(model.MODEL_CONFIGS[args.model], InnerConfig())
    result: dict = {"command": " ".join(sys.argv), "settings": vars(replace_args(args)), "runs": []}
    with progress() as p:
        task = p.add_task("async outer sweep", total=len(grid) * args.seeds)
        for lr, momentum, delay in grid:
            losses = []
            start = time.perf_counter()
            for seed in range(args.seeds):
                run_result = simulate(args, lr, momentum, delay, seed, corpus, inner)
                losses.append(run_result["heldout_loss"])
                p.advance(task)
            result["runs"].append(
                {
                    "outer_lr": lr,
                    "outer_momentum": momentum,
                    "nesterov_delay": delay,
                    "heldout_loss_per_seed": losses,
                    "heldout_loss_mean": float(np.mean(losses)),
                    "heldout_loss_spread": float(np.max(losses) - np.min(losses)),
                    "rounds_per_island": run_result["rounds_per_island"],
                    "staleness_histogram": run_result["staleness_histogram"],
                    "seconds": time.perf_counter() - start,
                }
            )
    best = min(result["runs"], key=lambda r: r["heldout_loss_mean"])
    keys = (
        "outer_lr",
        "outer_momentum",
        "nesterov_delay",
        "heldout_loss_mean",
        "heldout_loss_spread",
    )
    result["best"] = {k: best[k] for k in keys}
    emit_json(result)
    return 0


def replace_args(args: argparse.Namespace) -> argparse.Namespace:
    """The flags without internals (for the JSON record)."""
    return argparse.Namespace(**{k: v for k, v in vars(args).items() if not k.startswith("_")})


if __name__ == "__main__":
    sys.exit(cli.main(["async_outer", *sys.argv[1:]]))
