"""Outer lr / momentum per H: synchronous DiLoCo against DDP at equal tokens (picks the sync defaults).

JSON on stdout, progress on stderr. An in-process simulation, no sockets or
daemons: `--islands` islands train the real model with the real inner AdamW
(worker.model, worker.train) on the data streams and held-out set a
`diloco-worker` of the same name gets (`worker.data.island_data`: island-i on
data shard i, the fidelity harness's layout); every H inner steps each pushes
its float32 delta into a real `ShardState` in mode "sync" (the default
weighting and downlink), which takes one outer step once every island pushed,
and the islands adopt the new global parameters (keeping their AdamW state).
The DDP baseline trains the same model from the same init on the same
streams: each step averages the islands' gradients and applies the same AdamW
(`bench.children.ddp_rank`'s jitted steps). Both see the same tokens:
`islands * steps_per_island * batch * seq_len` (a last round shorter than H
when H does not divide the steps). The result of a run is the held-out loss of
its final parameters (nats/byte, lower is better); a seed changes the model
init and the data order, as `--seed` does for the fidelity harness.

A grid item "default" is the shard's default outer lr / momentum for that H
(`paramserver.server.config.sync_outer_defaults`).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import codec
from bench import cli
from bench.async_outer import InnerSteps, global_params
from bench.children.ddp_rank import make_apply_step, make_grad_step
from bench.common import emit_json
from paramserver.server.config import ShardConfig, sync_outer_defaults
from paramserver.server.state import ShardState
from paramserver.wire.plan import leaf_specs, make_plan
from worker import data, model
from worker.config import IslandConfig
from worker.train import InnerConfig

T0 = 1_000_000.0
GRID = "default;0.7,0.9"  # the rule against the DiLoCo paper's values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench outer_h`.

    Args:
        parser: the subcommand's parser.
    """
    parser.add_argument("--model", default="tiny", choices=sorted(model.MODEL_CONFIGS),
                        help="model of every run")  # fmt: skip
    parser.add_argument("--islands", type=int, default=2, help="islands (DDP: ranks)")
    parser.add_argument("--steps-per-island", type=int, default=480,
                        help="inner steps each island trains (DDP: steps)")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step and island")
    parser.add_argument("--seq-len", type=int, default=128, help="bytes per sequence")
    parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches of the eval")
    parser.add_argument(
        "--hs", default="10,30,100", help="inner steps per round H, comma-separated"
    )
    parser.add_argument("--grid", default=GRID,
                        help="outer settings tried at every H: 'lr,momentum' items or 'default' "
                             "(the shard's default for that H), separated by ';'")  # fmt: skip
    parser.add_argument("--seeds", default="0,1,2", help="seeds, comma-separated")
    parser.add_argument("--no-ddp", action="store_true", help="skip the DDP baseline")


def _parse(
    args: argparse.Namespace,
) -> tuple[list[int], list[tuple[float, float] | None], list[int]]:
    """(H values, grid items: (lr, momentum) or None for the default, seeds) from the flags."""
    hs = [int(h) for h in args.hs.split(",")]
    grid: list[tuple[float, float] | None] = []
    for item in args.grid.split(";"):
        if item.strip() == "default":
            grid.append(None)
            continue
        try:
            lr, momentum = item.split(",")
            grid.append((float(lr), float(momentum)))
        except ValueError:
            raise ValueError(f"--grid item {item!r} must be 'lr,momentum' or 'default'") from None
        ShardConfig(mode="sync", outer_lr=grid[-1][0], outer_momentum=grid[-1][1])  # refuses bad
    seeds = [int(s) for s in args.seeds.split(",")]
    sizes = ("islands", "steps_per_island", "batch_size", "seq_len", "eval_batches")
    for name, value in [("hs", h) for h in hs] + [(k, getattr(args, k)) for k in sizes]:
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value} must be >= 1")
    return hs, grid, seeds


class Streams:
    """The islands' training samplers and the common held-out set for one seed."""

    def __init__(self, args: argparse.Namespace, seed: int) -> None:
        """Cut the corpus as `diloco-worker` island-0..island-K-1 with this seed would.

        Args:
            args: budget flags.
            seed: the run's seed.
        """
        self.samplers = []
        for i in range(args.islands):
            cfg = IslandConfig(island=f"island-{i}", data_shard=i, seed=seed, model=args.model,
                               batch_size=args.batch_size, seq_len=args.seq_len,
                               eval_batches=args.eval_batches)  # fmt: skip
            own = data.island_data(cfg)
            self.samplers.append(own.sampler)
            self.eval_set = own.eval_set


def _eval(inner: InnerSteps, params, eval_set) -> float:
    return float(np.mean([float(inner.loss(params, b)) for b in eval_set]))


def run_ddp(args, seed: int, inner: InnerSteps, grad_step, apply_cache: dict) -> float:
    """DDP: every step applies AdamW to the mean of the islands' gradients; final eval loss."""
    mcfg = model.MODEL_CONFIGS[args.model]
    streams = Streams(args, seed)
    params = model.init_params(mcfg, seed)
    if "apply" not in apply_cache:
        apply_cache["apply"] = make_apply_step(inner.tx, params)
    apply_step = apply_cache["apply"]
    opt_state = inner.tx.init(params)
    for _ in range(args.steps_per_island):
        grads = [np.asarray(grad_step(params, s.next())[1]) for s in streams.samplers]
        params, opt_state = apply_step(params, opt_state, np.mean(grads, axis=0))
    return _eval(inner, params, streams.eval_set)


