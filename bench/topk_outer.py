"""Outer lr sweep for sparse top-k deltas (picks `ShardConfig.sparse_outer_lr`).

JSON on stdout, progress on stderr. An in-process simulation of synchronous
DiLoCo, no sockets: a real `ShardState` in mode "sync" and `--islands`
islands training the real model with the real inner optimizer (as
`bench.async_outer` does). Every round each island trains `--inner-steps`
steps from the global parameters, encodes its delta with its own codec and
error-feedback state (the island's `codec.encode`), the shard merges the
round and steps. Variants, all at the same tokens, data and seeds:

- `int8`: int8 deltas, the sync outer default (Nesterov 0.7 / 0.9);
- `topk-mean-nesterov`: top-k deltas handed to the shard decoded (float32),
  so they take the dense mean and Nesterov: what the shard did before
  `paramserver.server.step.sparse_merge`;
- `topk-sgd-<lr>`: top-k deltas kept coded: the per-entry merge and SGD
  without momentum at that `sparse_outer_lr`.

The result is the held-out loss of the global parameters at the end (lower is
better) and its ratio to int8's.
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
from bench.async_outer import T0, InnerSteps, global_params, replace_args, sim_cluster
from bench.common import emit_json, progress
from paramserver.server.config import ShardConfig
from worker import data, model
from worker.train import InnerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench topk_outer`.

    Args:
        parser: the subcommand's parser.
    """
    parser.add_argument("--model", default="tiny", choices=sorted(model.MODEL_CONFIGS),
                        help="model configuration to train (default tiny)")  # fmt: skip
    parser.add_argument("--islands", type=int, default=3, help="islands trained side by side")
    parser.add_argument("--inner-steps", type=int, default=30, help="inner steps per round (H)")
    parser.add_argument("--rounds", type=int, default=20, help="synchronous outer rounds per run")
    parser.add_argument("--seeds", type=int, default=1, help="repeats with other data orders")
    parser.add_argument("--density", type=float, default=0.02, help="topk share of entries")
    parser.add_argument("--lrs", default="0.5,0.7,1.0,1.4", help="sparse outer lrs to try")


def _variants(lrs: str) -> list[tuple[str, str, bool, float]]:
    """(name, codec, kept coded, sparse outer lr) of every variant."""
    out = [("int8", "int8", True, 1.0), ("topk-mean-nesterov", "topk", False, 1.0)]
    return out + [(f"topk-sgd-{lr}", "topk", True, float(lr)) for lr in lrs.split(",")]


def simulate(args, variant, seed: int, corpus: bytes, inner: InnerSteps) -> dict:
    """One synchronous run; returns the final held-out loss and the delta bytes sent."""
    _, scheme, coded, lr = variant
    icfg = InnerConfig()
    cfg = ShardConfig(mode="sync", sparse_outer_lr=lr, fsync=False, dedup_window=1 << 20)
    make = codec.topk(density=args.density) if scheme == "topk" else codec.int8()
    raw32 = codec.raw("float32")
    state, plan, init, params, opt_states, samplers, heldout = sim_cluster(
        cfg, args, seed, corpus, inner
    )
    ef = [
        {f.index: make.init({"delta": np.zeros(f.size, np.float32)}) for f in plan.fragments}
        for _ in params
    ]
    start, sent = init, 0
    for r in range(args.rounds):
        now = T0 + r + 1.0
        versions = state.versions()
        for i in range(args.islands):
            for _ in range(args.inner_steps):
                params[i], opt_states[i] = inner.step(params[i], opt_states[i], samplers[i].next())
            local = {k: np.asarray(v) for k, v in codec.flatten(params[i]).items()}
            for frag in plan.fragments:
                delta = plan.gather(start, frag.index) - plan.gather(local, frag.index)
                frames, ef[i][frag.index] = make.encode({"delta": delta}, ef[i][frag.index])
                sent += sum(len(f) for f in frames)
                if not coded:
                    frames = raw32.encode({"delta": codec.decode(frames)["delta"]})[0]
                header = {
                    "island": f"i{i}",
                    "round": r + 1,
                    "fragment": frag.index,
                    "base_version": versions[frag.index],
                    "tokens": args.inner_steps * icfg.batch_size * icfg.seq_len,
                    "steps": args.inner_steps,
                    "plan_hash": plan.hash,
                }
                out = state.submit_delta(header, frames, now)
                assert out.status == "accepted", out
        for f in state.due_fragments(now)[0]:
            state.step(f, now)
        start = global_params(state, plan, init)
        for i in range(args.islands):  # everyone adopts the new version; AdamW state kept
            params[i] = jax.tree.map(jnp.asarray, codec.unflatten(start))
    final = jax.tree.map(jnp.asarray, codec.unflatten(start))
    batches = data.eval_batches(heldout, icfg.batch_size, icfg.seq_len, 8)
    loss = float(np.mean([float(inner.loss(final, b)) for b in batches]))
    return {"heldout_loss": loss, "delta_bytes": sent}


def run(args: argparse.Namespace) -> int:
    """Run the sweep and print JSON.

    Args:
        args: parsed flags.

    Returns:
        exit status 0.
    """
    variants = _variants(args.lrs)
    corpus = data.default_corpus()
    inner = InnerSteps(model.MODEL_CONFIGS[args.model], InnerConfig())
    result: dict = {"command": " ".join(sys.argv), "settings": vars(replace_args(args)), "runs": []}
    with progress() as p:
        task = p.add_task("topk outer sweep", total=len(variants) * args.seeds)
        for variant in variants:
            losses, started = [], time.perf_counter()
            for seed in range(args.seeds):
                one = simulate(args, variant, seed, corpus, inner)
                losses.append(one["heldout_loss"])
                p.advance(task)
            result["runs"].append(
                {
                    "variant": variant[0],
                    "sparse_outer_lr": variant[3] if variant[2] and variant[1] == "topk" else None,
                    "heldout_loss_per_seed": losses,
                    "heldout_loss_mean": float(np.mean(losses)),
                    "delta_bytes": one["delta_bytes"],
                    "seconds": time.perf_counter() - started,
                }
            )
    int8 = result["runs"][0]["heldout_loss_mean"]
    for entry in result["runs"]:
        entry["loss_over_int8"] = entry["heldout_loss_mean"] / int8
    sparse = [r for r in result["runs"] if r["sparse_outer_lr"] is not None]
    best = min(sparse, key=lambda r: r["heldout_loss_mean"])
    result["best"] = {k: best[k] for k in ("variant", "sparse_outer_lr", "loss_over_int8")}
    emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(cli.main(["topk_outer", *sys.argv[1:]]))
