"""What the public island API costs: `Session.step` per call between pushes and per round.

Two loops train, each against a fresh local 2-shard cluster (real daemons, 127.0.0.1):

- a user's plain-JAX MLP (its own optax step, not our model), and
- the daemon's loop: our transformer's `InnerTrainer` (`--model`) driving the
  same `Session` the daemon drives, joined as the daemon joins (with the
  trainer's placed parameters: the device exchange; each loop's `exchange`
  names the one that ran).

For each it times the model's own inner step (the baseline, measured in the
same run), the `Session.step` calls that neither push nor fold (the per-call
overhead, target < 1% of the step), the same calls back to back without a
train step between them (`call_alone_*`: the API's own cost; on a CPU-only
machine the calls right after a step share the cores with XLA's still
spinning threads) and the calls that end a round (the exchange: with
`--overlap-rounds 0` the delta, quantize, codes to the host, outbox and push
inside the call; by default only taking the delta, the rest runs beside the
next inner steps). Prints one JSON object: medians in microseconds and the
overheads as ratios of the step time.

With `--stages` every round-end call is also split into its pieces: the
session's methods that `Session.step` calls (`_take`, `_push`, `_fold`,
`_round_row`, ...) and the client's reports are wrapped on the instance for the
run with `time.perf_counter` stamps, and `round_end_stages_us` gives each
piece's median over the timed round ends (`unaccounted`: the call's time
outside them). `--models` runs the daemon's loop for each named model (the MLP
once).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench import outdir
from bench.launcher import LocalCluster


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench session_overhead`."""
    parser.add_argument("--rounds", type=int, default=4, help="rounds per loop (default 4)")
    parser.add_argument("--inner-steps", type=int, default=50, help="steps per round (50)")
    parser.add_argument(
        "--hidden", type=int, default=1024, help="hidden width of the timed MLP (default 1024)"
    )
    parser.add_argument(
        "--batch", type=int, default=256, help="examples per batch of the timed MLP (default 256)"
    )
    parser.add_argument("--model", default="tiny", help="the daemon's model (default tiny)")
    parser.add_argument(
        "--models",
        default=None,
        help="comma-separated models for the daemon's loop, each in its own run (overrides --model)",
    )
    parser.add_argument(
        "--stages",
        action="store_true",
        help="split each round-end call into the session's pieces (round_end_stages_us)",
    )
    parser.add_argument(
        "--overlap-rounds",
        type=int,
        default=1,
        help="rounds whose exchange runs beside training (default 1; 0 = inside the step)",
    )
    parser.add_argument(
        "--out",
        default="runs/session-overhead",
        help="output directory (default runs/session-overhead): new, empty or a bench's",
    )


def _mlp(hidden: int, batch: int):
    """A user's MLP: params, a jitted optax step and a batch maker."""
    import jax
    import jax.numpy as jnp
    import optax

    key = jax.random.PRNGKey(0)
    k1, k2 = jax.random.split(key)
    params = {
        "w1": jax.random.normal(k1, (256, hidden)) / 16.0,
        "w2": jax.random.normal(k2, (hidden, 256)) / np.sqrt(hidden),
    }
    tx = optax.adam(1e-3)

    @jax.jit
    def step(params, opt_state, x):
        def loss(p):
            return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - x) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    rng = np.random.default_rng(0)
    return params, tx, step, lambda: rng.normal(size=(batch, 256)).astype(np.float32)


def _summary(step_s: list[float], call_s: list[float], push_s: list[float]) -> dict[str, Any]:
    step, call, push = (float(np.median(v)) for v in (step_s, call_s, push_s))
    return {
        "step_us": round(step * 1e6, 1),
        "call_us": round(call * 1e6, 1),
        "round_call_us": round(push * 1e6, 1),
        "call_over_step": round(call / step, 5),
        "round_over_step": round(push / step, 5),
        "calls_timed": len(call_s),
        "rounds_timed": len(push_s),
    }


