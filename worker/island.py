"""The island daemon's loop: our transformer and text data, trained through `worker.Session`.

`diloco-worker start` is a user of the public API (`worker.session`): it
builds the model's parameters, joins with them (`Session`), trains with its
`InnerTrainer` and calls `Session.step` after every inner step, as any user's
loop does; the session pushes, folds and waits (sync mode), keeps goodput and
writes ``metrics.jsonl``. What stays here is the daemon's own: the data and
model, the emulated speed (`--speed`, `--jitter`: `worker.pace`), the compile
warm-up before the start barrier (so compile time is neither padded nor
charged to round 1), the evaluations it adds to the metrics rows,
``status.json`` (rewritten atomically, `worker.island_files`), and in a
multi-process island the liveness watchdog (`worker.process_group`).

Every process of a multi-process island runs this same loop with its own
copy of the data (each draws the same global batch and places its own rows);
process 0 alone talks to the shards and the session shares its decisions
(`worker.leader_sync`), so every process stops after the same step.

Stopping: every wait ends when the stop event is set (SIGTERM); the session's
close then pushes the partial round and leaves what stays unacked in
``<data_dir>/outbox.bin`` (`worker.outbox`, where every delta is written
before it leaves) for the next start.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from paramserver.client import Client, ClientError
from worker import compile_cache, island_files
from worker import data as data_lib
from worker import model as model_lib
from worker.config import IslandConfig
from worker.pace import Pacer
from worker.process_group import GroupSpec, Watchdog, liveness_timeout_s, mesh_info
from worker.session import Session
from worker.train import InnerConfig, InnerTrainer

logger = logging.getLogger(__name__)


def inner_steps_for(cfg: IslandConfig) -> int:
    """Inner steps per round; with dynamic local updates a slow island runs fewer.

    Args:
        cfg: island settings.

    Returns:
        H, or max(1, round(H * speed)) when `dynamic_steps` is on and speed < 1.
    """
    if cfg.dynamic_steps and cfg.speed < 1:
        return max(1, round(cfg.inner_steps * cfg.speed))
    return cfg.inner_steps


class Island:
    """The daemon's training loop of one island (process) around a `Session`."""

    def __init__(
        self,
        cfg: IslandConfig,
        client_factory: Callable[..., Client] = Client,
        group: GroupSpec | None = None,
    ) -> None:
        """Load data and model; nothing touches the network until `run`.

        Args:
            cfg: island settings.
            client_factory: builds the client from a ClientConfig.
            group: this process's place in a multi-process island (already
                initialised); None = a one-process island.
        """
        self.cfg = cfg
        self.spec = group or GroupSpec()
        self.liveness_s = liveness_timeout_s(cfg.heartbeat_interval_s)
        self.topology: dict[str, Any] = {}
        self.data_dir = Path(cfg.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # before the first jit, so a restart reads the compiled steps back instead of compiling
        self.compile_cache = compile_cache.enable(cfg.compile_cache_dir, self.data_dir)
        self.model_cfg = model_lib.model_config(cfg.model, cfg.vocab_size)
        own = data_lib.island_data(cfg)  # its shard of the corpus, and the common held-out set
        self.sampler, self.eval_set, seed = own.sampler, own.eval_set, own.seed
        self.data_id = data_lib.heldout_identity(cfg)  # `diloco-worker eval` compares it
        self.inner_cfg = InnerConfig(
            lr=cfg.lr,
            warmup_steps=cfg.warmup_steps,
            batch_size=cfg.batch_size,
            seq_len=cfg.seq_len,
        )
        self.pacer = Pacer(cfg.speed, cfg.jitter, seed)
        self.client_factory = client_factory
        self.state = "starting"
        self.last: dict[str, Any] = {}
        self.session: Session | None = None
        self.losses: list[float] = []

    # -- the loop -------------------------------------------------------------

    def _join(self, stop: threading.Event) -> Session:
        self.state = "joining" if self.spec.leader else "following"
        self._write_status()
        init = jax.device_get(model_lib.init_params(self.model_cfg, self.cfg.seed))
        trainer = InnerTrainer(
            self.model_cfg,
            self.inner_cfg,
            init,
            devices=self.cfg.devices or None,
            param_sharding=self.cfg.param_sharding,
        )
        # exchange "device": join with the trainer's placed parameters, so the session keeps
        # its state on the trainer's mesh and hands out folds placed like them (the trainer
        # copies them on the devices); "host": host arrays, each fold placed once by the trainer
        session = Session(
            self.cfg,
            trainer.params if self.cfg.exchange == "device" else init,
            stop=stop,
            inner_steps=inner_steps_for(self.cfg),
            client_factory=self.client_factory,
            row_fields=self._row_fields,
            row_tags={"speed": self.cfg.speed},
        )
        self.session = session
        trainer.set_params(session.params)
        self.trainer = trainer
        self.topology = mesh_info(
            self.spec, self.trainer.devices, self.cfg.batch_size, self.cfg.param_sharding
        )
        self.state = "compiling"
        self._write_status()
        self.trainer.warmup()  # logs its compile time
        return session

    def run(self, stop: threading.Event, on_ready: Callable[[], None] | None = None) -> int:
        """Train until `stop` is set (process 0's, in a multi-process island) or `max_rounds`.

        Args:
            stop: set by the signal handler (SIGTERM) or the caller.
            on_ready: called once the island has joined and starts training.

        Returns:
            0 after a clean stop.
        """
        cfg = self.cfg
        watchdog = self._watch(stop)
        try:
            try:
                session = self._join(stop)
            except ClientError:
                if not stop.is_set():
                    raise
                logger.info("island %s stopped while joining", cfg.island)
                return 0
            try:
                self._train(session, stop, on_ready)
            except Exception as exc:
                if watchdog is not None and isinstance(exc, jax.errors.JaxRuntimeError):
                    session.leader_sync.broken = True  # no more collectives, not even at close
                    self._await_watchdog(watchdog, exc)
                raise
            finally:
                self.state = "stopping"
                self._write_status()
                session.close(self.trainer.params)
            self.state = "stopped"
            self._write_status(client_stats=session.stats if session.client is not None else None)
        finally:
            if watchdog is not None:
                watchdog.stop()
        return 0

    def _train(
        self, session: Session, stop: threading.Event, on_ready: Callable[[], None] | None
    ) -> None:
        cfg, trainer = self.cfg, self.trainer
        self.state = "training"
        session.mark_start()
        if cfg.eval_every:
            session.log_row({"round": 0, "steps": 0, "tokens": 0, **self._global_eval()})
        self._write_status()
        if on_ready is not None:
            on_ready()
        if cfg.start_file and self.spec.leader:
            self._wait_for_start(stop)
            session.mark_start()
        tokens = cfg.batch_size * cfg.seq_len
        while not session.stopping and (cfg.max_rounds == 0 or session.round < cfg.max_rounds):
            t0 = time.monotonic()
            self.losses.append(trainer.step(self.sampler.next()))
            self.pacer.pad(time.monotonic() - t0)
            params, done = trainer.params, session.round
            new = session.step(params, tokens=tokens)
            if new is not params:
                trainer.set_params(new)
            if session.round != done:
                self._round_done(session)

    def _round_done(self, session: Session) -> None:
        row = session.last_row
        logger.info(
            "round %d loss %.3f eval %s tokens/s %.0f lag %d sent %d B received %d B",
            row["round"],
            row["loss"],
            f"{row['eval_global']:.3f}" if "eval_global" in row else "-",
            self.cfg.batch_size
            * self.cfg.seq_len
            * session.inner_steps
            / max(row["round_s"], 1e-9),
            row["version_lag"],
            row["bytes_sent"],
            row["bytes_received"],
        )
        self._write_status(client_stats=session.stats if session.client is not None else None)

    def _row_fields(self, round_number: int) -> dict[str, Any]:
        """The daemon's fields of a round's metrics row: speed, loss, the global eval."""
        row: dict[str, Any] = {"loss": float(np.mean(self.losses))}
        self.losses = []
        if self.cfg.eval_every and round_number % self.cfg.eval_every == 0:
            row.update(self._global_eval())
        return row

    def _global_eval(self) -> dict[str, Any]:
        """Held-out loss of the newest adopted global parameters, labelled with their versions."""
        assert self.session is not None
        return {
            "eval_global": self.trainer.evaluate(
                self.eval_set, params=self.session.global_params()
            ),
            "eval_versions": self.session.version,
        }

    def _watch(self, stop: threading.Event) -> Watchdog | None:
        """Multi-process: start the liveness watchdog; another process's SIGTERM leaves at once."""
        if not self.spec.multi:
            return None
        watchdog = Watchdog(
            self.cfg.island,
            self.spec,
            self.liveness_s,
            self.cfg.heartbeat_interval_s,
            self._abandon,
        )
        watchdog.start()
        if not self.spec.leader:

            def leave_on_stop() -> None:  # stop an island through process 0
                stop.wait()
                logger.warning(
                    "island %s: process %d stopped", self.cfg.island, self.spec.process_id
                )
                logging.shutdown()
                os._exit(0)

            threading.Thread(target=leave_on_stop, name="follower-stop", daemon=True).start()
        return watchdog

    def _await_watchdog(self, watchdog: Watchdog, exc: Exception) -> None:
        """A collective failed (another process is gone): let the watchdog name it and exit.

        Raises:
            RuntimeError: the watchdog did not end the process within twice the liveness timeout.
        """
        logger.warning("island %s: a collective failed: %s", self.cfg.island, exc)
        watchdog.fired.wait(2 * self.liveness_s + self.cfg.heartbeat_interval_s)
        watchdog.join(2 * self.liveness_s)  # it ends the process once it has fired
        raise RuntimeError(
            f"island {self.cfg.island}: a collective of the island's processes failed: {exc}"
        ) from exc

    def _abandon(self, line: str) -> None:
        """Another process of the island is gone (watchdog thread): say bye, keep the unacked."""
        if self.session is not None:
            self.session.abandon(min(self.cfg.flush_timeout_s, self.liveness_s))
        self.state = "failed"
        self.last["error"] = line
        self._write_status()

    def _wait_for_start(self, stop: threading.Event) -> None:
        """Hold training until `start_file` exists (or stop), so that islands start together."""
        start_file = Path(self.cfg.start_file)
        self.state = "waiting"
        self._write_status()
        while not stop.is_set() and not start_file.exists():
            stop.wait(0.05)
        self.state = "training"
        self._write_status()

    # -- reporting ------------------------------------------------------------

    def _write_status(self, client_stats: dict[str, Any] | None = None) -> None:
        session = self.session
        if session is not None and session.last_row:
            self.last.update(session.last_row)
        status = {
            "island": self.cfg.island,
            "pid": os.getpid(),
            "state": self.state,
            "round": session.round if session is not None else 0,
            "updated": time.time(),
            "data_id": self.data_id,
            **self.topology,
            **{k: v for k, v in self.last.items() if k not in ("island", "round")},
        }
        if client_stats is not None:
            status["client"] = client_stats
        island_files.write_status(self.data_dir, status)
