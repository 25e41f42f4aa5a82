"""One island: join the cluster, train H inner steps per round, push deltas, fold in new versions.

Pushes go to the client's background I/O thread (which blocks `push` only
when its bounded buffer of unacked deltas is full), and published versions are
picked up between steps with a non-blocking poll and folded in with the rule
of `worker.exchange`. In a cluster of mode "sync" (synchronous DiLoCo) the
island waits after each push until the shards published versions that include
its round, then adopts them and starts the next round: the slowest island
paces everyone, and that wait shows as lost goodput. The train and eval steps
are compiled before the start barrier, so compile time is neither padded by
`--speed` nor charged to the first round. With `--streaming true` each
fragment is pushed at its own inner step of the round instead of all at its
end (`worker.streaming`), and the unsent work is pushed when the island stops.

Goodput (`worker.goodput`): tokens the shards credited to this island (each
delta's tokens times its staleness factor) over the tokens it could have
trained since the start at its measured step rate.

Progress goes to ``<data_dir>/metrics.jsonl`` (one JSON object per round) and
``<data_dir>/status.json`` (rewritten atomically), which `diloco-worker status`
and the demo's live display read.

Stopping: every wait (join, a push under back-pressure, the sync-mode merge,
the start barrier) ends when the stop event is set (SIGTERM). Deltas still
unacked then are written to ``<data_dir>/outbox.bin`` and pushed again, with
their round ids, when the island starts again with the same data dir
(`worker.outbox_file`); new rounds wait until those are resolved.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

import codec
from paramserver.client import Client, ClientError
from worker import compile_cache, outbox_file
from worker import data as data_lib
from worker import model as model_lib
from worker.config import IslandConfig
from worker.exchange import FragmentSync
from worker.goodput import goodput, step_rate
from worker.mirror import Group, topology
from worker.multihost import GroupSpec, liveness_timeout_s
from worker.pace import Pacer
from worker.streaming import check_streaming_mode, due_fragments, flush_fragments
from worker.train import InnerConfig, InnerTrainer

logger = logging.getLogger(__name__)

STATUS_FILE = "status.json"
METRICS_FILE = "metrics.jsonl"


def make_codec(cfg: IslandConfig) -> codec.Codec:
    """The delta codec an island config asks for.

    Args:
        cfg: island settings (`codec`, `block_size`).

    Returns:
        A codec object with init/encode.
    """
    kwargs = {"block_size": cfg.block_size} if cfg.block_size else {}
    if cfg.codec == "int8":
        return codec.int8(**kwargs)
    if cfg.codec == "int4":
        return codec.int4(**kwargs)
    if cfg.codec == "topk":
        chunk = {"chunk": cfg.block_size} if cfg.block_size else {}
        return codec.topk(density=cfg.topk_density, bits=cfg.topk_bits, **chunk)
    return codec.raw(cfg.codec)


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


def write_json_atomic(path: Path, obj: Any) -> None:
    """Replace `path` with `obj` as JSON so that readers never see a torn file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


