"""`worker.join` and `Session`: any JAX training loop as an island of the cluster.

    with worker.join("tcp://127.0.0.1:5555", island="a", params=params,
                     inner_steps=100, data_dir="runs/a") as session:
        params = session.params
        for batch in batches:
            params, opt_state, loss = train_step(params, opt_state, batch)
            params = session.step(params, tokens=batch_tokens)

`join` names the tree's leaves (`worker.param_tree`), joins the cluster
(initialising a fresh one with `params`; with a data dir its hellos carry the
island's persisted session token, `worker.session_token`), re-sends what a
previous run left in ``<data_dir>/outbox.bin`` (`worker.outbox`) and hands out
the global model placed like `params`. `Session.step` counts inner steps;
when a fragment's delta is due (every `inner_steps` calls, or per fragment at
its own step with streaming: `worker.push_thread`) it pushes each due
fragment's work since its last push (`worker.exchange`'s rule, encoded with
error feedback, written to the outbox file before it leaves; a
fragment whose previous delta is not merged skips a push in quorum mode and
carries the work into its next one, see `Session._unblocked`), and
folds in every newer published version with the merge rule. The exchange
runs on the parameters' own devices (`worker.device_exchange`: only codes and
scales cross to the host) when `exchange="device"` (the default), the codec
is int8 or int4 and every leaf is a `jax.Array`; otherwise on the host
(`worker.host_exchange`: one host copy of the parameters per step that
pushes or folds). A call that neither pushes nor folds touches no parameter: it
only checks the tree's structure and asks the client, without blocking,
whether a version arrived. In a sync cluster the round's last call waits
until the round is merged. `close` pushes the partial round, flushes, keeps
what stays unacked in the data dir and says bye.

Each pushed delta has one record, in the session's ledger of deltas
(`worker.deltas`, `Session.ledger`), from its take to its fate, which the
client reports as it learns it: goodput, the outbox, the quorum skip and the
sync wait derive what they need from it.

A session runs in any thread and installs no signal handler; `stop` (a
`threading.Event`) ends its waits, which sleep on the client's or the ledger's
Condition in short slices (so Ctrl-C reaches a main thread that waits). One lock, held by
`step` and `close`, guards the session's state: `abandon` (the watchdog's
thread) first closes the client, which ends any wait of `step` with
`SessionClosed`, then takes the lock to keep the unacked deltas and release
the data dir. Multi-process islands: every process calls
`join` and `step` at the same points with its own shards; process 0 alone
opens sockets and `worker.leader_sync` shares its decisions.

Its parts: `worker.session_rows` (the metrics rows and the training report
at each round's end) and `worker.session_end` (`close`, `abandon`,
`SessionClosed`); its decisions live in `worker.exchange`,
`worker.push_thread`, `worker.goodput`, `worker.deltas`, `worker.outbox` and
`worker.leader_sync`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import numbers
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

import codec
from paramserver.client import Client, ClientError, JoinResult, PushRequest, Update
from worker import compile_cache, session_token
from worker.config import IslandConfig
from worker.deltas import DeltaLedger
from worker.device_exchange import DeviceExchange
from worker.goodput import RoundClock
from worker.host_exchange import HostExchange
from worker.leader_sync import LeaderSync
from worker.outbox import OUTBOX_FILE, Outbox
from worker.param_tree import TreeError, TreeLayout
from worker.push_thread import (
    PushFailed,
    PushJob,
    PushThread,
    check_streaming_mode,
    deliver,
    due_fragments,
    unblocked,
)
from worker.session_config import make_codec, session_config
from worker.session_end import SessionClosed, SessionEnd, claim_island
from worker.session_rows import SessionRows

logger = logging.getLogger(__name__)


def join(
    connect: str,
    *,
    island: str,
    params: Any,
    inner_steps: int,
    data_dir: str | Path | None = None,
    stop: threading.Event | None = None,
    **settings: Any,
) -> Session:
    """Join the cluster as an island that trains `params` with the caller's own loop.

    Args:
        connect: ROUTER endpoint of any shard, e.g. "tcp://127.0.0.1:5555".
        island: the island id (stable across restarts of the same island).
        params: a pytree of floating arrays; it initialises a fresh cluster and
            must match the model of one that already holds one.
        inner_steps: `step` calls per round (a push every `inner_steps` calls).
        data_dir: where ``metrics.jsonl``, the outbox of unacked deltas (written before
            each push, so a kill -9 loses none), the session token and the compile
            cache go; None = nowhere (unacked deltas are then dropped at close).
        stop: an event that, once set, ends every wait of the session.
        **settings: island options of the exchange (`worker.session_config.SESSION_SETTINGS`:
            exchange ("device" | "host"), codec, block_size, topk_density, topk_bits,
            topk_ef_decay, streaming, merge_rule,
            max_unacked, flush_timeout_s, join_timeout_s, heartbeat_interval_s, the
            CURVE key files, insecure, compile_cache_dir), validated as `IslandConfig` does.

    Returns:
        An open Session (a context manager).

    Raises:
        ValueError: a bad setting, `inner_steps` or params tree (naming the leaf).
        RuntimeError: this process already has an open session with this island id, or
            another live process holds `data_dir` (`session_token.TokenInUse`).
        ClientError: the cluster did not answer within the join timeout, or its
            model differs from `params` (naming the first differing leaf).
    """
    cfg = session_config(connect, island, inner_steps, data_dir, settings)
    return Session(cfg, params, stop=stop)


def _host_reason(cfg: IslandConfig, layout: TreeLayout) -> str | None:
    """Why the session's exchange runs on the host, or None when it runs on the devices."""
    if cfg.exchange != "device":
        return "exchange host"
    if cfg.codec not in ("int8", "int4"):
        return f"codec {cfg.codec} is encoded on the host"
    if any(s is None for s in layout.shardings):
        return "params has numpy leaves (pass jax arrays to exchange on their devices)"
    return None


