"""Who may send, and how fast: island ids bound to connections, and request-rate buckets.

Bindings (`Bindings`): which connection may act as an island on a shard, the
rule behind `island_in_use`. This module owns the binding of island ids to connections (a ROUTER peer
identity: one per DEALER socket) and the pure rule of when another
connection may take an id over. The core (`paramserver.server.core`) asks it for
every request that names an island.

The rule, with `quiet_s = min(TAKEOVER_INTERVALS, liveness) * heartbeat_interval_s`:

- a `hello` binds the id to its connection when the id is free, already bound
  to this connection, bound under the same `session` (the hello's optional
  token: the same client process reconnecting on a new socket), bound
  without a session to a connection silent for more than `quiet_s`, or bound
  under a session to a connection silent for more than `expire_s` =
  liveness * heartbeat_interval_s (the island is dead: until then its token
  is required, so a stranger cannot take over a live island that paused);
  otherwise it is refused `island_in_use`;
- a request from the bound connection (or for an unbound id) is served as
  usual and refreshes the binding;
- a push, heartbeat or bye from another connection is refused
  `island_in_use` while the bound one has been heard within `quiet_s`, and
  answered `unknown_island` ("say hello") once it has not, so that hello
  takes the id over;
- an *attach* hello (`attach` true) adds its connection to a binding made
  under a session, when it carries that session: the island then has several
  connections to the shard (a control connection for hello and heartbeats,
  bulk connections for pushes and snapshots), each of which acts as the
  island. At most MAX_ATTACHED are attached (the least recently heard one is
  let go for a new one); a hello that moves the id to another connection
  lets them all go (they belonged to the connection it replaces), a hello on
  the bound connection keeps them. An attach to an id that is not bound is
  refused `unknown_island` (say the plain hello first), one without the
  binding's session `island_in_use`.

Why it is sound: a live island heartbeats every interval, so its connection
is never silent for two; a second process with the same id is refused at its
join. An island that reconnects closed its old socket first, so that
connection falls silent and the new one gets the id at most `quiet_s` (plus
one heartbeat) later, at once when its hello carries the same `session`. A
dead island (liveness expired) is silent far longer than `quiet_s`.

Request limits (`Throttle`): per-island token buckets checked before a request
is decoded. They are the rule that keeps one island (or one peer sending garbage)
from starving the others of a shard's loop. Every request is charged to a
key: the island its connection said `hello` as (so a reconnect does not
refill the bucket), else the connection itself. Each key has two token
buckets, pure data refilled by `refill` from (now, bucket):

- requests: `rate` tokens per second up to `burst`. A request takes a token
  when there is one. Without one it is still served while no other key was
  heard within the last CONTENTION_S (an island alone on the shard delays
  nobody: a benchmark's single client is never throttled), and refused
  `throttled` otherwise, with `retry_after_s` = the time until the next token;
- answers: a refused request (throttled, or a header that does not decode)
  is answered while this bucket (`answers_per_s` per second, up to one
  second's worth) has a token, and dropped unanswered (counted) after, so a
  flood of garbage is answered a few times a second, not message for message.

Pushes acked in order are not charged: a request with payload frames (a push)
from an island whose last push was acked (accepted or duplicate: `pushed`)
is served without a token. An island pushes every fragment of a round at
once (120 pushes at a billion parameters per shard), which no request rate
meant for heartbeats and status should refuse, let alone drop; its pushes
are bounded instead by the pending limits (`too_many_pending`, checked
before the payload is read) and paced by its acks. A refused push (a bad
payload, a limit) puts the island back under its bucket until a push of it
is acked again, so garbage costs at most one payload check per acked push.

`decide` is the whole decision as a pure function of (now, the key's buckets,
the limits, whether others are being served: `contended`); `Throttle` keeps
the buckets of every key (those that have refilled completely are forgotten:
a full bucket equals a fresh one), the keys heard last and the
connection -> island map. The core (`paramserver.server.core`) asks it
before unpacking a request.

Bytes of replies a peer has not read yet, per connection: the bound on what a slow reader holds.

ZeroMQ bounds a peer's queued replies in messages (its high-water mark,
1000), and a snapshot piece may be ~58 MB: a client that asks pieces and
never reads would hold gigabytes of the shard's memory. So the shard counts
bytes: a reply with a large payload (a snapshot piece, a status) is charged
to its connection when the core builds it (`charge`), and, once sent, stays
counted until ZeroMQ has written it to the socket (`track` with the send's
tracker: done when ZeroMQ let go of its frames). A connection holding
`limit` bytes or more is refused `throttled` for such a request
(`admits`), with a retry after `RETRY_AFTER_S`; a connection that holds
nothing is always served one reply, so a piece larger than the limit can
still be read. A peer that disconnects frees its queued replies, and its
entries with them.

Nothing here touches a socket: a tracker is anything with a `done` property
(pyzmq's `MessageTracker`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

from paramserver.server.admission.outcomes import Outcome
from paramserver.wire.protocol import REJECTED

TAKEOVER_INTERVALS = 2  # heartbeat intervals of silence after which a binding may be taken

OWN = "own"  # the request comes from the bound connection, or the id is not bound
IN_USE = "in_use"  # the id is bound to another connection that is not silent
SAY_HELLO = "say_hello"  # bound to another connection that fell silent: hello takes it over


MAX_ATTACHED = 16  # attached connections one island may hold on a shard besides its bound one


@dataclass
class Binding:
    """The connection an island id is bound to, its attached ones, and when it was last heard.

    Attributes:
        conn: the connection whose plain hello bound the id.
        session: that hello's session token, or None.
        heard: when any of the island's connections was last heard.
        attached: connections added by an attach hello -> when each was last heard.
    """

    conn: bytes
    session: str | None
    heard: float
    attached: dict[bytes, float] = field(default_factory=dict)

    def holds(self, conn: bytes) -> bool:
        """Whether `conn` acts as the island (the bound connection or an attached one)."""
        return conn == self.conn or conn in self.attached


def may_take_over(
    now: float,
    bound: Binding | None,
    conn: bytes,
    session: str | None,
    quiet_s: float,
    expire_s: float | None = None,
) -> bool:
    """Whether a hello from `conn` may bind an island id currently bound as `bound`.

    Args:
        now: current time, seconds (the clock of `bound.heard`).
        bound: the id's binding, or None when it is free.
        conn: the connection saying hello.
        session: the hello's session token, or None.
        quiet_s: silence after which a binding without a session may be taken over.
        expire_s: silence after which a binding under a session expires (the
            island is dead) and any hello may take it; None: `quiet_s`.

    Returns:
        True when the id is free, bound to `conn`, bound under the same non-empty
        session, or its connection has been silent for more than `quiet_s`
        (no session) or `expire_s` (a session: its token is needed until then).
    """
    if bound is None or bound.holds(conn):
        return True
    if session is not None and session == bound.session:
        return True
    if bound.session is not None and expire_s is not None:
        return now - bound.heard > expire_s
    return now - bound.heard > quiet_s


class Bindings:
    """Island id -> Binding on one shard (not persisted: islands say hello after a restart)."""

    def __init__(self, heartbeat_interval_s: float, liveness: int) -> None:
        """Set the takeover silence from the shard's heartbeat settings.

        Args:
            heartbeat_interval_s: the shard's heartbeat interval, > 0.
            liveness: intervals of silence after which an island is dead, >= 1.
        """
        self.quiet_s = min(TAKEOVER_INTERVALS, liveness) * heartbeat_interval_s
        self.expire_s = liveness * heartbeat_interval_s  # a session's id: until the island is dead
        self._bound: dict[str, Binding] = {}

    def may_bind(self, island: str, conn: bytes, session: str | None, now: float) -> bool:
        """Whether a hello from `conn` may take `island` (see `may_take_over`).

        Args:
            island: island id.
            conn: the ROUTER identity of the connection.
            session: the hello's session token, or None.
            now: current time, seconds.

        Returns:
            Whether to bind; refuse with island_in_use otherwise.
        """
        bound = self._bound.get(island)
        return may_take_over(now, bound, conn, session, self.quiet_s, self.expire_s)

    def bind(self, island: str, held: Binding) -> None:
        """Bind `island` (after its hello was welcomed).

        A hello on the connection already bound keeps the attached connections;
        one that moves the id lets them go.

        Args:
            island: island id.
            held: its connection, session and the time of the hello.
        """
        old = self._bound.get(island)
        if old is not None and old.conn == held.conn and not held.attached:
            held.attached = old.attached
        self._bound[island] = held

    def attach_refusal(self, island: str, session: str | None) -> str | None:
        """Why an attach hello for `island` with `session` is refused (None: attach it).

        Args:
            island: island id.
            session: the attach hello's session token, or None.

        Returns:
            None, "unknown_island" (the id is not bound here: say the plain hello
            first) or "island_in_use" (bound without a session, or under another).
        """
        bound = self._bound.get(island)
        if bound is None:
            return "unknown_island"
        if session is None or session != bound.session:
            return "island_in_use"
        return None

    def attach(self, island: str, conn: bytes, now: float) -> bytes | None:
        """Add `conn` to `island`'s connections (after `attach_refusal` said None).

        Args:
            island: a bound island id.
            conn: the connection of the attach hello.
            now: current time, seconds.

        Returns:
            The attached connection let go to make room (MAX_ATTACHED), or None.
        """
        bound = self._bound[island]
        bound.heard = max(bound.heard, now)
        if conn == bound.conn:
            return None
        bound.attached[conn] = now
        if len(bound.attached) <= MAX_ATTACHED:
            return None
        oldest = min(bound.attached, key=bound.attached.__getitem__)
        del bound.attached[oldest]
        return oldest

    def connections(self, island: str) -> int:
        """How many connections act as `island` (its bound one and the attached ones; 0: unbound)."""
        bound = self._bound.get(island)
        return 0 if bound is None else 1 + len(bound.attached)

    def verdict(self, island: str, conn: bytes, now: float) -> str:
        """How to treat a request (other than hello) for `island` from `conn`; refreshes its own.

        Args:
            island: island id.
            conn: the ROUTER identity of the connection.
            now: current time, seconds.

        Returns:
            OWN (serve it), IN_USE (refuse it) or SAY_HELLO (answer unknown_island).
        """
        bound = self._bound.get(island)
        if bound is None:
            return OWN
        if bound.holds(conn):
            bound.heard = max(bound.heard, now)
            if conn in bound.attached:
                bound.attached[conn] = max(bound.attached[conn], now)
            return OWN
        return SAY_HELLO if now - bound.heard > self.quiet_s else IN_USE

    def in_use_detail(self, island: str, now: float) -> str:
        """The refusal's detail: which id, since when its connection was heard, what to do.

        Args:
            island: a bound island id.
            now: current time, seconds.

        Returns:
            A one-line explanation.
        """
        bound = self._bound.get(island)
        ago = now - bound.heard if bound is not None else 0.0
        if bound is not None and bound.session is not None:
            return (
                f"island {island!r} is bound to another connection under a session (heard "
                f"{ago:.1f} s ago): run each island under its own id; a reconnect needs the "
                f"same session token, or the old connection silent for {self.expire_s:g} s"
            )
        return (
            f"island {island!r} is live on another connection (heard {ago:.1f} s ago): "
            "run each island under its own id; a reconnect is let in once the old "
            f"connection is silent for {self.quiet_s:g} s"
        )

    def forget(self, island: str) -> None:
        """Drop `island`'s binding (after its bye).

        Args:
            island: island id.
        """
        self._bound.pop(island, None)

    def prune(self, keep: Container[str]) -> None:
        """Drop the bindings of ids the shard no longer knows (forgotten dead islands).

        Args:
            keep: the ids to keep.
        """
        for gone in [i for i in self._bound if i not in keep]:
            del self._bound[gone]

    def __len__(self) -> int:
        return len(self._bound)


ADMIT, ANSWER, DROP = "admit", "answer", "drop"
Key = bytes | str  # what a request is charged to: an island id, or a connection
Verdict = Literal["admit", "answer", "drop"]
PRUNE_AT = 1024  # keys kept before full buckets are looked for and forgotten
CONTENTION_S = 1.0  # another key heard this recently: the shard is shared, limits apply
LAST_KEYS = 3  # keys heard last that are remembered (`heard`)


@dataclass(frozen=True)
class Limits:
    """A shard's request limits (ShardConfig's max_requests_per_s, request_burst, max_refusals_per_s).

    Attributes:
        rate: requests per second one key may send while others are served; 0 = no limit.
        burst: requests above `rate` one key may send at once (the bucket's size).
        answers_per_s: answers per second to one key's refused requests; 0 = answer all.
    """

    rate: float
    burst: int
    answers_per_s: float

    @property
    def answer_burst(self) -> float:
        """The answers bucket's size: one second's worth, at least one answer."""
        return max(1.0, self.answers_per_s)


class Bucket(NamedTuple):
    """A token bucket: `tokens` as of time `at` (seconds). (A tuple: one is made per request.)"""

    tokens: float
    at: float


def refill(bucket: Bucket | None, now: float, rate: float, size: float) -> Bucket:
    """The bucket at `now`: `rate` tokens per second added since `at`, at most `size`.

    Args:
        bucket: the bucket as last stored (None: a fresh, full one).
        now: seconds (an earlier time than `at` adds nothing).
        rate: tokens per second, > 0.
        size: the most tokens it holds.

    Returns:
        Bucket(min(size, tokens + rate * (now - at)), now).
    """
    if bucket is None:
        return Bucket(float(size), now)
    gained = rate * max(0.0, now - bucket.at)
    return Bucket(min(float(size), bucket.tokens + gained), max(now, bucket.at))


def contended(last: Sequence[tuple[Key, float]], key: Key, now: float) -> bool:
    """Whether a key other than `key` was heard within CONTENTION_S of `now`.

    Args:
        last: (key, when last heard) of the keys heard last, newest first
            (`heard` keeps it); the newest other key is one of them.
        key: the key of the request at hand.
        now: seconds.

    Returns:
        True when the newest key other than `key` was heard at `now - CONTENTION_S` or later.
    """
    for other, when in last:
        if other != key:
            return now - when <= CONTENTION_S
    return False


def heard(last: Sequence[tuple[Key, float]], key: Key, now: float) -> tuple[tuple[Key, float], ...]:
    """The LAST_KEYS keys heard last, newest first, after a request of `key` at `now`.

    More than two are kept so that a `rekey` merging two of them (a connection
    and the island it said hello as) still leaves the newest other key.

    Args:
        last: as before it ((key, time), newest first, each key once).
        key: the request's key.
        now: seconds.

    Returns:
        ((key, now), then the other keys' entries of `last`), at most LAST_KEYS.
    """
    return ((key, now), *(entry for entry in last if entry[0] != key))[:LAST_KEYS]


def rekey(last: Sequence[tuple[Key, float]], old: Key, new: Key) -> tuple[tuple[Key, float], ...]:
    """The keys heard last once `old`'s requests are charged to `new` (a connection's hello).

    Without it the hello itself, charged to the connection before the island
    was known, would count as another key heard: the island would be judged
    contended by its own hello for CONTENTION_S.

    Args:
        last: (key, time) of the keys heard last, newest first.
        old: the key that is renamed (the connection).
        new: its new key (the island).

    Returns:
        `last` with `old` read as `new`, each key once (its newest entry).
    """
    out: list[tuple[Key, float]] = []
    for key, when in last:
        key = new if key == old else key
        if all(key != k for k, _ in out):
            out.append((key, when))
    return tuple(out)


def decide(
    requests: Bucket | None,
    answers: Bucket | None,
    now: float,
    limits: Limits,
    shared: bool,
) -> tuple[Bucket | None, Bucket | None, Verdict, float]:
    """Whether to serve one request of a key, and the key's buckets after it.

    Args:
        requests: the key's request bucket (None: fresh).
        answers: the key's answers bucket (None: fresh).
        now: seconds.
        limits: the shard's limits.
        shared: whether another key was heard lately (`contended`): only then is a
            key over its rate refused.

    Returns:
        (requests bucket, answers bucket, verdict, retry_after_s): ADMIT (serve it),
        ANSWER (refuse it `throttled`, telling it to wait retry_after_s) or DROP
        (over the answers too: no reply). retry_after_s is 0 for ADMIT, else the
        seconds until the request bucket holds a token. With rate 0 every request
        is admitted and the buckets stay as they are.
    """
    if limits.rate <= 0:
        return requests, answers, ADMIT, 0.0
    requests = refill(requests, now, limits.rate, limits.burst)
    if requests.tokens >= 1.0:
        return Bucket(requests.tokens - 1.0, requests.at), answers, ADMIT, 0.0
    if not shared:
        return requests, answers, ADMIT, 0.0
    retry_after = (1.0 - requests.tokens) / limits.rate
    answers, answered = answer(answers, now, limits)
    return requests, answers, ANSWER if answered else DROP, retry_after


def answer(answers: Bucket | None, now: float, limits: Limits) -> tuple[Bucket | None, bool]:
    """Whether a refused request of a key may be answered, and its answers bucket after.

    Args:
        answers: the key's answers bucket (None: fresh).
        now: seconds.
        limits: the shard's limits (answers_per_s 0: always answer).

    Returns:
        (answers bucket, True when a token was taken: answer it).
    """
    if limits.answers_per_s <= 0:
        return answers, True
    answers = refill(answers, now, limits.answers_per_s, limits.answer_burst)
    if answers.tokens >= 1.0:
        return Bucket(answers.tokens - 1.0, answers.at), True
    return answers, False


class Throttle:
    """The buckets of every key of one shard, and which island each connection said hello as."""

    def __init__(self, limits: Limits) -> None:
        """Start with no key seen.

        Args:
            limits: the shard's limits.
        """
        self.limits = limits
        self._last: tuple[tuple[Key, float], ...] = ()  # the keys heard last (`heard`)
        self._requests: dict[Key, Bucket | None] = {}
        self._answers: dict[Key, Bucket | None] = {}
        self._island_of: dict[bytes, str] = {}  # connection -> island it said hello as
        self._conns_of: dict[str, set[bytes]] = {}  # island -> its connections (hello, attach)
        self._in_order: set[str] = set()  # islands whose last push was acked: pushes are free
        self._prune_at = PRUNE_AT

    def key(self, conn: bytes) -> Key:
        """What a request from `conn` is charged to: its island after a hello, else the connection."""
        return self._island_of.get(conn, conn)

    def bind(self, conn: bytes, island: str) -> None:
        """`conn` said hello as `island` (welcomed): its requests are charged to the island.

        A hello from a connection the island does not hold yet moves it there: its
        other connections are charged to themselves again.

        Args:
            conn: the connection (ROUTER identity).
            island: the island id.
        """
        if conn not in self._conns_of.get(island, ()):
            for old in self._conns_of.pop(island, set()):
                self._island_of.pop(old, None)
        self.attach(conn, island)

    def attach(self, conn: bytes, island: str) -> None:
        """`conn` was attached to `island` (an attach hello): charged to the island too.

        Args:
            conn: the connection (ROUTER identity).
            island: the island id.
        """
        before = self._island_of.get(conn)
        if before is not None and before != island:
            self._drop_conn(before, conn)
        self._island_of[conn] = island
        self._conns_of.setdefault(island, set()).add(conn)
        self._last = rekey(self._last, conn, island)

    def detach(self, conn: bytes) -> None:
        """`conn` no longer acts as its island (let go for a newer attached one)."""
        island = self._island_of.pop(conn, None)
        if island is not None:
            self._drop_conn(island, conn)

    def _drop_conn(self, island: str, conn: bytes) -> None:
        conns = self._conns_of.get(island)
        if conns is not None:
            conns.discard(conn)
            if not conns:
                del self._conns_of[island]

    def unbind(self, island: str) -> None:
        """`island` left (bye): its connections' requests are charged to each connection again."""
        for conn in self._conns_of.pop(island, set()):
            self._island_of.pop(conn, None)
        self._in_order.discard(island)

    def pushed(self, island: str, acked: bool) -> None:
        """Record how a push of `island` was answered (its next pushes are free while acked).

        Args:
            island: the pushing island.
            acked: accepted or duplicate (False: rejected).
        """
        if acked:
            self._in_order.add(island)
        else:
            self._in_order.discard(island)

    def admit(self, now: float, conn: bytes, payload: bool = False) -> tuple[Verdict, float]:
        """The verdict on one request from `conn` (see `decide`); updates the key's buckets.

        Args:
            now: seconds.
            conn: the connection it came on.
            payload: the request has payload frames (a push): free when its
                island's last push was acked (see the module docstring).

        Returns:
            (ADMIT | ANSWER | DROP, retry_after_s).
        """
        key = self.key(conn)
        shared = contended(self._last, key, now)
        self._last = heard(self._last, key, now)
        if payload and key in self._in_order:
            return ADMIT, 0.0
        requests, answers, verdict, retry = decide(
            self._requests.get(key), self._answers.get(key), now, self.limits, shared
        )
        self._store(key, requests, answers, now)
        return verdict, retry

    def may_answer(self, now: float, conn: bytes) -> bool:
        """Whether to answer a request from `conn` that is refused before it could be read.

        Args:
            now: seconds.
            conn: the connection it came on.

        Returns:
            True while the key's answers bucket has a token (one is taken).
        """
        key = self.key(conn)
        answers, answered = answer(self._answers.get(key), now, self.limits)
        self._store(key, self._requests.get(key), answers, now)
        return answered

    def _store(self, key: Key, requests: Bucket | None, answers: Bucket | None, now: float) -> None:
        if requests is not None:
            self._requests[key] = requests
        if answers is not None:
            self._answers[key] = answers
        if len(self._requests) + len(self._answers) > self._prune_at:
            self._prune(now)

    def _prune(self, now: float) -> None:
        """Forget the buckets that have refilled completely (a fresh one is the same).

        A connection whose island has no bucket left is forgotten too: its requests
        are charged to the connection's own (fresh, so equally full) bucket.
        """
        lim = self.limits
        for table, rate, size in (
            (self._requests, lim.rate, lim.burst),
            (self._answers, lim.answers_per_s, lim.answer_burst),
        ):
            full = [
                k
                for k, b in table.items()
                if b is None or refill(b, now, rate, size).tokens >= size
            ]
            for k in full:
                del table[k]
        for conn, island in list(self._island_of.items()):
            if island in self._in_order:  # its free pushes leave its bucket full
                continue
            if island not in self._requests and island not in self._answers:
                del self._island_of[conn]
                self._drop_conn(island, conn)
        self._prune_at = max(PRUNE_AT, 2 * (len(self._requests) + len(self._answers)))

    def __len__(self) -> int:
        """Keys with a bucket that is not full (as last stored)."""
        return len(set(self._requests) | set(self._answers))


RETRY_AFTER_S = 0.5  # a backlogged peer's throttled reply: ask again after this long


class Tracker(Protocol):
    """What tells when a sent message's frames were released (pyzmq's MessageTracker)."""

    @property
    def done(self) -> bool: ...  # noqa: D102


class ReplyBacklog:
    """Per-connection bytes of replies built or sent and not yet written out."""

    def __init__(self, limit: int) -> None:
        """Start empty.

        Args:
            limit: bytes one connection may hold before its large requests are
                refused; 0 = no limit.
        """
        self.limit = limit
        self._sent: dict[bytes, list[tuple[int, Any]]] = {}
        self._charged: Counter[bytes] = Counter()

    def held(self, conn: bytes) -> int:
        """Bytes of `conn`'s replies built this turn or sent and not yet written out.

        Args:
            conn: the connection (ROUTER routing id).

        Returns:
            The bytes (entries whose tracker is done are dropped).
        """
        entries = self._sent.get(conn)
        if entries:
            entries[:] = [(n, t) for n, t in entries if not t.done]
            if not entries:
                del self._sent[conn]
        return sum(n for n, _ in entries or ()) + self._charged[conn]

    def admits(self, conn: bytes) -> bool:
        """Whether a large reply to `conn` may be built now.

        Args:
            conn: the connection.

        Returns:
            True when there is no limit, or `conn` holds less than the limit.
        """
        return self.limit <= 0 or self.held(conn) < self.limit

    def charge(self, conn: bytes, nbytes: int) -> None:
        """Count a reply built for `conn` (until the turn's sends are tracked).

        Args:
            conn: the connection.
            nbytes: its payload bytes.
        """
        self._charged[conn] += nbytes

    def track(self, conn: bytes, nbytes: int, tracker: Tracker) -> None:
        """Count a sent reply until its tracker is done.

        Args:
            conn: the connection.
            nbytes: its bytes.
            tracker: done once ZeroMQ released its frames.
        """
        if not tracker.done:
            self._sent.setdefault(conn, []).append((nbytes, tracker))

    def turn_done(self) -> None:
        """Forget this turn's charges (its replies were sent, and the large ones tracked).

        Also drops what was written out for every connection (gone peers included).
        """
        self._charged.clear()
        for conn in list(self._sent):
            self.held(conn)

    def refusal(self, conn: bytes) -> Outcome:
        """The `throttled` refusal of a large request from a connection at its limit.

        Args:
            conn: the connection.

        Returns:
            A rejected `throttled` outcome with retry_after_s, not yet counted.
        """
        return Outcome(
            REJECTED,
            "throttled",
            f"{self.held(conn)} bytes of replies to this connection are not read yet "
            f"(max_unread_reply_bytes={self.limit}): read them, and ask again after "
            f"{RETRY_AFTER_S:g} s",
            retry_after_s=RETRY_AFTER_S,
        )

    def total(self) -> int:
        """Bytes held over every connection (for status)."""
        return sum(self.held(conn) for conn in list(self._sent)) + sum(self._charged.values())
