"""The synchronous data-parallel (DDP) baseline: one rank that all-reduces full fp32 gradients every step.

What a user would run instead of DiLoCo. Each step a rank computes loss and
gradients on its own batch, sends the whole fp32 gradient (one flat vector) to
a reducer over ZeroMQ (`bench.children.ddp_reducer`), waits for the mean of every rank's
gradient and applies the same AdamW update as an island's inner optimizer
(`worker.train.make_inner_optimizer` of the island's `InnerConfig`, on the
gradient of `worker.model.loss_fn`). All ranks start from the same seeded
parameters and apply the same updates, so they stay identical. Rank 0
evaluates with `worker.train.InnerTrainer.evaluate`, the held-out loss
`diloco-worker eval` computes for the islands' global model. (The step itself
cannot be an `InnerTrainer.step`: DDP applies the mean of every rank's
gradient, not its own.)

    python -m bench.children.ddp_rank --connect tcp://HOST:PORT --rank R --world N --island NAME
                         --data-dir D [--inner-steps 50 --max-rounds 10 ...]

Every `diloco-worker` setting is accepted and means the same thing (model, data
shard, batch, lr, speed, ...), as a flag or in the environment (`DILOCO_WORKER_*`,
e.g. a shared `DILOCO_WORKER_COMPILE_CACHE_DIR`); a "round" is `inner_steps` synchronous steps, and
each round appends one row to the data dir's metrics file (`worker.island_files`) in the islands'
schema (loss, tokens, bytes_sent / bytes_received counted at this rank's socket,
eval_global on rank 0). The rank stops after `max_rounds` rounds or on SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from bench.child import stop_on_signals
from paramserver.plumbing import daemon, settings
from worker import island_files
from worker.cli import ENV_PREFIX
from worker.config import IslandConfig

logger = logging.getLogger(__name__)

POLL_MS = 200


class DdpError(RuntimeError):
    """The reducer answered something unexpected, or did not answer in time."""


def make_grad_step(model_cfg):
    """A jitted ``(params, tokens_BxT1) -> (loss, flat fp32 gradient)``.

    Args:
        model_cfg: `worker.model.ModelConfig`.

    Returns:
        The jitted function; the gradient is raveled into one 1-D float32 vector.
    """
    import jax
    from jax.flatten_util import ravel_pytree

    from worker import model

    def grad_step(params, tokens_BxT1):
        loss, grads = jax.value_and_grad(model.loss_fn)(params, tokens_BxT1, model_cfg)
        flat_P, _ = ravel_pytree(grads)
        return loss, flat_P

    return jax.jit(grad_step)


def make_apply_step(tx, params):
    """A jitted ``(params, opt_state, flat_grad) -> (params, opt_state)`` applying `tx`.

    Args:
        tx: optax transformation (the inner AdamW).
        params: a parameter tree of the right structure (to unravel the flat gradient).

    Returns:
        The jitted function (params and state buffers are donated).
    """
    import jax
    import optax
    from jax.flatten_util import ravel_pytree

    _, unravel = ravel_pytree(params)

    def apply_step(params, opt_state, flat_P):
        updates, opt_state = tx.update(unravel(flat_P), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(apply_step, donate_argnums=(0, 1))


def warmup(grad_step, apply_step, params, opt_state, batch_size: int, seq_len: int):
    """Compile the grad and apply steps before anything is timed; no state changes.

    Runs grad + apply twice on device copies of `params` / `opt_state` (apply donates
    them; the second round takes the first round's outputs, the signature of every
    later step) with a zero batch and a zero gradient.

    Args:
        grad_step: from `make_grad_step`.
        apply_step: from `make_apply_step`.
        params: the rank's parameter tree (not consumed).
        opt_state: its optimizer state (not consumed).
        batch_size: B of every batch.
        seq_len: T (batches hold T + 1 tokens per row).

    Returns:
        Seconds the warm-up took.
    """
    import jax

    t0 = time.monotonic()
    zeros_BxT1 = np.zeros((batch_size, seq_len + 1), np.int32)
    p, s = jax.tree_util.tree_map(lambda x: x.copy(), (params, opt_state))
    for _ in range(2):
        _loss, grad_P = grad_step(p, zeros_BxT1)
        p, s = apply_step(p, s, np.zeros_like(np.asarray(grad_P)))
    jax.block_until_ready((p, s))
    return time.monotonic() - t0


class ReducerLink:
    """This rank's DEALER to the reducer, counting the bytes of every frame it moves."""

    def __init__(self, connect: str, rank: int) -> None:
        """Connect (lazily, as ZeroMQ does).

        Args:
            connect: the reducer's ROUTER endpoint.
            rank: this rank's index.
        """
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(connect)
        self.rank = rank
        self.bytes_sent = 0
        self.bytes_received = 0

    def allreduce(self, step: int, grad_P: np.ndarray, stop: threading.Event) -> np.ndarray | None:
        """Send this rank's gradient for `step` and wait for the mean over all ranks.

        Args:
            step: global step index (the reducer matches ranks on it).
            grad_P: 1-D float32 gradient.
            stop: returns None early once set.

        Returns:
            The mean gradient (1-D float32), or None when stopped.
        """
        header = msgpack.packb({"step": step, "rank": self.rank})
        payload = np.ascontiguousarray(grad_P, dtype=np.float32)
        self.sock.send_multipart([header, payload], copy=False)
        self.bytes_sent += len(header) + payload.nbytes
        while not stop.is_set():
            if not self.sock.poll(POLL_MS):
                continue
            frames = self.sock.recv_multipart(copy=False)
            self.bytes_received += sum(len(f.buffer) for f in frames)
            reply = msgpack.unpackb(frames[0].bytes)
            if reply.get("step") != step or len(frames) != 2:
                raise DdpError(f"reducer answered step {reply.get('step')} to step {step}")
            return np.frombuffer(frames[1].buffer, dtype=np.float32)
        return None

    def close(self) -> None:
        """Close the socket and context."""
        self.sock.close(0)
        self.ctx.term()


