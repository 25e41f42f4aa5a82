"""Every process of a multi-process island holds process 0's parameters, step for step.

Process 0 runs the island (`worker.island.Island`): it alone joins, pushes and
adopts. Each of its trainer calls that the other processes must take part in
(a train step, the compile warm-up, an evaluation, new parameters, a gather of
the parameters for a delta) is first announced to them with a small header
broadcast over JAX collectives (`broadcast_one_to_all`), followed by whatever
the call needs that only process 0 knows (the parameters it adopted, the
evaluation batches). The other processes run `follow`: they wait for the next
header and make the same call on their own trainer, so every process runs the
same jitted programs in the same order. Training batches are not sent: every
process draws the same global batch from its own copy of the island's data and
places only the rows of its own devices.

A single-process island uses `Group` too; every method is then a plain call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from worker.multihost import GroupSpec, Watchdog, mesh_info

logger = logging.getLogger(__name__)

OP_STOP, OP_JOINED, OP_STEP, OP_WARMUP, OP_EVAL, OP_SET, OP_GATHER = range(7)
_HEADER_WORDS = 6


class GroupBroken(RuntimeError):
    """A collective of the island's processes failed (another process is gone)."""


def _broadcast(tree: Any, source: bool) -> Any:
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree, is_source=source)


def header(op: int, *args: int) -> np.ndarray:
    """The fixed-size int32 header announcing one operation.

    Args:
        op: one of the OP_* codes.
        args: up to five small integers (sizes, flags, an exit code).

    Returns:
        An int32 array of _HEADER_WORDS words.
    """
    if len(args) >= _HEADER_WORDS:
        raise ValueError(f"at most {_HEADER_WORDS - 1} header arguments, got {len(args)}")
    words = np.zeros(_HEADER_WORDS, np.int32)
    words[0] = op
    words[1 : 1 + len(args)] = args
    return words


class Group:
    """Process 0's side of the island's process group (trivial for one process)."""

    def __init__(self, spec: GroupSpec, island: str, liveness_s: float, interval_s: float):
        """Args:
        spec: the group; process 0 (or the only process).
        island: the island id.
        liveness_s: silence after which another process is gone.
        interval_s: heartbeat period of the watchdog.
        """
        self.spec, self.island = spec, island
        self.liveness_s, self.interval_s = liveness_s, interval_s
        self.broken = False
        self.watchdog: Watchdog | None = None

    def watch(self, on_gone: Callable[[str], None]) -> None:
        """Start the liveness watchdog (multi-process only).

        Args:
            on_gone: called with the line when another process is gone, before exit.
        """
        if self.spec.multi and self.watchdog is None:
            self.watchdog = Watchdog(
                self.island, self.spec, self.liveness_s, self.interval_s, on_gone
            )
            self.watchdog.start()

    def collective(self, fn: Callable[[], Any]) -> Any:
        """Run one collective; a failure waits for the watchdog to name the missing process.

        Args:
            fn: the collective call.

        Returns:
            What `fn` returns.

        Raises:
            GroupBroken: the collective failed and the watchdog did not end the process
                within twice the liveness timeout.
        """
        try:
            return fn()
        except Exception as exc:
            if not self.spec.multi or type(exc).__name__ != "JaxRuntimeError":
                raise
            self.broken = True
            logger.warning("island %s: a collective failed: %s", self.island, exc)
            deadline = time.monotonic() + 2 * self.liveness_s + self.interval_s
            while time.monotonic() < deadline:  # the watchdog exits the process meanwhile
                threading.Event().wait(self.interval_s)
            raise GroupBroken(
                f"island {self.island}: a collective of the island's processes failed: {exc}"
            ) from exc

    def tell(self, op: int, *args: int) -> None:
        """Announce an operation to the other processes (no-op for one process)."""
        if self.spec.multi:
            self.collective(lambda: _broadcast(header(op, *args), True))

    def share(self, tree: Any) -> None:
        """Send a tree of arrays to the other processes (after a `tell`)."""
        if self.spec.multi:
            self.collective(lambda: _broadcast(tree, True))

    def share_join(self, params: dict) -> None:
        """Tell the other processes that the island joined, with its first parameters."""
        self.tell(OP_JOINED)
        self.share(params)

    def wrap(self, trainer: Any) -> Any:
        """The trainer the island should drive: announcing each call when multi-process."""
        return LeaderTrainer(trainer, self) if self.spec.multi else trainer

    def finish(self, code: int) -> None:
        """Tell the other processes to exit with `code`, and stop heartbeating."""
        if self.spec.multi and not self.broken:
            with contextlib.suppress(GroupBroken):
                self.tell(OP_STOP, code)
        if self.watchdog is not None:
            self.watchdog.stop()