def _check_tokens(tokens: Any) -> int:
    """`Session.step`'s tokens as an int (ValueError: not an int >= 1)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int | np.integer) or tokens < 1:
        raise ValueError(
            f"tokens must be an int >= 1 (the tokens this inner step trained), got {tokens!r}"
        )
    return int(tokens)


def _check_loss(loss: Any) -> Any:
    """`loss` itself when it is a number or a one-element array (read at the round's end,
    so that a device scalar is not waited for at every step)."""
    if isinstance(loss, bool) or not (
        isinstance(loss, numbers.Real) or getattr(loss, "size", None) == 1
    ):
        raise ValueError(f"loss must be a number (the inner step's train loss), got {loss!r}")
    return loss


class Session(SessionRows, SessionEnd):
    """One island's membership of the cluster, driven by the caller's training loop."""

    def __init__(
        self,
        cfg: IslandConfig,
        params: Any,
        *,
        stop: threading.Event | None = None,
        inner_steps: int | None = None,
        client_factory: Callable[..., Client] = Client,
        row_fields: Callable[[int], dict[str, Any]] | None = None,
        row_tags: dict[str, Any] | None = None,
    ) -> None:
        """Join the cluster (see `join`, which validates the settings first).

        Args:
            cfg: the island's settings (`IslandConfig`; a session uses the exchange's).
            params: the pytree to train (see `join`).
            stop: ends every wait once set.
            inner_steps: steps per round; None = `cfg.inner_steps`.
            client_factory: builds the client from a ClientConfig.
            row_fields: called at the end of each round with its number; its fields
                are added to that round's metrics row (the daemon adds its loss and eval).
            row_tags: fields added to every metrics row (the daemon's speed).
        """
        self.cfg = cfg
        self.layout = TreeLayout.of(params)
        self.inner_steps = inner_steps or cfg.inner_steps
        self.stop = stop or threading.Event()
        self.row_fields = row_fields
        self.row_tags = dict(row_tags or {})
        self.data_dir = Path(cfg.data_dir) if cfg.data_dir else None
        self.leader_sync = LeaderSync(jax.process_count() > 1, jax.process_index() == 0)
        self.island = cfg.island
        claim_island(cfg.island)
        self.closed = False
        # held by `step`, `close` and `abandon`'s second half: the session's state changes
        # under it (`abandon` runs on the watchdog's thread)
        self._lock = threading.RLock()
        self._abandoned = threading.Event()  # set first by `abandon`, before it closes the client
        self.last_row: dict[str, Any] = {}
        self.client: Client | None = None
        self.outbox: Outbox | None = None  # process 0 with a data dir: `worker.outbox`
        self.token: session_token.HeldToken | None = None
        # one record per pushed delta (process 0; `worker.deltas`): goodput, the outbox,
        # the quorum skip and the sync wait derive from it; the client tells it each fate
        self.ledger = DeltaLedger(outbox=self.data_dir is not None and self.leader_sync.leader)
        try:
            self._open(params, client_factory)
        except BaseException:
            if self.client is not None:
                self.client.close(flush_timeout_s=0.0)
            self._release()
            raise

    def _open(self, params: Any, client_factory: Callable[..., Client]) -> None:
        cfg = self.cfg
        if self.data_dir is not None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            compile_cache.enable(cfg.compile_cache_dir, self.data_dir)
        host = self.layout.to_host(self.leader_sync.gather(self.layout.leaves(params)))
        joined: JoinResult | None = None
        if self.leader_sync.leader:
            # the device exchange keeps the global values itself: the client only versions
            # and increments' codes (`ClientConfig.keep`); the host exchange reads values
            keep = "values" if _host_reason(cfg, self.layout) else "increments"
            client_cfg = dataclasses.replace(cfg.client_config(), keep=keep)
            if self.data_dir is not None:  # a restart proves it is this island (its token)
                self.token = session_token.hold(self.data_dir)
                client_cfg = dataclasses.replace(client_cfg, session=self.token.value)
            self.client = client_factory(client_cfg)
            try:  # a PlanMismatch names the first differing leaf already
                joined = self.client.join(self._join_values(host), stop=self.stop)
            except ClientError:
                if self.leader_sync.multi:
                    self.leader_sync.share_join(None)
                raise
        joined = self.leader_sync.share_join(joined)
        check_streaming_mode(cfg.streaming, joined.mode)
        self.plan, self.mode = joined.plan, joined.mode
        self.sizes = [frag.size for frag in self.plan.fragments]
        flat = {k: np.asarray(v, np.float32) for k, v in joined.params.items()}
        self.exchange = self._exchange(flat, joined.versions)
        self.exchange_s = 0.0
        # (steps, tokens) of the session when each fragment was last pushed: its unsent work
        # is the session's totals minus these (no per-call bookkeeping per fragment)
        self.pushed_at: dict[int, tuple[int, int]] = dict.fromkeys(range(len(self.sizes)), (0, 0))
        self.params = self.exchange.initial_params()
        self._latest = self.params
        self._warm = False  # `warm_up` ran
        self.round = 0
        self.in_round = 0  # step calls of the current round
        self.pushed_in_round = False
        self.steps = self.tokens = 0
        self.adopted = 0
        self._round_losses: list[Any] = []  # the `loss` values of this round's steps
        has_outbox = self.client is not None and self.data_dir is not None
        self.goodput_clock = RoundClock(time.monotonic(), ledger=self.ledger)
        self._leader_stop = False  # process 0's stop as of the last step (multi-process)
        self.resending = 0  # deltas of a previous run pushed again and not resolved yet
        if self.client is not None:
            self.client.watch_outcomes(self.ledger.on_outcome)
        if has_outbox:
            self.outbox = Outbox.open(self.data_dir / OUTBOX_FILE, cfg.island, self.plan.hash)
            self.ledger.resent(self.outbox.to_resend)  # before they leave: their acks find them
            self.resending = self.outbox.resend(self.client, self.stop)
        # Round ids are the idempotency key (island, round, fragment) on the shards: start
        # each run's rounds from its start time in microseconds (a round takes longer), and
        # past any round of its outbox, so a restarted island never reuses one.
        newest_kept = self.outbox.newest_round if self.outbox is not None else -1
        self.round_base = max(time.time_ns() // 1000, newest_kept + 1)
        # the exchange beside training (`worker.push_thread`): process 0 with overlap_rounds > 0
        self.pusher: PushThread | None = None
        if self.client is not None and cfg.overlap_rounds > 0:
            self.pusher = PushThread(cfg.island, self.client, self.outbox, self.ledger,
                                     cfg.overlap_rounds, self._settle_resent)  # fmt: skip
        logger.info(
            "island %s joined: %d fragments, versions %s, mode %s",
            cfg.island,
            len(self.plan.fragments),
            joined.versions,
            self.mode,
        )

    def _exchange(
        self, flat: dict[str, np.ndarray], versions: dict[int, int]
    ) -> DeviceExchange | HostExchange:
        """The device exchange when it applies, else the host's (saying why, once)."""
        cfg, delta_codec = self.cfg, make_codec(self.cfg)
        why = _host_reason(cfg, self.layout)
        if why is None:
            return DeviceExchange(
                self.layout, self.plan, flat, versions, scheme=cfg.codec,
                block=delta_codec.block_size, zstd_level=delta_codec.zstd_level,
                rule=cfg.merge_rule,
            )  # fmt: skip
        if cfg.exchange == "device":
            logger.info("island %s: exchange on the host: %s", cfg.island, why)
        return HostExchange(
            self.layout, self.plan, flat, versions, delta_codec=delta_codec,
            rule=cfg.merge_rule, leader_sync=self.leader_sync,
        )  # fmt: skip

    def _join_values(self, host: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {
            n: host[n].astype(d) for n, d in zip(self.layout.names, self.layout.dtypes, strict=True)
        }

    # -- the step -------------------------------------------------------------------

    def step(self, params: Any, *, tokens: int, loss: float | None = None) -> Any:
        """Count one inner step; push when a delta is due, fold in new global versions.

        Args:
            params: the parameters after the inner step (the session's tree layout).
            tokens: tokens this inner step trained (an int >= 1).
            loss: the inner step's train loss, optional (a finite float); the round's
                mean goes to the shards with the island's step rate and goodput, for
                the cluster page (without one: the metrics row's "loss", if any).

        Returns:
            The parameters to continue from: `params` itself when nothing was folded
            in, else a new tree placed like it.

        Raises:
            ValueError: another tree structure, shape or dtype (naming the leaf), bad tokens or loss.
            SessionClosed: the session is closed, or was abandoned during the call (a
                RuntimeError).
        """
        with self._lock:
            self._check_open()
            try:
                return self._step(params, tokens, loss)
            except ClientError as exc:  # its client was closed by `abandon` meanwhile
                if self._abandoned.is_set():
                    raise SessionClosed(self.island, abandoned=True) from exc
                raise

    def _step(self, params: Any, tokens: int, loss: float | None) -> Any:
        self._check_pusher()  # a failure of the background exchange surfaces here
        tokens = _check_tokens(tokens)
        loss = None if loss is None else _check_loss(loss)
        leaves = self.layout.leaves(params)
        self.goodput_clock.step_started(time.monotonic())
        in_round = self.in_round + 1
        round_end = in_round == self.inner_steps
        if loss is not None:
            self._round_losses.append(loss)
        if self.cfg.streaming:
            due = due_fragments(in_round, self.inner_steps, len(self.sizes))
        else:
            due = list(range(len(self.sizes))) if round_end else []
        due = self._unblocked(due)
        if due:  # before anything is counted: at most `overlap_rounds` in flight
            self._wait_for_room()
        taken = self._take(leaves, due) if due else None
        self.steps, self.tokens, self.in_round = self.steps + 1, self.tokens + tokens, in_round
        if taken is not None:
            self._push(due, taken, self.round_base + self.round)
        if round_end and self.client is not None:
            step_s = self.goodput_clock.median_step_s(self.inner_steps)
            self.client.report_step_time(step_s, inner_steps=self.inner_steps)
            if self.mode == "sync":
                self._wait_for_merge(self.round_base + self.round)
        out = self._fold(leaves, params)
        self.exchange.end_step()
        self._latest = out
        if round_end:
            self.round += 1
            self.in_round, self.pushed_in_round = 0, False
            self._round_row()
            self._report_training()
        self.goodput_clock.step_ended(time.monotonic())
        return out

    def _unblocked(self, due: list[int]) -> list[int]:  # `push_thread.unblocked`
        if not due or self.client is None or self.mode != "quorum" or self.leader_sync.multi:
            return due  # nothing due: no question to the client (most calls of a round)
        if self.client.stats().get("shards_down"):  # queue
            return due
        if not self.cfg.skip_stale_pushes:  # `IslandConfig.skip_stale_pushes`
            return due
        last_push, outcomes = self.ledger.newest_outcomes(due)
        return unblocked(due, last_push, outcomes)

    def _take(self, leaves: list[Any], fragments: list[int]) -> tuple[dict[int, int], Any]:
        """The due fragments' base versions and their taken delta (work since the last push).

        Every process moves its anchors; the taken delta's `frames()` gives process 0
        the frames ({} elsewhere), on whichever thread pushes.
        """
        versions = dict(self.exchange.versions)  # the versions the deltas are taken against
        t0 = time.perf_counter()
        for fragment, values in self._refused():  # their mass goes back into error feedback
            self.exchange.refund(fragment, values)
        taken = self.exchange.take(leaves, fragments, self.client is not None)
        self.exchange_s += time.perf_counter() - t0
        return versions, taken

    def _wait_for_room(self) -> None:
        """Past `overlap_rounds` deltas in flight: wait for the push thread (lost time)."""
        if self.pusher is None:
            return
        self._check_pusher()
        pusher = self.pusher

        def abandoned() -> bool:
            if self.stop.is_set():  # a push blocked on back-pressure queues at once
                pusher.halt.set()
            return self._abandoned.is_set()

        waited = pusher.wait_for_room(abandoned)
        self.goodput_clock.waited(waited)
        self._check_pusher()

    def _check_pusher(self) -> None:
        """Raise what the push thread failed with (`PushFailed`; closed: `SessionClosed`)."""
        if self._abandoned.is_set():
            raise SessionClosed(self.island, abandoned=True)
        if self.pusher is not None and self.pusher.failure is not None:
            raise self.pusher.failure

    def _refused(self) -> list[tuple[int, np.ndarray]]:
        """(fragment, decoded delta) of each push the shards finally refused since the last call.

        Process 0 reads them from its client; with the device exchange every process
        gets them (its residual is spread over all), with the host's only process 0.
        """
        refused = []
        if self.client is not None:
            refused = [
                (fragment, codec.decode(list(frames))["delta"])
                for fragment, _, frames in self.client.take_refused()
            ]
        if self.leader_sync.multi and isinstance(self.exchange, DeviceExchange):
            refused = self.leader_sync.share_refused(refused, self.sizes)
        return refused

    def _push(self, fragments: list[int], taken: tuple[dict[int, int], Any], round_id: int):
        """Note what each fragment's delta covers; push them (process 0: persisted first).

        With a push thread the job is queued and `step` goes on; without one
        (`overlap_rounds` 0) it is delivered here.
        """
        versions, delta = taken
        for index in fragments:
            steps_then, tokens_then = self.pushed_at[index]
            steps, tokens = self.steps - steps_then, self.tokens - tokens_then
            self.pushed_at[index] = (self.steps, self.tokens)
            if self.client is not None:  # its record in the ledger, before anything leaves
                work_s = self.goodput_clock.pushed(index, self.sizes[index] / sum(self.sizes))
                self.ledger.taken(round_id, index, versions[index], tokens, steps, work_s)
        self.pushed_in_round = True
        if self.client is None:
            delta.frames()  # the other processes: the push's collectives run
            return
        job = PushJob(round_id, delta, list(fragments))
        if self.pusher is not None:
            self.pusher.submit(job)
        else:
            deliver(job, self.client, self.outbox, self.ledger, self.stop, self._settle_resent)

    def _fold(self, leaves: list[Any], params: Any) -> Any:
        """Adopt every newer version (the same ones on every process); returns the params."""
        updates: list[Update] = []
        versions = self.exchange.versions
        if self.client is not None:
            updates = [u for u in self.client.poll_updates() if u.version > versions[u.fragment]]
        updates, self._leader_stop = self.leader_sync.share_updates(
            updates, self.stop.is_set(), self.sizes, self._coded_increments
        )
        if not updates:
            return params
        t0 = time.perf_counter()
        out = self.exchange.fold(leaves, updates)
        self.exchange_s += time.perf_counter() - t0
        self.adopted += len(updates)
        return jax.tree_util.tree_unflatten(self.layout.treedef, out)

    @property
    def _coded_increments(self) -> dict[int, int] | None:
        """Multi-process: the fragment versions whose next increment may travel as codes."""
        return self.exchange.versions if isinstance(self.exchange, DeviceExchange) else None

    def _wait_for_merge(self, round_id: int) -> None:
        """Sync mode: block until the shards published versions that include `round_id`."""
        pusher = self.pusher

        def give_up() -> bool:
            failed = pusher is not None and pusher.failure is not None
            return self.stop.is_set() or self._abandoned.is_set() or failed

        t0 = time.monotonic()  # woken by each outcome the client reports
        self.ledger.wait(lambda: self.ledger.round_done(round_id), give_up)
        self.goodput_clock.waited(time.monotonic() - t0)
        self._check_pusher()

    def _settle_resent(self, stop: threading.Event) -> None:
        """Before the first new round: wait until the re-sent deltas are resolved.

        (A shard refuses a round far below the newest it saw from this island, so
        the previous run's deltas must land first.)
        """
        if self.resending and self.ledger.wait(
            lambda: not self.ledger.resent_pending(), stop.is_set
        ):
            logger.info("island %s: the %d re-sent deltas are resolved", self.island,
                        self.resending)  # fmt: skip
            self.resending = 0

    def wait_pushed(self, timeout_s: float | None = None) -> bool:
        """Block until every delta taken so far was persisted and handed to the client.

        The exchange runs beside training (`overlap_rounds`): `step` returns once
        a round's delta is taken, and a thread frames, persists and pushes it.

        Args:
            timeout_s: the longest wait (None: until done, `stop` or the session closed).

        Returns:
            True once nothing is in flight (always, without a push thread).

        Raises:
            PushFailed: the push thread failed.
        """
        if self.pusher is None:
            return True
        done = self.pusher.wait_idle(
            lambda: self.stop.is_set() or self._abandoned.is_set(), timeout_s
        )
        if self.pusher.failure is not None:
            raise self.pusher.failure
        return done

    # -- what the caller reads ------------------------------------------------------

    @property
    def unsent(self) -> list[PushRequest]:
        """Deltas persisted but never handed to the client (a failed push; kept at close)."""
        return self.ledger.unhanded()

    def global_params(self) -> Any:
        """The newest global parameters this session adopted, as the session's tree type.

        Returns:
            The tree with numpy leaves of the original dtypes (on every process).
        """
        return self.layout.build(self.exchange.base_values(), place=False)

    @property
    def stopping(self) -> bool:
        """Whether the loop should end: `stop` is set (on process 0, as of the last step)."""
        return self._leader_stop if self.leader_sync.multi else self.stop.is_set()

    @property
    def version(self) -> int:
        """Sum over fragments of the newest global version adopted."""
        return sum(self.exchange.versions.values())

    @property
    def stats(self) -> dict[str, Any]:
        """The client's counters (bytes_sent, bytes_received, pushes, acked, pending, ...).

        Returns:
            The dict of `Client.stats` on process 0 ({} on the other processes), plus
            on every process `exchange_s` (seconds `step` spent on delta, quantize,
            encode, fold and placement, not on network waits) and `host_device_bytes`
            (bytes the exchange moved between host and device memory, both ways); with
            an outbox (process 0, a data dir) `outbox_s` (seconds spent writing and
            fsyncing it) and `outbox_bytes` (its size); with a push thread
            (`overlap_rounds` > 0) `push_thread_s` (its seconds framing, persisting and
            pushing, beside training), `rounds_in_flight` (its jobs queued or running)
            and `heap_trim_s` (its seconds handing freed C heap back to the OS).
        """
        own = {
            "exchange_s": self.exchange_s,
            "host_device_bytes": self.exchange.host_device_bytes,
        }
        if self.outbox is not None:
            own.update(outbox_s=self.outbox.persist_s, outbox_bytes=self.outbox.size)
        if self.pusher is not None:
            own.update(push_thread_s=self.pusher.busy_s, rounds_in_flight=self.pusher.in_flight,
                       heap_trim_s=self.pusher.trim_s)  # fmt: skip
        return {**(self.client.stats() if self.client is not None else {}), **own}

    def mark_start(self) -> None:
        """Warm the exchange up, then count time (goodput, metrics) from now.

        Call it after the caller's own warm-up and before a start barrier. The
        exchange's pushes and folds compile here (`warm_up`), not in the first
        rounds; the first inner step after it is an ordinary one; without it, the
        time from the join to the first `step` call is warm-up (compile) and lost.
        """
        self.warm_up()
        now = time.monotonic()
        self.goodput_clock = RoundClock(now, last_end=now, ledger=self.ledger)

    @contextlib.contextmanager
    def caller_time(self) -> Iterator[None]:
        """Time the caller's own work between `step` calls that is not training.

        Use it around an evaluation or a checkpoint of the caller's loop: its time
        is left out of goodput's time base (neither useful nor lost) and out of the
        inner step the next `step` call measures. Unmarked, the time between two
        `step` calls is inner-step time. The island daemon's global evaluation runs
        in the metrics row's hook, inside `step`, which the session times itself.

        Yields:
            None; the time inside the `with` block is the caller's.
        """
        t0 = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self.goodput_clock.caller_time(time.monotonic() - t0, between_steps=True)

    def warm_up(self) -> None:
        """Compile the exchange's pushes and folds now (once; nothing changes).

        With the device exchange: the push of a round (every fragment) and of each
        fragment alone (streaming, or a push of some fragments after a skipped push),
        the folds of the shards' int8 increments (all fragments and each one), and
        what faults call for (each fragment's fold of full values, its refund), each
        run once on copies of the state, so that none compiles mid-run: each compiled
        function stays in memory (~2 MB each for `tiny` on CPU), and islands whose
        first fault compiled them grew in steps. Every process calls it.

        Process 0 also decodes an all-zero push of the largest fragment, on this
        thread (the one that calls `step`, where a refused push is decoded for its
        refund): the codec keeps per-thread scratch (1.9 MiB, `codec.quant.workspace`)
        from its first decode on, so an island's first refused push took it mid-run:
        a step in the island's memory that an hour's soak read as growth.
        """
        if self._warm or not isinstance(self.exchange, DeviceExchange):
            return
        self._warm = True
        every = list(range(len(self.sizes)))
        # each fragment alone too: a push of some fragments (a skipped push) runs one each
        singles = [[f] for f in every]
        sets = singles if self.cfg.streaming or len(every) == 1 else [every, *singles]
        downlink = codec.int8().block_size  # the shards publish int8 increments
        fresh = self.layout.leaves(self.exchange.initial_params())  # the caller's may be donated
        self.exchange.warm(fresh, sets, [("int8", downlink)], rare=True)
        if self.client is not None:  # process 0 decodes refused pushes (`_refused`)
            largest = max(every, key=self.sizes.__getitem__)
            codec.decode(self.exchange.zero_frames(largest))

    def _check_open(self) -> None:
        if self.closed or self._abandoned.is_set():
            raise SessionClosed(self.island, abandoned=self._abandoned.is_set())

    # -- the end (`worker.session_end`) ----------------------------------------------

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["PushFailed", "Session", "SessionClosed", "TreeError", "join"]