# what `Session.step` calls at a round's end (worker/session.py), timed by --stages
SESSION_STAGES = ("_check_pusher", "_unblocked", "_wait_for_room", "_take", "_push",
                  "_wait_for_merge", "_fold", "_round_row", "_report_training")  # fmt: skip
CLIENT_STAGES = ("report_step_time", "poll_updates", "report_training", "stats")


@contextlib.contextmanager
def _stage_stamps(session, spent: dict[str, float]) -> Iterator[None]:
    """Wrap the session's (and its client's) round-end pieces on the instances for the block.

    Each call adds its seconds to `spent[name]` (nested pieces count in both).
    """
    targets = [(session, n, n) for n in SESSION_STAGES]
    targets.append((session.exchange, "end_step", "exchange.end_step"))
    if session.client is not None:
        targets += [(session.client, n, f"client.{n}") for n in CLIENT_STAGES]
    wrapped = []
    for obj, name, label in targets:
        original = getattr(obj, name, None)
        if original is None:
            continue

        def timed(*a, _original=original, _label=label, **kw):
            t0 = time.perf_counter()
            try:
                return _original(*a, **kw)
            finally:
                spent[_label] = spent.get(_label, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)
        wrapped.append((obj, name))
    try:
        yield
    finally:
        for obj, name in wrapped:
            with contextlib.suppress(AttributeError):
                delattr(obj, name)  # the class's method again


def _stage_medians(rows: list[dict[str, float]], calls: list[float]) -> dict[str, float]:
    """Median microseconds of each piece over the round-end calls, and what they leave out."""
    names = sorted({n for r in rows for n in r})
    out = {n: round(float(np.median([r.get(n, 0.0) for r in rows]) * 1e6), 1) for n in names}
    nested = ("_check_pusher",)  # also called inside _wait_for_room
    top = [n for n in names if (n.startswith("_") and n not in nested) or n == "exchange.end_step"]
    left = [c - sum(r.get(n, 0.0) for n in top) for r, c in zip(rows, calls, strict=True)]
    out["unaccounted"] = round(float(np.median(left)) * 1e6, 1)
    return out


def _timed_loop(session, steps: int, train, read, adopt, stages: bool = False) -> dict[str, Any]:
    """Run `steps` inner steps; time each train step and each `Session.step` call."""
    import jax

    step_s, call_s, push_s, stage_rows = [], [], [], []
    spent: dict[str, float] = {}
    with _stage_stamps(session, spent) if stages else contextlib.nullcontext():
        for k in range(1, steps + 1):
            t0 = time.perf_counter()
            train()
            jax.block_until_ready(read())
            spent.clear()
            t1 = time.perf_counter()
            out = session.step(read(), tokens=1)
            t2 = time.perf_counter()
            adopt(out)
            step_s.append(t1 - t0)
            (push_s if k % session.inner_steps == 0 else call_s).append(t2 - t1)
            if k % session.inner_steps == 0:
                stage_rows.append(dict(spent))
    summary = _summary(step_s[5:], call_s[5:], push_s[1:] or push_s)
    summary["exchange"] = type(session.exchange).__name__  # DeviceExchange or HostExchange
    if stages:
        kept = slice(1, None) if len(push_s) > 1 else slice(None)
        summary["round_end_stages_us"] = _stage_medians(stage_rows[kept], push_s[kept])
    summary.update(_calls_alone(session, read, adopt, steps, float(np.median(step_s[5:]))))
    # a round-end call copies the parameters to the host, encodes and pushes them
    summary["round_end_costs_more"] = summary["round_call_us"] > summary["call_alone_us"]
    return summary