class LeaderTrainer:
    """Process 0's trainer: every call is announced to the other processes first."""

    def __init__(self, trainer: Any, group: Group) -> None:
        """Args:
        trainer: the process's own InnerTrainer.
        group: the island's group (multi-process).
        """
        self._trainer, self._group = trainer, group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)

    def step(self, tokens_BxT1: np.ndarray) -> float:
        """One train step on every process (each draws the same batch from its own data)."""
        self._group.tell(OP_STEP)
        return self._group.collective(lambda: self._trainer.step(tokens_BxT1))

    def warmup(self) -> float:
        """Compile on every process."""
        self._group.tell(OP_WARMUP)
        return self._group.collective(self._trainer.warmup)

    def evaluate(self, batches: Sequence[np.ndarray], params: dict | None = None) -> float:
        """Evaluate on every process; the batches (and parameters, if given) are sent."""
        stacked = np.stack([np.asarray(b, np.int32) for b in batches])
        self._group.tell(OP_EVAL, *stacked.shape, int(params is not None))
        self._group.share(stacked)
        if params is not None:
            self._group.share(params)
        return self._group.collective(lambda: self._trainer.evaluate(batches, params=params))

    def set_params(self, tree: dict) -> None:
        """New parameters on every process."""
        self._group.tell(OP_SET)
        self._group.share(tree)
        self._group.collective(lambda: self._trainer.set_params(tree))

    def numpy_params(self) -> dict:
        """The parameters gathered to the host (every process takes part)."""
        self._group.tell(OP_GATHER)
        return self._group.collective(self._trainer.numpy_params)


def receive_header() -> np.ndarray:
    """Wait for process 0's next header (other processes)."""
    return np.asarray(_broadcast(header(OP_STOP), False))


def receive(template: Any) -> Any:
    """Receive a tree shaped like `template` from process 0 (other processes)."""
    import jax

    zeros = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, x.dtype), template)
    return jax.tree_util.tree_map(np.asarray, _broadcast(zeros, False))


def follow(
    make_trainer: Callable[[dict], Any],
    template: dict,
    next_batch: Callable[[], np.ndarray],
    on_event: Callable[[str, Any], None] = lambda _what, _trainer: None,
) -> int:
    """The loop of a process other than 0: make every call process 0 announces.

    Args:
        make_trainer: builds this process's trainer from the first parameters.
        template: a parameter tree of the right shapes and dtypes (values unused).
        next_batch: the island's training batches (the same sequence as process 0's).
        on_event: called with ("joined" | "step" | "eval", trainer) for status.

    Returns:
        The exit code process 0 sent with its stop.
    """
    trainer = None
    while True:
        op, *args = (int(x) for x in receive_header())
        if op == OP_STOP:
            return args[0]
        if op == OP_JOINED:
            trainer = make_trainer(receive(template))
            on_event("joined", trainer)
        elif op == OP_STEP:
            trainer.step(next_batch())
            on_event("step", trainer)
        elif op == OP_WARMUP:
            trainer.warmup()
        elif op == OP_EVAL:
            n, batch, width, has_params = args[:4]
            stacked = receive(np.zeros((n, batch, width), np.int32))
            params = receive(template) if has_params else None
            trainer.evaluate(list(stacked), params=params)
            on_event("eval", trainer)
        elif op == OP_SET:
            trainer.set_params(receive(template))
        elif op == OP_GATHER:
            trainer.numpy_params()
        else:
            raise GroupBroken(f"unknown operation {op} from process 0")


def topology(spec: GroupSpec, trainer: Any) -> dict[str, Any]:
    """The island's processes and mesh, as its status file shows them.

    Args:
        spec: the group.
        trainer: the process's InnerTrainer.

    Returns:
        {"processes": {...}, "mesh": {...}} (see `worker.multihost.mesh_info`).
    """
    return mesh_info(spec, trainer.devices, trainer.inner_cfg.batch_size, trainer.param_sharding)


def run_follower(island: Any, stop: threading.Event) -> int:
    """Run a process other than 0 of a multi-process island until process 0 stops it.

    Args:
        island: a `worker.island.Island` of this process (its data, model, status file;
            it never opens a socket here).
        stop: set by SIGTERM: this process leaves at once, and the others stop
            within the liveness timeout (stop an island through process 0).

    Returns:
        The exit code process 0 sent.
    """
    from worker import model as model_lib
    from worker.train import InnerTrainer

    cfg, spec = island.cfg, island.group.spec
    watchdog = Watchdog(cfg.island, spec, island.liveness_s, cfg.heartbeat_interval_s)
    watchdog.start()

    def leave_on_stop() -> None:
        stop.wait()
        logger.warning("island %s: process %d stopped (SIGTERM)", cfg.island, spec.process_id)
        logging.shutdown()
        os._exit(0)

    threading.Thread(target=leave_on_stop, name="follower-stop", daemon=True).start()
    template = model_lib.init_params(island.model_cfg, cfg.seed)
    island.state = "following"
    island._write_status()

    def make_trainer(params: dict) -> Any:
        trainer = InnerTrainer(
            island.model_cfg,
            island.inner_cfg,
            params,
            devices=cfg.devices or None,
            param_sharding=cfg.param_sharding,
        )
        island.topology = topology(spec, trainer)
        return trainer

    written = [0.0]

    def on_event(what: str, trainer: Any) -> None:
        now = time.monotonic()
        if what == "step" and now - written[0] < 2.0:
            return
        written[0] = now
        island.last.update(steps=trainer.steps_done, tokens=trainer.tokens_done)
        island._write_status()

    code = follow(make_trainer, template, island.sampler.next, on_event)
    watchdog.stop()
    island.state = "stopped"
    island._write_status()
    logger.info(
        "island %s: process %d stopped by process 0 (%d)", cfg.island, spec.process_id, code
    )
    return code