def run_rank(cfg: IslandConfig, rank: int, world: int, stop: threading.Event) -> int:
    """Train synchronously with the other ranks until `max_rounds` rounds or `stop`.

    Args:
        cfg: island settings (connect = the reducer's endpoint).
        rank: this rank's index in [0, world).
        world: number of ranks.
        stop: set by SIGTERM.

    Returns:
        0 after a clean stop.
    """

    from worker import compile_cache
    from worker import data as data_lib
    from worker import model as model_lib
    from worker.pace import Pacer
    from worker.train import InnerConfig, InnerTrainer, make_inner_optimizer

    data_dir = Path(cfg.data_dir)
    compile_cache.enable(cfg.compile_cache_dir, data_dir)  # before the first jit, as an island
    model_cfg = model_lib.model_config(cfg.model, cfg.vocab_size)
    own = data_lib.island_data(cfg)  # the same stream an island of this name trains on
    sampler, eval_set, seed = own.sampler, own.eval_set, own.seed
    inner = InnerConfig(
        lr=cfg.lr, warmup_steps=cfg.warmup_steps, batch_size=cfg.batch_size, seq_len=cfg.seq_len
    )
    tx = make_inner_optimizer(inner)
    params = model_lib.init_params(model_cfg, cfg.seed)
    param_count = model_lib.count_params(params)
    opt_state = tx.init(params)
    grad_step = make_grad_step(model_cfg)
    apply_step = make_apply_step(tx, params)
    # rank 0's evaluator: the islands' eval step, on the parameters it is given
    evaluator = InnerTrainer(model_cfg, inner, params, devices=1) if rank == 0 else None
    compile_s = warmup(grad_step, apply_step, params, opt_state, cfg.batch_size, cfg.seq_len)
    logger.info("ddp rank %d: warm-up (compile) took %.2f s", rank, compile_s)
    pacer = Pacer(cfg.speed, cfg.jitter, seed)
    link = ReducerLink(cfg.connect, rank)
    started = time.monotonic()
    busy_s = 0.0
    steps = 0
    step_times: list[float] = []  # wall seconds of every step after the first
    evaluated: dict[int, float] = {}  # steps -> eval loss of the parameters after them

    def evaluate() -> float:
        if steps not in evaluated:
            evaluated[steps] = evaluator.evaluate(eval_set, params=params)
        return evaluated[steps]

    def append(row: dict[str, Any]) -> None:
        wall_s = time.monotonic() - started
        row = {
            "island": cfg.island,
            "speed": cfg.speed,
            "params": param_count,
            "time_s": round(wall_s, 3),
            "wall": time.time(),
            "steps": steps,
            "tokens": steps * cfg.batch_size * cfg.seq_len,
            "bytes_sent": link.bytes_sent,
            "bytes_received": link.bytes_received,
            "goodput": min(1.0, busy_s / wall_s) if wall_s > 0 else 0.0,
            "step_s": float(np.median(step_times)) if step_times else None,
            **row,
        }
        island_files.append_row(data_dir, row)

    try:
        if rank == 0 and cfg.eval_every:
            append({"round": 0, "eval_global": evaluate()})
        started = time.monotonic()
        round_index = 0
        while not stop.is_set() and (cfg.max_rounds == 0 or round_index < cfg.max_rounds):
            losses = []
            for _ in range(cfg.inner_steps):
                t0 = time.monotonic()
                loss, grad_P = grad_step(params, sampler.next())
                grad_np = np.asarray(grad_P)
                pacer.pad(time.monotonic() - t0)
                busy_s += time.monotonic() - t0
                mean_P = link.allreduce(steps, grad_np, stop)
                if mean_P is None:
                    break
                t1 = time.monotonic()
                params, opt_state = apply_step(params, opt_state, mean_P)
                busy_s += time.monotonic() - t1
                losses.append(float(loss))
                steps += 1
                if steps > 1:
                    step_times.append(time.monotonic() - t0)
            if not losses:
                break
            round_index += 1
            row: dict[str, Any] = {"round": round_index, "loss": float(np.mean(losses))}
            if rank == 0 and cfg.eval_every and round_index % cfg.eval_every == 0:
                row["eval_global"] = evaluate()
            append(row)
            logger.info("ddp rank %d round %d loss %.3f", rank, round_index, row["loss"])
        final: dict[str, Any] = {"round": round_index, "final": True}
        if rank == 0:
            # The run's final eval loss: the final parameters, once, on the common held-out
            # set (the definition the islands' `diloco-worker eval` uses), last point of the curve.
            final["eval_global"] = evaluate()
        append(final)
    finally:
        link.close()
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.children.ddp_rank", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rank", type=int, required=True, help="this rank's index")
    parser.add_argument("--world", type=int, required=True, help="number of ranks")
    settings.add_flags(parser, IslandConfig)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for bad settings, 1 for a reducer failure)."""
    args = _parser().parse_args(argv)
    try:
        cfg = settings.load_settings(IslandConfig, env_prefix=ENV_PREFIX, flags=args)
        if not 0 <= args.rank < args.world:
            raise ValueError(f"--rank must be in [0, --world), got {args.rank} of {args.world}")
    except (settings.SettingsError, ValueError) as exc:
        print(f"bench.children.ddp_rank: {exc}", file=sys.stderr)
        return 2
    Path(cfg.data_dir).mkdir(parents=True, exist_ok=True)
    daemon.setup_logging(cfg.log_level, Path(cfg.data_dir) / "ddp.log")
    if cfg.cpu >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cfg.cpu % os.cpu_count()})
    stop = stop_on_signals()
    try:
        return run_rank(cfg, args.rank, args.world, stop)
    except DdpError as exc:
        print(f"bench.children.ddp_rank: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