def _calls_alone(session, read, adopt, calls: int, step_s: float) -> dict[str, Any]:
    """`Session.step` calls back to back, no train step between them (the API's own cost).

    On a CPU-only machine the calls timed right after a train step share the
    cores with XLA's threads, which keep spinning for a while after the step;
    these calls show what the API itself costs. Round-end calls are left out.
    """
    alone_s = []
    for _ in range(calls):
        round_end = session.inner_steps - 1 == (session.steps % session.inner_steps)
        t0 = time.perf_counter()
        out = session.step(read(), tokens=1)
        t1 = time.perf_counter()
        adopt(out)
        if not round_end:
            alone_s.append(t1 - t0)
    alone = float(np.median(alone_s))
    return {
        "call_alone_us": round(alone * 1e6, 2),
        "call_alone_over_step": round(alone / step_s, 6),
        "calls_alone_timed": len(alone_s),
    }


def _measure_mlp(connect: str, args: argparse.Namespace) -> dict[str, Any]:
    import worker

    params, tx, step, batch = _mlp(args.hidden, args.batch)
    with worker.join(
        connect, island="mlp", params=params, inner_steps=args.inner_steps,
        overlap_rounds=args.overlap_rounds,
    ) as s:  # fmt: skip
        state = {"params": s.params}
        state["opt"] = tx.init(state["params"])

        def train() -> None:
            state["params"], state["opt"], _ = step(state["params"], state["opt"], batch())

        def adopt(out) -> None:
            state["params"] = out

        read = lambda: state["params"]  # noqa: E731
        return _timed_loop(s, args.rounds * args.inner_steps, train, read, adopt, args.stages)


def _measure_daemon_loop(connect: str, args: argparse.Namespace, name: str) -> dict[str, Any]:
    import jax

    from worker import data, model
    from worker.session import Session
    from worker.session_config import session_config
    from worker.train import InnerConfig, InnerTrainer

    model_cfg = model.model_config(name)
    inner = InnerConfig(batch_size=16, seq_len=128)
    sampler = data.BatchSampler(data.default_corpus(), 16, 128, seed=0)
    cfg = session_config(
        connect, "daemon", args.inner_steps, None, {"overlap_rounds": args.overlap_rounds}
    )
    # as the daemon joins (`worker.island`): with the trainer's placed parameters, so the
    # session runs the device exchange on the trainer's mesh (numpy parameters would take
    # the host exchange: a host copy and numpy quantize inside the round-end call)
    trainer = InnerTrainer(model_cfg, inner, jax.device_get(model.init_params(model_cfg, 0)))
    with Session(cfg, trainer.params) as s:
        trainer.set_params(s.params)
        trainer.warmup()
        s.mark_start()  # the exchange's pushes and folds compile here, as the daemon's do

        def train() -> None:
            trainer.step(sampler.next())

        def adopt(out) -> None:
            if out is not trainer.params:
                trainer.set_params(out)

        read = lambda: trainer.params  # noqa: E731
        return _timed_loop(s, args.rounds * args.inner_steps, train, read, adopt, args.stages)


def run(args: argparse.Namespace) -> int:
    """Measure both loops and print the JSON.

    Args:
        args: the parsed flags.

    Returns:
        0, or 2 for an unknown model (one line on stderr).
    """
    from worker.config import MODEL_NAMES

    models = [m for m in (args.models or args.model).split(",") if m]
    if not models or any(m not in MODEL_NAMES for m in models):
        print(f"session_overhead: models {models} must be of {MODEL_NAMES}", file=sys.stderr)
        return 2
    out = outdir.claim(Path(args.out), "session_overhead")
    result: dict[str, Any] = {
        "inner_steps": args.inner_steps,
        "rounds": args.rounds,
        "overlap_rounds": args.overlap_rounds,
    }
    loops = {"mlp": _measure_mlp}
    for m in models:
        loops[f"daemon_loop_{m}"] = lambda c, a, m=m: _measure_daemon_loop(c, a, m)
    for name, measure in loops.items():  # a fresh cluster each: they train other models
        with LocalCluster(out / name, shards=2) as cluster:
            cluster.start_server()
            result[name] = measure(cluster.connect, args)
    (out / "session_overhead.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, sort_keys=True))
    return 0
