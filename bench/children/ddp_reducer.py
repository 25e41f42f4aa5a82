"""The reducer of the DDP baseline: averages every rank's fp32 gradient, step by step.

A ZeroMQ ROUTER. Each rank (`bench.children.ddp_rank`) sends ``[header {step, rank}, gradient]``;
once all `world` ranks sent step s, every rank gets ``[header {step}, mean]``.
Ranks run in lockstep, so at most one step is open at a time; a message for
another step than the open one is a protocol error and stops the reducer.

    python -m bench.children.ddp_reducer --bind tcp://127.0.0.1:PORT --world N

Prints ``ready`` on stdout once bound; runs until SIGTERM / SIGINT.
"""

from __future__ import annotations

import argparse
import sys
import threading

import msgpack
import numpy as np
import zmq

from bench.child import say_ready, stop_on_signals

POLL_MS = 200


class ReduceError(RuntimeError):
    """A rank sent a message that does not fit the lockstep protocol."""


class StepMean:
    """The running sum of one step's gradients (pure bookkeeping, no sockets)."""

    def __init__(self, world: int) -> None:
        """Args:
        world: number of ranks to wait for.
        """
        self.world = world
        self.step: int | None = None
        self.sum_P: np.ndarray | None = None
        self.ranks: dict[int, bytes] = {}

    def add(self, step: int, rank: int, ident: bytes, grad_P: np.ndarray) -> bool:
        """Add one rank's gradient.

        Args:
            step: the rank's step.
            rank: the rank.
            ident: its ROUTER identity (to answer it).
            grad_P: its 1-D float32 gradient.

        Returns:
            True once every rank of the step has arrived.
        """
        if self.step is None:
            self.step, self.sum_P, self.ranks = step, grad_P.astype(np.float32, copy=True), {}
        elif step != self.step or rank in self.ranks or grad_P.shape != self.sum_P.shape:
            raise ReduceError(
                f"rank {rank} sent step {step} ({grad_P.size} values) while step {self.step} "
                f"({self.sum_P.size} values) waits for ranks {sorted(self.ranks)}"
            )
        else:
            self.sum_P += grad_P
        self.ranks[rank] = ident
        return len(self.ranks) == self.world

    def take(self) -> tuple[int, np.ndarray, list[bytes]]:
        """The finished step: (step, mean gradient, identities); resets for the next step."""
        step, mean_P, idents = self.step, self.sum_P / self.world, list(self.ranks.values())
        self.step, self.sum_P, self.ranks = None, None, {}
        return step, mean_P.astype(np.float32), idents


def serve(bind: str, world: int, stop: threading.Event) -> int:
    """Average gradients until `stop` is set.

    Args:
        bind: ROUTER endpoint to bind.
        world: number of ranks.
        stop: set by the signal handler.

    Returns:
        0 on a clean stop.
    """
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(bind)
    say_ready()
    pending = StepMean(world)
    try:
        while not stop.is_set():
            if not sock.poll(POLL_MS):
                continue
            ident, header, payload = sock.recv_multipart(copy=False)
            head = msgpack.unpackb(header.bytes)
            grad_P = np.frombuffer(payload.buffer, dtype=np.float32)
            if pending.add(int(head["step"]), int(head["rank"]), ident.bytes, grad_P):
                step, mean_P, idents = pending.take()
                reply = msgpack.packb({"step": step})
                for who in idents:
                    sock.send_multipart([who, reply, mean_P], copy=False)
    finally:
        sock.close(0)
        ctx.term()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for bad arguments, 1 for a protocol error)."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.children.ddp_reducer", description=__doc__
    )
    parser.add_argument("--bind", required=True, help="ROUTER endpoint, tcp://HOST:PORT")
    parser.add_argument("--world", type=int, required=True, help="number of ranks")
    args = parser.parse_args(argv)
    if args.world < 1:
        print(f"ddp_reducer: --world must be >= 1, got {args.world}", file=sys.stderr)
        return 2
    stop = stop_on_signals()
    try:
        return serve(args.bind, args.world, stop)
    except ReduceError as exc:
        print(f"ddp_reducer: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
