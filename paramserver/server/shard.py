"""The shard daemon's I/O loop: sockets, polling, replies and publishing.

This module owns the ZeroMQ side of one shard: a ROUTER for requests and a PUB
for sequenced updates and heartbeats (wire format: `paramserver.wire.protocol`).
What the shard knows and every rule that changes it live in
`paramserver.server.state`; durability (log, checkpoints) in `paramserver.server.durable`.
The loop stays thin:

    1. poll the ROUTER until the next policy wake-up, heartbeat or stop check;
    2. handle every queued request (up to a batch), collecting replies; each
       accepted change is appended to the write-ahead log before it is applied
       (the state's journal), so a push whose record cannot be written is
       answered `rejected` / `storage_error` and leaves no trace;
    3. step the fragments the merge policy says are due (also logged first);
    4. fsync the log once for the whole batch (group commit), then send the
       replies (an `accepted` ack is never sent before its delta is durable)
       and publish the new versions; if the fsync fails, the state is rebuilt
       from disk and the batch's accepts are answered `storage_error` instead;
    5. checkpoint when due; heartbeat on the PUB when it has been idle.

Snapshots, status and heartbeats need no disk, so they are served through
storage faults. Island ids are bound to connections (`paramserver.server.binding`)
and, under CURVE, to the keys that may use them (`paramserver.plumbing.identity`).
On stop: answer what is queued, checkpoint, close the sockets.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import zmq

import codec
from paramserver.plumbing.curve import CurveServer
from paramserver.plumbing.identity import IslandGuard
from paramserver.server import admission, binding
from paramserver.server.config import ShardConfig, bind_endpoints, local_endpoints
from paramserver.server.durable import Durability, StorageError
from paramserver.server.records import Outcome, StepUpdate
from paramserver.server.state import ShardState
from paramserver.wire import protocol
from paramserver.wire.protocol import ACCEPTED, REJECTED

logger = logging.getLogger(__name__)

# Requests handled per loop turn before stepping and syncing (bounds ack latency).
BATCH = 64
# Longest poll; bounds how late a set stop event is noticed.
STOP_CHECK_S = 0.1
# Requests that act as an island, refused from a connection the island is not bound to.
_BOUND_KINDS = ("push", "heartbeat", "bye")


class ShardServer:
    """One shard: bind, serve until a stop event, drain, checkpoint, close."""

    def __init__(
        self,
        cfg: ShardConfig,
        index: int,
        endpoints: list[tuple[str, str]] | None = None,
        router_bind: str | None = None,
        pub_bind: str | None = None,
    ) -> None:
        """Create the shard (binds nothing, reads no files yet).

        Args:
            cfg: cluster settings.
            index: this shard's index in [0, cfg.shards).
            endpoints: connect addresses [(router, pub), ...] of every shard,
                sent to islands in `welcome`; default local_endpoints(cfg).
            router_bind: ROUTER bind address; default from cfg (port + 2 * index);
                tcp://127.0.0.1:* binds a random port (see bound_endpoints).
            pub_bind: PUB bind address; default from cfg (port + 2 * index + 1).
        """
        default_router, default_pub = bind_endpoints(cfg, index)
        self.cfg = cfg
        self.index = index
        self.endpoints = endpoints if endpoints is not None else local_endpoints(cfg)
        self.router_bind = router_bind or default_router
        self.pub_bind = pub_bind or default_pub
        self.ready = threading.Event()
        self.bound_endpoints: tuple[str, str] | None = None
        self.state: ShardState | None = None
        self.seq = 0
        self._replies: list[tuple[Any, dict[str, Any], list[Any]]] = []  # sent after the sync
        self._bindings = binding.Bindings(cfg.heartbeat_interval_s, cfg.liveness)
        self._guard: IslandGuard | None = None  # under CURVE: which key may act as which island
        self._updates: list[StepUpdate] = []
        self._durable: Durability | None = None
        self._router: zmq.Socket | None = None
        self._pub: zmq.Socket | None = None
        self._last_pub = 0.0
        self._raw32 = codec.raw("float32")  # one per server: encoders keep work buffers

    # ----- lifecycle ---------------------------------------------------------------

    def serve(self, stop: threading.Event) -> None:
        """Recover state from the data dir, bind, serve until `stop` is set, then drain.

        Args:
            stop: set it (from any thread or a signal handler) to stop.

        Raises:
            DurabilityError: the data dir cannot be recovered without losing
                acknowledged data (paramserver.server.durable; the message says what to do).
            zmq.ZMQError: a bind failed (e.g. port in use).
            CurveError: CURVE is configured but a key file or the allow dir is unusable.
            OSError: the write-ahead log failed and could not even be cut back to
                its last sync; the shard stops rather than serve a state it cannot
                vouch for (other storage faults are answered `storage_error`).
        """
        self._durable = Durability(self.cfg, self.index)
        self.state = self._durable.recover()
        self.state.journal = self._durable.append
        ctx = zmq.Context()
        self._router = router = ctx.socket(zmq.ROUTER)
        self._pub = pub = ctx.socket(zmq.PUB)
        auth: CurveServer | None = None
        try:
            for sock in (router, pub):
                sock.setsockopt(zmq.LINGER, 0)
            if self.cfg.curve_secret_key_file:
                auth = CurveServer(
                    ctx,
                    self.cfg.curve_secret_key_file,
                    self.cfg.curve_allow_dir,
                    self.index,
                    self.cfg.curve_allow_map,
                ).start()
                self._guard = auth.guard
                auth.secure(router, "router")
                auth.secure(pub, "pub")
            router.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_frame_bytes)
            router.bind(self.router_bind)
            pub.bind(self.pub_bind)
            self.bound_endpoints = (
                router.getsockopt_string(zmq.LAST_ENDPOINT),
                pub.getsockopt_string(zmq.LAST_ENDPOINT),
            )
            self._last_pub = time.monotonic()
            logger.info(
                "shard %d serving on %s (pub %s)",
                self.index,
                *self.bound_endpoints,
                extra={"shard": self.index, "versions": self.state.versions()},
            )
            self.ready.set()
            while not stop.is_set():
                self._turn(self._poll_timeout_ms())
            self._drain()
            self._durable.checkpoint(self.state, time.time())
        finally:
            if auth is not None:
                auth.stop()
            router.close(0)
            pub.close(0)
            ctx.term()
            self._durable.close()
            logger.info("shard %d stopped", self.index, extra={"shard": self.index})

    def _poll_timeout_ms(self) -> int:
        assert self.state is not None
        now = time.time()
        _, wake = self.state.due_fragments(now)
        timeout = STOP_CHECK_S
        timeout = min(timeout, self._last_pub + self.cfg.heartbeat_interval_s - time.monotonic())
        if wake is not None:
            timeout = min(timeout, wake - now)
        return max(0, int(timeout * 1000) + 1)

    def _turn(self, timeout_ms: int) -> None:
        """One loop turn: receive a batch, step, sync, reply, publish, checkpoint."""
        assert self.state and self._router and self._durable
        handled = 0
        while handled < BATCH and self._router.poll(timeout_ms if handled == 0 else 0):
            self._handle(self._router.recv_multipart(copy=False))
            handled += 1
        now = time.time()
        due, _ = self.state.due_fragments(now)
        for fragment in due:
            try:
                _, update = self.state.step(fragment, now)
            except StorageError:
                break  # not logged, not applied: the fragment is due again next turn
            self._updates.append(update)
        self._sync()
        self._flush()
        self._durable.maybe_checkpoint(self.state, now)
        if time.monotonic() - self._last_pub >= self.cfg.heartbeat_interval_s:
            self._publish({"kind": "heartbeat", "shard": self.index, "seq": self.seq})

    def _drain(self) -> None:
        """Answer every request already queued, without waiting for more."""
        assert self._router and self._durable
        while self._router.poll(0):
            self._handle(self._router.recv_multipart(copy=False))
        self._sync()
        self._flush()

    def _sync(self) -> None:
        """fsync the batch; if that fails, take back what it would have made durable.

        The log was cut back to the previous sync, so the state is rebuilt from
        disk, the batch's updates are dropped unpublished, and its `accepted`
        and `duplicate` acks (and an `init_ok`) become `storage_error` refusals
        that the islands send again.
        """
        assert self._durable and self.state
        try:
            self._durable.sync()
            return
        except StorageError as exc:
            error = exc
        self.state = self._durable.reload(self.state)
        self.state.journal = self._durable.append
        self._updates.clear()
        detail = f"{error}: not durable; send it again"
        versions = self.state.versions()
        replies = []
        for ident, header, payload in self._replies:
            refusal = storage_refusal(header, detail, versions)
            if refusal is not None:
                self.state.counters.count_rejection("storage_error")
                header, payload = refusal, []
            replies.append((ident, header, payload))
        self._replies = replies

    def _flush(self) -> None:
        assert self._router and self.state
        for ident, header, payload in self._replies:
            frames = protocol.pack(header, payload)
            self.state.counters.bytes_out += protocol.message_bytes(frames)
            self._router.send_multipart([ident, *frames], copy=False)
        self._replies.clear()
        for update in self._updates:
            self.seq += 1
            if update.frames is None:
                mode, (frames, _) = (
                    protocol.UPDATE_FULL,
                    self._raw32.encode({"values": update.values}),
                )
            else:
                mode, frames = protocol.UPDATE_INCREMENT, list(update.frames)
            self._publish(
                {
                    "kind": "update",
                    "shard": self.index,
                    "seq": self.seq,
                    "fragment": update.fragment,
                    "version": update.version,
                    "mode": mode,
                    "credited": update.credited,
                },
                frames,
            )
        self._updates.clear()

    def _publish(self, header: dict[str, Any], payload: list[Any] = ()) -> None:
        assert self._pub and self.state
        frames = protocol.pack(header, payload)
        self._pub.send_multipart(frames, copy=False)
        self.state.counters.bytes_out += protocol.message_bytes(frames)
        self._last_pub = time.monotonic()

    # ----- requests ----------------------------------------------------------------

    def _handle(self, frames: list[Any]) -> None:
        assert self.state
        ident, body = frames[0], frames[1:]
        size = protocol.message_bytes(body)
        self.state.counters.bytes_in += size
        try:
            header, payload = protocol.unpack(body)
        except protocol.ProtocolError as exc:
            self.state.reject(exc.reason, exc.detail)
            self._reply(ident, exc.header, "rejected", reason=exc.reason, detail=exc.detail)
            return
        now = time.time()
        island, kind = header.get("island"), header["kind"]
        if self._guard is not None and isinstance(island, str):
            refusal = self._guard.refusal(_user_id(body[0]), island, kind, now)
            if refusal is not None:  # before the binding: it neither refreshes nor takes the id
                self._answer(ident, header, self.state.reject("forbidden_island", refusal))
                return
        known = True
        if isinstance(island, str) and kind != "hello":
            verdict = self._bindings.verdict(island, bytes(ident), now)
            if verdict == binding.IN_USE and kind in _BOUND_KINDS:
                detail = self._bindings.in_use_detail(island, now)
                self._answer(ident, header, self.state.reject("island_in_use", detail))
                return
            known = verdict == binding.OWN and self.state.touch(island, now, header)
        too_big = admission.oversize(self.state, size)
        if too_big is not None:
            self._answer(ident, header, self.state.count_outcome(too_big))
            return
        try:
            handler = getattr(self, f"_on_{header['kind']}")
            handler(ident, header, payload, now, known)
        except (OSError, zmq.ZMQError):
            raise
        except Exception as exc:  # a bug must not take the shard down; it is counted
            logger.exception("shard %d: error handling %s", self.index, header["kind"])
            outcome = self.state.reject("internal_error", f"{type(exc).__name__}: {exc}")
            self._answer(ident, header, outcome)

    def _reply(
        self, ident: Any, request: dict | None, kind: str, payload: list[Any] = (), **fields: Any
    ) -> None:
        self._replies.append((ident, protocol.reply_header(request, kind, **fields), list(payload)))

    def _answer(self, ident: Any, header: dict, outcome: Outcome) -> None:
        """Reply to a request with its outcome: `ack` for a push, else `rejected`."""
        assert self.state
        if header.get("kind") == "push":
            version = self.state.versions().get(header["fragment"], 0)
            detail = {"detail": outcome.detail} if outcome.status == REJECTED else {}
            self._reply(
                ident,
                header,
                "ack",
                round=header["round"],
                fragment=header["fragment"],
                outcome=outcome.status,
                reason=outcome.reason,
                version=outcome.version or version,
                merged_version=outcome.merged_version,
                **detail,
            )
        else:
            self._reply(ident, header, "rejected", reason=outcome.reason, detail=outcome.detail)

    def _on_hello(self, ident: Any, header: dict, payload: list, now: float, known: bool) -> None:
        assert self.state
        island, conn, session = header["island"], bytes(ident), header.get("session")
        if not self._bindings.may_bind(island, conn, session, now):
            detail = self._bindings.in_use_detail(island, now)
            self._answer(ident, header, self.state.reject("island_in_use", detail))
            return
        outcome = self.state.hello(island, now)
        if outcome.status == REJECTED:
            self._answer(ident, header, outcome)
            return
        self._bindings.bind(island, binding.Binding(conn, session, now))
        if len(self._bindings) > len(self.state.last_seen):
            self._bindings.prune(self.state.last_seen)
        plan = self.state.plan
        fields: dict[str, Any] = {
            "shard": self.index,
            "num_shards": self.cfg.shards,
            "num_fragments": self.cfg.num_fragments,
            "endpoints": [list(e) for e in self.endpoints],
            "initialized": plan is not None,
            "plan_hash": plan.hash if plan else None,
            "heartbeat_interval_s": self.cfg.heartbeat_interval_s,
            "liveness": self.cfg.liveness,
            "seq": self.seq,
            "mode": self.cfg.mode,
            "max_message_bytes": self.cfg.max_message_bytes,
        }
        if plan is not None:
            fields["plan"] = plan.to_wire()
        self._reply(ident, header, "welcome", **fields)

    def _on_init(self, ident: Any, header: dict, payload: list, now: float, known: bool) -> None:
        assert self.state
        try:
            outcome = self.state.initialize(header["plan"], payload)
        except StorageError as exc:
            outcome = self.state.reject("storage_error", f"{exc}: not initialized; try again")
        if outcome.status != ACCEPTED:
            self._answer(ident, header, outcome)
            return
        versions = protocol.versions_to_wire(self.state.versions())
        self._reply(ident, header, "init_ok", versions=versions)

    def _on_snapshot(
        self, ident: Any, header: dict, payload: list, now: float, known: bool
    ) -> None:
        assert self.state
        refusal = admission.snapshot_refusal(self.state, header["fragment"])
        if refusal is not None:
            self._answer(ident, header, self.state.count_outcome(refusal))
            return
        version, values = self.state.snapshot(header["fragment"])
        frames, _ = self._raw32.encode({"values": values})
        self._reply(
            ident,
            header,
            "snapshot_reply",
            frames,
            fragment=header["fragment"],
            version=version,
            seq=self.seq,
        )

    def _on_push(self, ident: Any, header: dict, payload: list, now: float, known: bool) -> None:
        assert self.state
        if not known:
            outcome = self.state.count_outcome(admission.unknown_island(header["island"]))
        else:
            try:
                outcome = self.state.submit_delta(header, payload, now)
            except StorageError as exc:
                outcome = self.state.reject("storage_error", f"{exc}: not accepted; send it again")
        self._answer(ident, header, outcome)

    def _on_heartbeat(
        self, ident: Any, header: dict, payload: list, now: float, known: bool
    ) -> None:
        assert self.state
        if not known:
            self._answer(
                ident, header, self.state.count_outcome(admission.unknown_island(header["island"]))
            )
            return
        credited = self.state.counters.credited.get(header["island"], 0.0)
        self._reply(ident, header, "heartbeat", shard=self.index, seq=self.seq, credited=credited)

    def _on_status(self, ident: Any, header: dict, payload: list, now: float, known: bool) -> None:
        assert self.state
        status = self.state.status(now)
        status["seq"] = self.seq
        status["endpoints"] = [list(e) for e in self.endpoints]  # the cluster map, without hello
        self._reply(ident, header, "status_reply", status=status)

    def _on_bye(self, ident: Any, header: dict, payload: list, now: float, known: bool) -> None:
        assert self.state
        if known:  # a bye from a connection that lost the id to another changes nothing
            self.state.bye(header["island"])
            self._bindings.forget(header["island"])
        self._reply(ident, header, "bye_ok")


def _user_id(frame: Any) -> str | None:
    """The ZAP User-Id (the client's z85 public key) of a received frame, if it has one."""
    try:
        return frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None


def storage_refusal(
    reply: dict[str, Any], detail: str, versions: dict[int, int]
) -> dict[str, Any] | None:
    """The `storage_error` refusal replacing a reply that promised durability, if it did.

    Args:
        reply: a reply header not yet sent (`accepted` / `duplicate` acks and
            `init_ok` promise that something is on disk).
        detail: the refusal's detail.
        versions: the fragments' versions after the state was rebuilt.

    Returns:
        The replacement header (same `id`), or None to send `reply` as it is.
    """
    echo = {"id": reply["id"]} if "id" in reply else {}
    if reply["kind"] == "ack" and reply["outcome"] != REJECTED:
        version = versions.get(reply["fragment"], 0)
        fields = {"reason": "storage_error", "detail": detail, "merged_version": None}
        return {**reply, "outcome": REJECTED, "version": version, **fields}
    if reply["kind"] == "init_ok":
        return {"kind": "rejected", "reason": "storage_error", "detail": detail, **echo}
    return None