class Island:
    """The training loop of one island (state lives here, decisions in worker.exchange)."""

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
            group: this process's place in a multi-process island (`worker.multihost`,
                already initialised); None = a one-process island.
        """
        self.cfg = cfg
        self.liveness_s = liveness_timeout_s(cfg.heartbeat_interval_s)
        self.group = Group(
            group or GroupSpec(), cfg.island, self.liveness_s, cfg.heartbeat_interval_s
        )
        self.topology: dict[str, Any] = {}
        self.data_dir = Path(cfg.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # before the first jit, so a restart reads the compiled steps back instead of compiling
        self.compile_cache = compile_cache.enable(cfg.compile_cache_dir, self.data_dir)
        self.model_cfg = model_lib.MODEL_CONFIGS[cfg.model]
        own = data_lib.island_data(cfg)  # its shard of the corpus, and the common held-out set
        self.sampler, self.eval_set, seed = own.sampler, own.eval_set, own.seed
        self.inner_cfg = InnerConfig(
            lr=cfg.lr,
            warmup_steps=cfg.warmup_steps,
            batch_size=cfg.batch_size,
            seq_len=cfg.seq_len,
        )
        self.pacer = Pacer(cfg.speed, cfg.jitter, seed)
        self.codec = make_codec(cfg)
        self.client_factory = client_factory
        self.metrics_path = self.data_dir / METRICS_FILE
        self.status_path = self.data_dir / STATUS_FILE
        self.outbox_path = self.data_dir / outbox_file.OUTBOX_FILE
        # Deltas of a previous run pushed again and not resolved yet; None until the
        # outbox file was read (after the join): only then may the file be rewritten.
        self.resending: int | None = None
        self.state = "starting"
        self.round = 0
        # Round ids are the idempotency key (island, round, fragment) on the shards: start
        # each process's rounds from its start time so a restarted island never reuses one.
        self.round_base = int(time.time()) * 1_000_000
        self.started = time.monotonic()
        self.step_times: list[float] = []  # recent step durations, padding included
        self.wait_s = 0.0  # time spent waiting for merges (sync mode)
        self.mode = "quorum"
        self.last: dict[str, Any] = {}

    # -- set-up ---------------------------------------------------------------

    def _join(self, client: Client, stop: threading.Event) -> None:
        params0 = model_lib.init_params(self.model_cfg, self.cfg.seed)
        flat0 = codec.flatten(jax.tree_util.tree_map(np.asarray, params0))
        self.state = "joining"
        self._write_status()
        joined = client.join(flat0, stop=stop)
        self.plan = joined.plan
        self.mode = joined.mode
        check_streaming_mode(self.cfg.streaming, self.mode)  # refuses a sync cluster
        self.param_count = sum(frag.size for frag in self.plan.fragments)
        self.flat = {k: np.array(v, dtype=np.float32) for k, v in joined.params.items()}
        self.group.share_join(codec.unflatten(self.flat))  # other processes build their trainer
        trainer = InnerTrainer(
            self.model_cfg,
            self.inner_cfg,
            codec.unflatten(self.flat),
            devices=self.cfg.devices or None,
            param_sharding=self.cfg.param_sharding,
        )
        self.trainer = self.group.wrap(trainer)  # announces each call to the other processes
        self.topology = topology(self.group.spec, trainer)
        self.sync = {
            frag.index: FragmentSync.start(self.plan.gather(self.flat, frag.index), version)
            for frag in self.plan.fragments
            for version in [joined.versions[frag.index]]
        }
        self.ef_state = {
            frag.index: self.codec.init({"delta": np.zeros(frag.size, np.float32)})
            for frag in self.plan.fragments
        }
        self.unsent = {frag.index: 0 for frag in self.plan.fragments}  # steps since its push
        logger.info(
            "island %s joined: %d fragments, versions %s, mode %s",
            self.cfg.island,
            len(self.plan.fragments),
            joined.versions,
            self.mode,
        )
        self.state = "compiling"
        self._write_status()
        self.trainer.warmup()  # logs its compile time

    # -- the loop -------------------------------------------------------------

    def _local_flat(self) -> dict[str, np.ndarray]:
        return codec.flatten(self.trainer.numpy_params())

    def _fold_updates(self, client: Client) -> int:
        """Adopt every newer global version the client received; returns how many."""
        updates = [
            u for u in client.poll_updates() if u.version > self.sync[u.fragment].base_version
        ]
        if not updates:
            return 0
        local = self._local_flat()
        for update in updates:
            sync = self.sync[update.fragment]
            current = self.plan.gather(local, update.fragment)
            new_local = sync.adopt(current, update.values, update.version, self.cfg.merge_rule)
            self.plan.scatter(update.fragment, new_local, local)
        self.trainer.set_params(codec.unflatten(local))
        return len(updates)

    def _push_round(self, client: Client, fragments: list[int], stop: threading.Event) -> None:
        """Push each fragment's work since its own last push (one gather, every process)."""
        self._settle_resent(client, stop)
        local = self._local_flat()
        round_id = self.round_base + self.round
        for index in fragments:
            sync = self.sync[index]
            delta = sync.take(self.plan.gather(local, index))  # only the work not sent yet
            frames, self.ef_state[index] = self.codec.encode({"delta": delta}, self.ef_state[index])
            steps, self.unsent[index] = self.unsent[index], 0
            tokens = steps * self.cfg.batch_size * self.cfg.seq_len
            client.push(index, round_id, sync.base_version, tokens, steps, frames, stop=stop)

    def _settle_resent(self, client: Client, stop: threading.Event) -> None:
        """Before the first new round: wait until the re-sent deltas are resolved, drop the file.

        (A shard refuses a round far below the newest it saw from this island, so
        the previous run's deltas must land first.)
        """
        if not self.resending:
            return
        while client.stats()["pending"] and not stop.is_set():
            stop.wait(0.01)
        if stop.is_set():
            return  # the file stays; close() rewrites it with what is still unacked
        logger.info(
            "island %s: the %d re-sent deltas are resolved", self.cfg.island, self.resending
        )
        outbox_file.save(self.outbox_path, self.cfg.island, self.plan.hash, [])
        self.resending = 0

    def _global_eval(self) -> dict[str, Any]:
        """Held-out loss of the newest adopted global parameters, labelled with their versions."""
        flat = {k: np.empty_like(v) for k, v in self.flat.items()}  # fragments cover every element
        for index, sync in self.sync.items():
            self.plan.scatter(index, sync.base, flat)
        return {
            "eval_global": self.trainer.evaluate(self.eval_set, params=codec.unflatten(flat)),
            "eval_versions": sum(sync.base_version for sync in self.sync.values()),
        }

    def _wait_for_merge(self, client: Client, round_id: int, stop: threading.Event) -> None:
        """Sync mode: block until the shards published versions that include `round_id`."""
        t0 = time.monotonic()
        while not stop.is_set() and not client.round_merged(round_id):
            stop.wait(0.005)
        self.wait_s += time.monotonic() - t0

    def run(self, stop: threading.Event, on_ready: Callable[[], None] | None = None) -> int:
        """Train until `stop` is set or `max_rounds` rounds are done.

        Args:
            stop: set by the signal handler (SIGTERM) or the caller.
            on_ready: called once the island has joined and starts training.

        Returns:
            0 after a clean stop (unacked deltas flushed within the bound).
        """
        cfg = self.cfg
        client = self.client_factory(cfg.client_config())
        self.group.watch(lambda line: self._abandon(client, line))
        exit_code = 1  # what the other processes of the island exit with
        try:
            try:
                self._join(client, stop)
            except ClientError:
                if not stop.is_set():
                    raise
                logger.info("island %s stopped while joining", cfg.island)
                exit_code = 0
                return 0
            self.resending = outbox_file.resend(
                client, self.outbox_path, cfg.island, self.plan.hash, stop
            )
            self.started = time.monotonic()
            self.state = "training"
            if cfg.eval_every:
                self._append_metrics({"round": 0, "steps": 0, "tokens": 0, **self._global_eval()})
            self._write_status()
            if on_ready is not None:
                on_ready()
            if cfg.start_file:
                self._wait_for_start(stop)
            steps_per_round = inner_steps_for(cfg)
            while not stop.is_set() and (cfg.max_rounds == 0 or self.round < cfg.max_rounds):
                losses, adopted, steps = [], 0, 0
                round_start = time.monotonic()
                for _ in range(steps_per_round):
                    if stop.is_set():
                        break
                    t0 = time.monotonic()
                    losses.append(self.trainer.step(self.sampler.next()))
                    self.pacer.pad(time.monotonic() - t0)
                    self.step_times.append(time.monotonic() - t0)
                    del self.step_times[:-256]
                    steps += 1
                    self.unsent = {index: n + 1 for index, n in self.unsent.items()}
                    if cfg.streaming and (
                        due := due_fragments(steps, steps_per_round, len(self.unsent))
                    ):
                        self._push_round(client, due, stop)
                    adopted += self._fold_updates(client)
                if steps == 0:
                    break
                client.report_step_time(float(np.median(self.step_times[-steps_per_round:])))
                if not cfg.streaming:
                    self._push_round(client, sorted(self.sync), stop)
                if self.mode == "sync":
                    self._wait_for_merge(client, self.round_base + self.round, stop)
                    adopted += self._fold_updates(client)
                self.round += 1
                self._record_round(client, losses, adopted, steps, round_start)
            if cfg.streaming and (rest := flush_fragments(self.unsent)):
                self._push_round(client, rest, stop)  # under a round id no push used yet
            self.state = "stopping"
            self._write_status()
            exit_code = 0
        finally:
            self.group.finish(exit_code)
            client.close(flush_timeout_s=cfg.flush_timeout_s)
            if self.resending is not None:  # keep what is unacked, or drop a settled file
                outbox_file.keep(self.outbox_path, cfg.island, self.plan.hash, client.unacked())
            self.state = "stopped"
            if self.round:
                # final counters, after the flush: the last round's acks are in
                stats = client.stats()
                self._append_metrics(
                    {**self._stats_fields(stats), "round": self.round, "final": True}
                )
                self._write_status(client_stats=stats)
            else:
                self._write_status()
        return 0

    def _abandon(self, client: Client, line: str) -> None:
        """Another process of the island is gone (watchdog thread): say bye, keep the unacked."""
        client.close(flush_timeout_s=min(self.cfg.flush_timeout_s, self.liveness_s))
        if self.resending is not None:
            outbox_file.keep(self.outbox_path, self.cfg.island, self.plan.hash, client.unacked())
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
        self.started = time.monotonic()
        self._write_status()

    # -- reporting ------------------------------------------------------------

    def _record_round(
        self, client: Client, losses: list[float], adopted: int, steps: int, round_start: float
    ) -> None:
        cfg = self.cfg
        stats = client.stats()
        row: dict[str, Any] = {
            "round": self.round,
            "loss": float(np.mean(losses)),
            "round_s": round(time.monotonic() - round_start, 3),
            "versions_adopted": adopted,
            **self._stats_fields(stats),
        }
        if cfg.eval_every and self.round % cfg.eval_every == 0:
            row.update(self._global_eval())
        row = self._append_metrics(row)
        logger.info(
            "round %d loss %.3f eval %s tokens/s %.0f lag %d sent %d B received %d B",
            self.round,
            row["loss"],
            f"{row['eval_global']:.3f}" if "eval_global" in row else "-",
            steps * cfg.batch_size * cfg.seq_len / max(row["round_s"], 1e-9),
            row["version_lag"],
            row["bytes_sent"],
            row["bytes_received"],
        )
        self._write_status(client_stats=stats)

    def _append_metrics(self, row: dict[str, Any]) -> dict[str, Any]:
        """Add the common fields to a metrics row, append it to metrics.jsonl; returns it."""
        row = {
            "island": self.cfg.island,
            "speed": self.cfg.speed,
            "params": self.param_count,
            "time_s": round(time.monotonic() - self.started, 3),
            "wall": time.time(),
            **row,
        }
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.last = row
        return row

    def _stats_fields(self, stats: dict[str, Any]) -> dict[str, Any]:
        """The client counters a metrics row carries, and the goodput they imply.

        Goodput = tokens the shards credited to this island (staleness-weighted,
        as of their latest heartbeat replies and published steps) / (wall time
        since the start x the island's median step rate); see `worker.goodput`.
        """
        wall = time.monotonic() - self.started
        tokens_per_step = self.cfg.batch_size * self.cfg.seq_len
        rate = step_rate(self.step_times, tokens_per_step)
        capacity = wall * rate if rate else 0.0
        credited = float(stats.get("credited_tokens", 0.0))
        pushes = stats.get("pushes", 0)
        acked = stats.get("acked", 0)
        return {
            "steps": self.trainer.steps_done,
            "tokens": self.trainer.tokens_done,
            "version_lag": max(0, stats.get("version_lag", 0)),
            "bytes_sent": stats.get("bytes_sent", 0),
            "bytes_received": stats.get("bytes_received", 0),
            "pushes": pushes,
            "acked": acked,
            "rejected": sum(stats.get("rejected", {}).values()),
            "pending": stats.get("pending", 0),
            "credited_tokens": round(credited, 1),
            "capacity_tokens": round(capacity, 1),
            "wait_s": round(self.wait_s, 3),
            "goodput": goodput(credited, capacity) or 0.0,
        }

    def _write_status(self, client_stats: dict[str, Any] | None = None) -> None:
        status = {
            "island": self.cfg.island,
            "pid": os.getpid(),
            "state": self.state,
            "round": self.round,
            "updated": time.time(),
            **self.topology,
            **{k: v for k, v in self.last.items() if k not in ("island", "round")},
        }
        if client_stats is not None:
            status["client"] = client_stats
        write_json_atomic(self.status_path, status)
