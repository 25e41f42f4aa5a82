"""A deterministic simulation of a cluster for the client's sans-I/O core: no sockets, no threads.

`Sim` drives one `ClientCore` against scripted shards (`SimShard`) with a fake
clock: it performs the core's effects (links are entries of a dict), carries
each message through `protocol.pack`/`unpack` as bytes, and lets a test drop,
duplicate, hold back or reorder messages. A `SimShard` speaks the protocol as
docs/protocol.md writes it (welcome, init in pieces, snapshot_reply in pieces, ack with dedup,
heartbeat, published updates in "full" or int8 "increment" mode); it is a test peer of the
client, not a model of our shard's merge rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import codec
from paramserver.client.core import ClientCore
from paramserver.client.shards import Close, Open, Send
from paramserver.client.types import ClientConfig, PushRequest
from paramserver.wire import protocol
from paramserver.wire.plan import Plan

_RAW = codec.raw("float32")
_INT8 = codec.int8()


@dataclass
class SimShard:
    """One scripted shard: its state, what it received, and whether it answers."""

    index: int
    plan: Plan
    heartbeat_interval_s: float = 1.0
    liveness: int = 5
    initialized: bool = False
    answering: bool = True  # False: requests are swallowed (a stopped or dead process)
    values: dict[int, np.ndarray] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)
    seq: int = 0
    keys: set = field(default_factory=set)  # (island, round, fragment) accepted
    known: set = field(default_factory=set)  # islands said hello since the (re)start
    received: list[dict] = field(default_factory=list)  # every request header, in order
    refuse: dict[str, dict] = field(default_factory=dict)  # kind -> rejected reply fields
    # the next pushes' refusals: a reason, or a dict of the ack's fields (reason, retry_after_s)
    push_refusals: list[str | dict] = field(default_factory=list)
    init_owner: str | None = None  # the island whose init_begin was taken
    max_message_bytes: int | None = None  # sent in the welcome when set
    partial: dict[int, dict[int, np.ndarray]] = field(default_factory=dict)  # init pieces in

    @property
    def router(self) -> str:
        return f"inproc://shard-{self.index}-router"

    @property
    def pub(self) -> str:
        return f"inproc://shard-{self.index}-pub"

    def own(self) -> list[int]:
        return [f.index for f in self.plan.fragments_of(self.index)]

    def init_with(self, flat: dict[str, np.ndarray]) -> None:
        """Initialise as if an island had sent `flat` (version 0)."""
        for f in self.own():
            self.values[f] = self.plan.gather(flat, f).astype(np.float32)
            self.versions[f] = 0
        self.initialized = True

    def restart(self) -> None:
        """A restart that recovered its state: it knows no island, its PUB seq starts over."""
        self.known.clear()
        self.seq = 0

    def welcome(self, endpoints: list[list[str]]) -> dict[str, Any]:
        return {
            "kind": "welcome",
            "shard": self.index,
            "num_shards": self.plan.num_shards,
            "num_fragments": self.plan.num_fragments,
            "endpoints": endpoints,
            "initialized": self.initialized,
            "plan_hash": self.plan.hash if self.initialized else None,
            **({"plan": self.plan.to_wire()} if self.initialized else {}),
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "liveness": self.liveness,
            "seq": self.seq,
            "mode": "async",
            **({"max_message_bytes": self.max_message_bytes} if self.max_message_bytes else {}),
        }

    def handle(self, header: dict, payload: list, endpoints: list[list[str]]) -> list[list[Any]]:
        """Replies (packed) to one request."""
        self.received.append(header)
        kind = header["kind"]
        rid = {"id": header["id"]} if "id" in header else {}
        if kind in self.refuse:
            return [protocol.pack({"kind": "rejected", **rid, **self.refuse[kind]})]
        if kind == "hello":
            self.known.add(header["island"])
            return [protocol.pack({**self.welcome(endpoints), **rid})]
        if kind in ("init_begin", "init_piece"):
            return [protocol.pack({**self._init(header, payload), **rid})]
        if kind == "snapshot":
            f = header["fragment"]
            lo = header.get("offset", 0)
            hi = lo + header.get("count", len(self.values[f]))
            frames, _ = _RAW.encode({"values": self.values[f][lo:hi]})
            reply = {"kind": "snapshot_reply", "fragment": f, "version": self.versions[f]}
            fields = {"seq": self.seq, "offset": lo, "size": len(self.values[f])}
            return [protocol.pack({**reply, **fields, **rid}, frames)]
        if kind == "push":
            if header["island"] not in self.known:
                ack = {"outcome": "rejected", "reason": "unknown_island", "detail": "sim"}
            elif self.push_refusals:
                refusal = self.push_refusals.pop(0)
                fields = refusal if isinstance(refusal, dict) else {"reason": refusal}
                ack = {"outcome": "rejected", "detail": "sim", **fields}
            else:
                key = (header["island"], header["round"], header["fragment"])
                outcome = "duplicate" if key in self.keys else "accepted"
                self.keys.add(key)
                ack = {"outcome": outcome, "reason": None}
            f = header["fragment"]
            fields = {"round": header["round"], "fragment": f, "version": self.versions[f]}
            return [protocol.pack({"kind": "ack", **rid, **fields, **ack})]
        if kind == "heartbeat":
            return [
                protocol.pack({"kind": "heartbeat", "shard": self.index, "seq": self.seq, **rid})
            ]
        if kind == "bye":
            self.known.discard(header["island"])
            return [protocol.pack({"kind": "bye_ok", **rid})]
        return []

    def _init(self, header: dict, payload: list) -> dict:
        """The reply to an init_begin or init_piece (pieces as docs/protocol.md 3.2 cuts them)."""
        if self.initialized:
            if self.init_owner == header["island"] and header["kind"] == "init_piece":
                return {"kind": "init_ok", "versions": protocol.versions_to_wire(self.versions)}
            return {"kind": "rejected", "reason": "already_initialized", "detail": "sim"}
        if header["kind"] == "init_begin":
            if self.init_owner not in (None, header["island"]):
                return {"kind": "rejected", "reason": "already_initialized", "detail": "sim"}
            self.init_owner = header["island"]
            self.partial = {f: {} for f in self.own()}
            missing = sum(self.plan.fragments[f].size for f in self.own())
            return {"kind": "init_begun", "plan_hash": self.plan.hash, "missing": missing}
        f, offset = header["fragment"], header["offset"]
        self.partial[f][offset] = np.asarray(codec.decode(payload)["values"], np.float32)
        got = {g: sum(len(v) for v in self.partial[g].values()) for g in self.own()}
        missing = sum(self.plan.fragments[g].size - got[g] for g in self.own())
        if missing:
            count = len(self.partial[f][offset])
            return {"kind": "init_piece_ok", "fragment": f, "offset": offset, "count": count,
                    "missing": missing}  # fmt: skip
        for g in self.own():
            self.values[g] = np.concatenate([v for _, v in sorted(self.partial[g].items())])
            self.versions[g] = 0
        self.initialized = True
        return {"kind": "init_ok", "versions": protocol.versions_to_wire(self.versions)}

    def step(self, fragment: int, values: np.ndarray) -> list[Any]:
        """A new version of `fragment`: the update message to publish (mode "full")."""
        self.values[fragment] = np.asarray(values, np.float32)
        frames, _ = _RAW.encode({"values": self.values[fragment]})
        return self._update(fragment, "full", frames)

    def step_increment(self, fragment: int, change: np.ndarray) -> list[Any]:
        """A new version of `fragment` by the int8 codes of `change` (mode "increment")."""
        frames, _ = _INT8.encode({"values": np.asarray(change, np.float32)})
        step = codec.decode(frames)["values"]
        self.values[fragment] = np.add(self.values[fragment], step, dtype=np.float32)
        return self._update(fragment, "increment", frames)

    def _update(self, fragment: int, mode: str, frames: list[Any]) -> list[Any]:
        self.seq += 1
        self.versions[fragment] += 1
        header = {
            "kind": "update",
            "shard": self.index,
            "seq": self.seq,
            "fragment": fragment,
            "version": self.versions[fragment],
            "mode": mode,
        }
        return protocol.pack(header, frames)


Fault = Callable[[str, dict], str]
"""fault(direction, header) -> "deliver" | "drop" | "twice" | "hold": what the network does
with one message ("up": client -> shard, "down": shard -> client)."""


class Sim:
    """One `ClientCore` and its scripted shards on a fake clock and a fake network."""

    def __init__(self, cfg: ClientConfig, shards: list[SimShard], session: str = "s1") -> None:
        self.cfg = cfg
        self.core = ClientCore(cfg, session)
        self.shards = shards
        self.now = 0.0
        self.links: dict[int, tuple[str, str]] = {}  # link -> (role, endpoint)
        self.inbox: list[tuple[int, list[Any]]] = []  # (link, frames) on their way to the core
        self.held: list[tuple[int, list[Any]]] = []  # messages a fault holds back
        self.sent: list[dict] = []  # every request header the core sent, in order
        self.sent_at: list[float] = []  # when each of `sent` went out
        self.sent_to: list[str] = []  # the endpoint each of `sent` went to
        self.fault: Fault = lambda direction, header: "deliver"
        self.opened: list[tuple[str, str]] = []  # (role, endpoint) of every Open
        self._pub_beat = {s.index: 0.0 for s in shards}

    def endpoints(self) -> list[list[str]]:
        return [[s.router, s.pub] for s in self.shards]

    def _shard_at(self, endpoint: str) -> SimShard | None:
        for s in self.shards:
            if endpoint in (s.router, s.pub):
                return s
        return None

    def perform(self, effects: list) -> None:
        """Carry out the core's effects: open and close links, deliver requests."""
        for effect in effects:
            if isinstance(effect, Open):
                self.links[effect.link] = (effect.role, effect.endpoint)
                self.opened.append((effect.role, effect.endpoint))
            elif isinstance(effect, Close):
                self.links.pop(effect.link, None)
            elif isinstance(effect, Send):
                went_out = effect.link in self.links
                self.core.on_sent(effect, went_out, self.now)
                if went_out:
                    self._deliver_up(effect.link, [bytes(memoryview(f)) for f in effect.frames])

    def _deliver_up(self, link: int, frames: list[bytes]) -> None:
        header, payload = protocol.unpack(frames, protocol.REQUEST)
        self.sent.append(header)
        self.sent_at.append(self.now)
        self.sent_to.append(self.links[link][1])
        what = self.fault("up", header)
        shard = self._shard_at(self.links[link][1])
        if what == "drop" or shard is None or not shard.answering:
            return
        for _ in range(2 if what == "twice" else 1):
            for reply in shard.handle(header, payload, self.endpoints()):
                self._queue_down(link, reply)

    def _queue_down(self, link: int, frames: list[Any]) -> None:
        frames = [bytes(memoryview(f)) for f in frames]
        header, _ = protocol.unpack(
            frames, protocol.PUB if self.links[link][0] == "sub" else protocol.REPLY
        )
        what = self.fault("down", header)
        if what == "drop":
            return
        if what == "hold":
            self.held.append((link, frames))
            return
        self.inbox.extend([(link, frames)] * (2 if what == "twice" else 1))

    def release_held(self, reverse: bool = False) -> None:
        """Deliver the held messages (in reverse order: reordering)."""
        held, self.held = self.held, []
        self.inbox.extend(reversed(held) if reverse else held)

    def publish(
        self, shard: SimShard, fragment: int, values: np.ndarray, increment: bool = False
    ) -> None:
        """The shard steps `fragment` and publishes the update to every SUB of it.

        `increment`: `values` is the change (sent as int8 codes), not the new values.
        """
        frames = (shard.step_increment if increment else shard.step)(fragment, values)
        for link, (role, endpoint) in list(self.links.items()):
            if role == "sub" and endpoint == shard.pub:
                self._queue_down(link, frames)

    def _pub_heartbeats(self) -> None:
        for shard in self.shards:
            if shard.answering and self.now >= self._pub_beat[shard.index]:
                self._pub_beat[shard.index] = self.now + shard.heartbeat_interval_s
                beat = protocol.pack({"kind": "heartbeat", "shard": shard.index, "seq": shard.seq})
                for link, (role, endpoint) in list(self.links.items()):
                    if role == "sub" and endpoint == shard.pub:
                        self._queue_down(link, beat)

    def push(self, fragment: int, round: int, values: np.ndarray, base_version: int = 0) -> None:
        """`Client.push` of a raw float32 delta, as the API calls the core."""
        frames, _ = _RAW.encode({"delta": np.asarray(values, np.float32)})
        request = PushRequest(fragment, round, base_version, 100, 10, list(frames))
        self.perform(self.core.push(self.now, request))
        self.pump()

    def pump(self) -> None:
        """Hand the core every queued message (and the replies that causes), at `now`."""
        while self.inbox:
            link, frames = self.inbox.pop(0)
            if link in self.links:  # a closed link delivers nothing
                self.perform(self.core.on_message(self.now, link, frames))

    def run(self, seconds: float, step_s: float = 0.05) -> None:
        """Advance the clock by `seconds`, ticking the core every `step_s`."""
        end = self.now + seconds
        while self.now < end - 1e-9:
            self.now = round(self.now + step_s, 9)
            self._pub_heartbeats()
            self.pump()
            self.perform(self.core.on_tick(self.now))
            self.pump()

    def join(self, flat: dict[str, np.ndarray], max_s: float = 10.0):
        """Start a join and run until it ends; its outcome (JoinResult or ClientError)."""
        self.perform(self.core.start_join(self.now, flat))
        self.pump()
        end = self.now + max_s
        while self.core.join_outcome is None and self.now < end:
            self.run(0.05)
        return self.core.join_outcome

    def kinds(self, kind: str) -> list[dict]:
        """The requests of `kind` the core sent, in order."""
        return [h for h in self.sent if h["kind"] == kind]

    def times(self, kind: str) -> list[float]:
        """When each request of `kind` went out."""
        return [t for t, h in zip(self.sent_at, self.sent, strict=True) if h["kind"] == kind]
