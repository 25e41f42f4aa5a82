"""Top-k against int8 at equal tokens: outer lr, density, EF decay and round count.

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

Top-k variants run for every density of `--densities` and every error-feedback
decay of `--ef-decays` (`codec.topk(density, ef_decay)`); their names carry
``-d<density>-ef<decay>`` when either list sweeps more than the codec's
defaults. The result is the held-out loss of the global parameters after the
last round (lower is better) and its ratio to int8's; `--eval-rounds` adds the
same figures after earlier rounds of the same runs (`by_round`: the inner lr
is constant after warm-up, so round r of a run is a run of r rounds).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from typing import NamedTuple

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
    parser.add_argument("--first-seed", type=int, default=0,
                        help="data-order seed of the first repeat (then +1, +2, ...)")  # fmt: skip
    parser.add_argument("--density", type=float, default=TOPK_DEFAULTS["density"],
                        help="topk share of entries (when --densities is not given)")  # fmt: skip
    parser.add_argument("--densities", default="",
                        help="comma list of topk densities to sweep (default: --density)")  # fmt: skip
    parser.add_argument("--ef-decays", default=str(TOPK_DEFAULTS["ef_decay"]),
                        help="comma list of topk error-feedback decays in (0, 1] to sweep")  # fmt: skip
    parser.add_argument("--bits", type=int, default=TOPK_DEFAULTS["bits"], choices=(2, 4),
                        help="topk bits per kept value")  # fmt: skip
    parser.add_argument("--lrs", default="0.5,0.7,1.0,1.4", help="sparse outer lrs to try")
    parser.add_argument("--mean-nesterov", action=argparse.BooleanOptionalAction, default=True,
                        help="also run topk decoded to float32 (dense mean + Nesterov)")  # fmt: skip
    parser.add_argument("--eval-rounds", default="",
                        help="comma list of earlier rounds to evaluate too (by_round)")  # fmt: skip


# the codec's own defaults of the swept settings (`codec.topk`'s signature)
TOPK_DEFAULTS = {
    k: v.default
    for k, v in inspect.signature(codec.topk).parameters.items()
    if k in ("density", "ef_decay", "bits")
}


class Variant(NamedTuple):
    """One simulated configuration.

    Attributes:
        name: the variant's name in the JSON.
        scheme: "int8" or "topk".
        coded: deltas reach the shard coded (False: decoded to float32 first).
        lr: the sparse outer lr (topk kept coded).
        density: topk share of entries (None for int8).
        ef_decay: topk error-feedback decay (None for int8).
    """

    name: str
    scheme: str
    coded: bool
    lr: float
    density: float | None = None
    ef_decay: float | None = None


def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{flag} takes a comma list of numbers, got {text!r}") from None


def _variants(args) -> list[Variant]:
    """Every variant: int8 first, then top-k per density, decay and lr."""
    densities = _floats(args.densities, "--densities") or [args.density]
    decays = _floats(args.ef_decays, "--ef-decays") or [TOPK_DEFAULTS["ef_decay"]]
    lrs = _floats(args.lrs, "--lrs")
    swept = (densities, decays) != ([TOPK_DEFAULTS["density"]], [TOPK_DEFAULTS["ef_decay"]])
    out = [Variant("int8", "int8", True, 1.0)]
    for density in densities:
        for decay in decays:
            codec.topk(density=density, ef_decay=decay, bits=args.bits)  # fails early on a bad one
            tail = f"-d{density:g}-ef{decay:g}" if swept else ""
            if args.mean_nesterov:
                out.append(Variant(f"topk-mean-nesterov{tail}", "topk", False, 1.0, density, decay))
            out += [
                Variant(f"topk-sgd-{lr:g}{tail}", "topk", True, lr, density, decay) for lr in lrs
            ]
    return out


def _eval_rounds(args) -> list[int]:
    """Rounds after which the global parameters are evaluated (always the last)."""
    try:
        listed = {int(v) for v in args.eval_rounds.split(",") if v.strip()}
    except ValueError:
        raise SystemExit(
            f"--eval-rounds takes a comma list of ints, got {args.eval_rounds!r}"
        ) from None
    return sorted({r for r in listed if 1 <= r < args.rounds} | {args.rounds})


def simulate(args, variant: Variant, seed: int, corpus: bytes, inner: InnerSteps) -> dict:
    """One synchronous run.

    Returns:
        {"heldout_loss": after the last round, "delta_bytes": sent over the run,
        "by_round": {round: held-out loss} at every `_eval_rounds` round}.
    """
    scheme, coded, lr = variant.scheme, variant.coded, variant.lr
    icfg = InnerConfig()
    cfg = ShardConfig(mode="sync", sparse_outer_lr=lr, fsync=False, dedup_window=1 << 20)
    if scheme == "topk":
        make = codec.topk(density=variant.density, ef_decay=variant.ef_decay, bits=args.bits)
    else:
        make = codec.int8()
    evals = set(_eval_rounds(args))
    batches = None
    by_round = {}
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
        if r + 1 in evals:
            if batches is None:
                batches = data.eval_batches(heldout, icfg.batch_size, icfg.seq_len, 8)
            now_params = jax.tree.map(jnp.asarray, codec.unflatten(start))
            by_round[r + 1] = float(np.mean([float(inner.loss(now_params, b)) for b in batches]))
    return {"heldout_loss": by_round[args.rounds], "delta_bytes": sent, "by_round": by_round}


def add_ratios_to_int8(runs: list[dict]) -> None:
    """Add each run's held-out loss over int8's (the first run), overall and round by round.

    A ratio below 1 means the variant's loss is lower than int8's (better). Per round
    it is given for the seeds' means (`loss_over_int8`) and seed by seed
    (`loss_over_int8_per_seed`: same data order and init, so its spread is the ratio's).

    Args:
        runs: the sweep's runs, int8 first; each has `heldout_loss_mean` and `by_round`
            (round -> `heldout_loss_mean`, `heldout_loss_per_seed`). Changed in place.
    """
    int8 = runs[0]
    for entry in runs:
        entry["loss_over_int8"] = entry["heldout_loss_mean"] / int8["heldout_loss_mean"]
        for r, cell in entry["by_round"].items():
            base = int8["by_round"][r]
            cell["loss_over_int8"] = cell["heldout_loss_mean"] / base["heldout_loss_mean"]
            cell["loss_over_int8_per_seed"] = [
                a / b
                for a, b in zip(
                    cell["heldout_loss_per_seed"], base["heldout_loss_per_seed"], strict=True
                )
            ]


def run(args: argparse.Namespace) -> int:
    """Run the sweep and print JSON.

    Args:
        args: parsed flags.

    Returns:
        exit status 0.
    """
    variants = _variants(args)
    evals = _eval_rounds(args)
    corpus = data.default_corpus()
    inner = InnerSteps(model.MODEL_CONFIGS[args.model], InnerConfig())
    result: dict = {"command": " ".join(sys.argv), "settings": vars(replace_args(args)), "runs": []}
    with progress() as p:
        task = p.add_task("topk outer sweep", total=len(variants) * args.seeds)
        for variant in variants:
            losses, started = [], time.perf_counter()
            per_round = {r: [] for r in evals}
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                one = simulate(args, variant, seed, corpus, inner)
                losses.append(one["heldout_loss"])
                for r in evals:
                    per_round[r].append(one["by_round"][r])
                p.console.print(
                    f"{variant.name} seed {seed}: held-out loss by round {one['by_round']}"
                )
                p.advance(task)
            result["runs"].append(
                {
                    "variant": variant.name,
                    "sparse_outer_lr": variant.lr
                    if variant.coded and variant.scheme == "topk"
                    else None,
                    "density": variant.density,
                    "ef_decay": variant.ef_decay,
                    "heldout_loss_per_seed": losses,
                    "heldout_loss_mean": float(np.mean(losses)),
                    "delta_bytes": one["delta_bytes"],
                    "seconds": time.perf_counter() - started,
                    "by_round": {
                        str(r): {"heldout_loss_per_seed": v, "heldout_loss_mean": float(np.mean(v))}
                        for r, v in per_round.items()
                    },
                }
            )
    add_ratios_to_int8(result["runs"])
    sparse = [r for r in result["runs"] if r["sparse_outer_lr"] is not None]
    best = min(sparse, key=lambda r: r["heldout_loss_mean"])
    result["best"] = {
        k: best[k] for k in ("variant", "sparse_outer_lr", "density", "ef_decay", "loss_over_int8")
    }
    emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(cli.main(["topk_outer", *sys.argv[1:]]))