def run_sync(args, seed: int, h: int, lr: float, momentum: float, inner: InnerSteps) -> float:
    """Synchronous DiLoCo through a real ShardState; final eval loss of the global params."""
    mcfg = model.MODEL_CONFIGS[args.model]
    streams = Streams(args, seed)
    cfg = ShardConfig(mode="sync", inner_steps=h, outer_lr=lr, outer_momentum=momentum,
                      fsync=False, dedup_window=1 << 20)  # fmt: skip
    init = {k: np.asarray(v) for k, v in codec.flatten(model.init_params(mcfg, seed)).items()}
    plan = make_plan(leaf_specs(init), cfg.shards, cfg.num_fragments)
    state = ShardState(cfg, 0)
    raw32 = codec.raw("float32")
    tree = {str(f.index): plan.gather(init, f.index) for f in plan.fragments}
    state.initialize(plan.to_wire(), raw32.encode(tree)[0])
    islands = range(args.islands)
    for i in islands:
        state.hello(f"island-{i}", T0)
    glob = {k: v.copy() for k, v in init.items()}
    params = [jax.tree.map(jnp.asarray, codec.unflatten(init)) for _ in islands]
    opt_states = [inner.tx.init(p) for p in params]
    done, round_index = 0, 0
    while done < args.steps_per_island:
        steps = min(h, args.steps_per_island - done)
        round_index += 1
        versions = state.versions()
        for i in islands:
            for _ in range(steps):
                params[i], opt_states[i] = inner.step(params[i], opt_states[i],
                                                      streams.samplers[i].next())  # fmt: skip
            local = {k: np.asarray(v) for k, v in codec.flatten(params[i]).items()}
            for frag in plan.fragments:
                delta = plan.gather(glob, frag.index) - plan.gather(local, frag.index)
                header = {"island": f"island-{i}", "round": round_index, "fragment": frag.index,
                          "base_version": versions[frag.index], "steps": steps,
                          "tokens": steps * args.batch_size * args.seq_len,
                          "plan_hash": plan.hash}  # fmt: skip
                out = state.submit_delta(header, raw32.encode({"delta": delta})[0], T0)
                if out.status != "accepted":
                    raise RuntimeError(f"push refused: {out}")
        due = state.due_fragments(T0)[0]
        if len(due) != len(plan.fragments):
            raise RuntimeError(f"sync shard stepped {due} of {len(plan.fragments)} fragments")
        for f in due:
            state.step(f, T0)
        glob = global_params(state, plan, init)
        params = [jax.tree.map(jnp.asarray, codec.unflatten(glob)) for _ in islands]
        done += steps
    final = jax.tree.map(jnp.asarray, codec.unflatten(glob))
    return _eval(inner, final, streams.eval_set)


def _summary(losses: list[float], ddp_mean: float | None) -> dict:
    mean = float(np.mean(losses))
    out = {
        "eval_loss_per_seed": losses,
        "eval_loss_mean": mean,
        "eval_loss_spread": float(np.max(losses) - np.min(losses)),
        "eval_loss_std": float(np.std(losses)),
    }
    if ddp_mean is not None:
        out["vs_ddp"] = mean / ddp_mean
    return out


def run(args: argparse.Namespace) -> int:
    """Run the sweep and print JSON.

    Args:
        args: parsed flags.

    Returns:
        exit status 0 (2 for a bad --hs / --grid / --seeds).
    """
    try:
        hs, grid, seeds = _parse(args)
    except ValueError as exc:  # ConfigError is one
        print(f"diloco-bench outer_h: {exc} (see --help)", file=sys.stderr)
        return 2
    mcfg = model.MODEL_CONFIGS[args.model]
    icfg = InnerConfig(batch_size=args.batch_size, seq_len=args.seq_len)
    inner = InnerSteps(mcfg, icfg)
    budget = {k: getattr(args, k) for k in ("model", "islands", "steps_per_island", "batch_size",
                                            "seq_len", "eval_batches")}  # fmt: skip
    budget["tokens"] = args.islands * args.steps_per_island * args.batch_size * args.seq_len
    result: dict = {"command": " ".join(sys.argv), "budget": budget, "seeds": seeds, "runs": []}
    started = time.perf_counter()

    def note(text: str) -> None:
        print(f"[{time.perf_counter() - started:7.0f}s] {text}", file=sys.stderr, flush=True)

    ddp_mean = None
    if not args.no_ddp:
        grad_step, cache = make_grad_step(mcfg), {}
        losses = []
        for seed in seeds:
            losses.append(run_ddp(args, seed, inner, grad_step, cache))
            note(f"ddp seed {seed}: {losses[-1]:.4f}")
        result["ddp"] = _summary(losses, None)
        ddp_mean = result["ddp"]["eval_loss_mean"]
    for h in hs:
        for item in grid:
            default = item is None
            lr, momentum = sync_outer_defaults(h) if default else item
            losses = []
            for seed in seeds:
                losses.append(run_sync(args, seed, h, lr, momentum, inner))
                note(f"sync H={h} lr={lr} momentum={momentum} seed {seed}: {losses[-1]:.4f}")
            result["runs"].append({"inner_steps": h, "outer_lr": lr, "outer_momentum": momentum,
                                   "default": default, **_summary(losses, ddp_mean)})  # fmt: skip
    best: dict = {}
    for h in hs:
        runs = [r for r in result["runs"] if r["inner_steps"] == h]
        top = min(runs, key=lambda r: r["eval_loss_mean"])
        best[str(h)] = {k: top[k] for k in ("outer_lr", "outer_momentum", "eval_loss_mean",
                                            "eval_loss_spread", "vs_ddp") if k in top}  # fmt: skip
    result["best_per_h"] = best
    result["seconds"] = time.perf_counter() - started
    emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(cli.main(["outer_h", *sys.argv[1:]]))
