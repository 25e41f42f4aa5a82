"""The wire protocol between islands and shards: the one place the message format is described.

This module owns the message kinds, the header schema of each kind, the
protocol version and the rejection reasons, plus `pack` / `unpack`. It does no
I/O; shards and clients call it on the frames they send and receive.

Framing
=======

Every message is one multipart ZeroMQ message. Frame 0 is a msgpack map (the
*header*, at most `MAX_HEADER_BYTES`); payload frames follow as raw bytes,
sent and received zero-copy. Where a kind carries tensors the payload is the
frames of a `codec` encoding (codec header frame + data frames), passed to
`codec.decode` as they are. Every header has:

- `v`: protocol version (int), currently `PROTOCOL_VERSION` = 1. Another
  version is rejected with reason `bad_version`.
- `kind`: message kind (str), one of the tables below.

Unknown header fields are ignored, so fields may be added without a version
bump. Integers are msgpack ints (bools are not ints here); `uint` means >= 0,
`pos` means >= 1. Maps of fragment -> version have the fragment index as a
decimal *string* key (so they read the same in JSON), e.g. `{"0": 3, "2": 5}`.

Sockets
=======

Each shard `i` binds a ROUTER (requests) and a PUB (updates). An island keeps
one DEALER and one SUB per shard. A DEALER sends the header and payload frames
directly (no empty delimiter frame); the shard's ROUTER sees the peer identity
first and answers every request with exactly one reply on the same DEALER.
SUB sockets subscribe to everything (empty prefix).

Requests (DEALER -> ROUTER). Every request may carry `id` (int, chosen by
the client, echoed in the reply) and, except `status`, carries `island`
(str, 1-128 chars, the stable island id).

=========  ===========================================  ===============================
kind       header fields                                payload / reply
=========  ===========================================  ===============================
hello      island, session (optional str, 1-128 chars)  - / `welcome` or `rejected`
init       island, plan (map: `Plan.to_wire()`)         codec raw float32 tree
                                                        {"<fragment>": values} with one
                                                        1-D vector per fragment this
                                                        shard owns / `init_ok` or
                                                        `rejected`
snapshot   island, fragment (uint)                      - / `snapshot_reply`
push       island, round (uint), fragment (uint),       codec frames {"delta": vec},
           base_version (uint), tokens (pos),           any scheme, 1-D float of the
           steps (pos), plan_hash (str)                 fragment's size / `ack`
heartbeat  island                                       - / `heartbeat`
status     -                                            - / `status_reply`
bye        island                                       - / `bye_ok`
=========  ===========================================  ===============================

`push` and `heartbeat` may carry `t_step` (finite number > 0): the island's
typical inner-step time in seconds, for the adaptive grace window. `hello`
may carry `session`: a token the client draws once per process (e.g. a random
hex string) and repeats in every hello, so that a shard lets its reconnect
(a new DEALER) take the island id over at once (see "Island ids" below).

Replies (ROUTER -> DEALER), each echoing the request's `id` when it had one:

==============  ===================================================================
kind            header fields (payload)
==============  ===================================================================
welcome         shard (uint), num_shards (pos), num_fragments (pos), endpoints
                (list of [router, pub] per shard), initialized (bool), plan_hash
                (str, or nil before init), plan (map, only when initialized),
                heartbeat_interval_s (number), liveness (pos), seq (uint: last PUB seq),
                mode (optional str: the merge policy; in "sync" an island waits
                until its round is merged before starting the next),
                max_message_bytes (optional pos: the largest request the shard
                answers; a bigger push is refused `oversize`, and one over twice
                this is dropped with the connection, unanswered: refuse it locally)
init_ok         versions (map fragment -> version)
snapshot_reply  fragment, version, seq (uint: the PUB seq the snapshot includes)
                (codec raw float32 {"values": vec}: exact fp32 values)
ack             round, fragment, outcome ("accepted" | "duplicate" | "rejected"),
                reason (str or nil), version (uint: the fragment's current version),
                merged_version (optional, uint or nil: the first version of the
                fragment that includes this delta; a step merges every pending
                delta, so an accepted delta is in version + 1), detail (optional
                str: why, when the outcome is "rejected")
heartbeat       shard, seq, credited (optional number: tokens of the asking
                island that entered the model through this shard, each delta's
                tokens x its staleness factor x the fragment's share of the model)
status_reply    status (map, see `ShardState.status`, plus seq and endpoints: the
                cluster map as in the welcome, so status needs no hello)
bye_ok          -
rejected        reason (str, one of `REASONS`), detail (str, human-readable)
==============  ===================================================================

Islands are known to a shard from their `hello` until they say `bye`, or
until they are dead and the shard needs room for a new island; a shard that
restarted knows nobody. A `push` or `heartbeat` from an island the shard does
not know is refused with `unknown_island`: say `hello` again, then resend
(a shard's status counts these as `hello_requests`, not as rejections: they
are expected after a restart and before an island's first hello there).
`snapshot` and `status` need no `hello`.

A push that parses is always answered by `ack` (outcome `rejected` with a
reason when refused); any other request that cannot be parsed or is refused
is answered by `rejected`. An `accepted` ack is sent only after the delta is
durable (write-ahead log fsynced). A `duplicate` ack means the idempotency key
was accepted before: the delta is not applied again. When the shard cannot
write its log (disk full, read-only, I/O error) it refuses pushes (and
`init`) with `storage_error`: nothing of the delta was kept, so keep it and
send it again after a back-off; snapshots, heartbeats and status go on.

Published messages (PUB -> SUB). `seq` increases by one per `update` per
shard, starting at 1 when the shard process starts; a subscriber that sees a
seq other than last + 1 (a gap, or a lower seq after a shard restart)
re-snapshots (Clone pattern: subscribe first, then snapshot, drop updates
with seq <= the snapshot's seq).

=========  ==============================================  ========================
kind       header fields                                   payload
=========  ==============================================  ========================
update     shard, seq, fragment, version, mode ("full":     codec frames
           payload is the new values; "increment":          {"values": vec}
           payload is the change to add to the previous
           version)
           credited (optional map island -> number: the
           cumulative `credited` of each island this step
           merged, as in the heartbeat reply)
heartbeat  shard, seq (the last update's seq; no increment)  -
=========  ==============================================  ========================

Mode "full" (downlink float32) carries exact float32 values. Mode "increment"
(downlink int8) carries the int8-encoded change from version - 1; a replica
computes `np.add(values_at_version_minus_1, decoded, dtype=float32)` and then
equals the shard bit for bit (the shard applies exactly the decoded change to
its own parameters). An increment that does not follow the replica's version is a
gap: re-snapshot.

Deduplication
=============

The idempotency key of a delta is (island, round, fragment). The shard keeps,
per (island, fragment), the newest accepted round and the accepted rounds
within a window W below it. The same key again is acked `duplicate` (not
applied twice); a round older than newest - W that is not in the table is
rejected `replayed_round` (the client drops it: it was acked long ago or is
too old to merge); unseen rounds inside the window are accepted (resends may
arrive out of order). The dedup table survives restarts (checkpoint + log).

Island ids
==========

A `hello` binds the island id to the connection (DEALER) it came on. A hello
for an id bound to another connection is refused `island_in_use`, unless
that connection has been silent for more than min(2, liveness) heartbeat
intervals or the hello carries the same `session` as the bound one; a push,
heartbeat or bye for the id from another connection is refused
`island_in_use` while the bound one is heard, and answered `unknown_island`
once it is silent (hello again to take the id over). So a second process
with the same id cannot join, and a reconnecting island gets its id back
within about two heartbeat intervals (at once with `session`).

Under CURVE, an island id is also bound to the keys that may use it: the
key file NAME.key in the shard's allow directory may act as island NAME,
plus the ids the shard's `curve_allow_map` grants it (`paramserver.plumbing.identity`).
A hello, init, push, heartbeat or bye naming another id is refused
`forbidden_island` (before any of the above). The shard's own key is
admitted and acts as no island: operator tools use it for `status`.

Sizes
=====

A shard rejects a message whose frames total more than its
`max_message_bytes` (sent in the `welcome`) with reason `oversize` (the
message was received, then dropped). Past a hard cap of twice that, ZeroMQ
itself drops the peer's connection (ZMQ_MAXMSGSIZE) without a reply; the
client reconnects and must not resend that message: check a push against the
welcome's limit before sending it. Keep messages at a few MiB: split large models into
more fragments.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

PROTOCOL_VERSION = 1

# Largest header frame accepted; headers are small (a wire plan is the biggest).
MAX_HEADER_BYTES = 4 * 1024 * 1024

REQUEST = "request"
REPLY = "reply"
PUB = "pub"

# The modes of a published update: new values, or the change from the previous version.
UPDATE_FULL, UPDATE_INCREMENT = "full", "increment"

# The outcomes of an ack (the one place they are spelled).
ACCEPTED, DUPLICATE, REJECTED = "accepted", "duplicate", "rejected"
OUTCOMES = (ACCEPTED, DUPLICATE, REJECTED)

REASONS = (
    "malformed",
    "bad_version",
    "unknown_kind",
    "not_initialized",
    "plan_mismatch",
    "unknown_fragment",
    "unknown_island",
    "bad_shape",
    "bad_dtype",
    "non_finite",
    "codec_error",
    "oversize",
    "replayed_round",
    "future_base_version",
    "too_many_islands",
    "too_many_pending",
    "already_initialized",
    "internal_error",
    "storage_error",
    "island_in_use",
    "forbidden_island",
)


class ProtocolError(ValueError):
    """A message that cannot be used: `reason` is one of REASONS, `detail` says why.

    `header` is the decoded header when decoding got that far (so a reply can
    echo its `id`), else None.
    """

    def __init__(self, reason: str, detail: str, header: Mapping[str, Any] | None = None):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.header = header


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _uint(x: object) -> bool:
    return _is_int(x) and x >= 0


def _pos(x: object) -> bool:
    return _is_int(x) and x >= 1


ISLAND_ID_MAX = 128  # longest island id, in characters


def is_island_id(x: object) -> bool:
    """Whether `x` is a valid island id: a string of 1-ISLAND_ID_MAX characters."""
    return isinstance(x, str) and 1 <= len(x) <= ISLAND_ID_MAX


def _number(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _str_or_nil(x: object) -> bool:
    return x is None or isinstance(x, str)


_CHECKS: dict[str, tuple[Callable[[object], bool], str]] = {
    "str": (lambda x: isinstance(x, str), "a string"),
    "island": (is_island_id, f"a string of 1-{ISLAND_ID_MAX} characters"),
    "uint": (_uint, "an int >= 0"),
    "pos": (_pos, "an int >= 1"),
    "int": (_is_int, "an int"),
    "number": (_number, "a number"),
    "bool": (lambda x: isinstance(x, bool), "a bool"),
    "map": (lambda x: isinstance(x, Mapping), "a map"),
    "list": (lambda x: isinstance(x, list | tuple), "a list"),
    "str?": (_str_or_nil, "a string or nil"),
    "uint?": (lambda x: x is None or _uint(x), "an int >= 0 or nil"),
    "seconds": (lambda x: _number(x) and math.isfinite(x) and x > 0, "a finite number > 0"),
}

# kind -> {required field: type name}, per role.
SCHEMAS: dict[str, dict[str, dict[str, str]]] = {
    REQUEST: {
        "hello": {"island": "island"},
        "init": {"island": "island", "plan": "map"},
        "snapshot": {"island": "island", "fragment": "uint"},
        "push": {
            "island": "island",
            "round": "uint",
            "fragment": "uint",
            "base_version": "uint",
            "tokens": "pos",
            "steps": "pos",
            "plan_hash": "str",
        },
        "heartbeat": {"island": "island"},
        "status": {},
        "bye": {"island": "island"},
    },
    REPLY: {
        "welcome": {
            "shard": "uint",
            "num_shards": "pos",
            "num_fragments": "pos",
            "endpoints": "list",
            "initialized": "bool",
            "plan_hash": "str?",
            "heartbeat_interval_s": "number",
            "liveness": "pos",
            "seq": "uint",
        },
        "init_ok": {"versions": "map"},
        "snapshot_reply": {"fragment": "uint", "version": "uint", "seq": "uint"},
        "ack": {
            "round": "uint",
            "fragment": "uint",
            "outcome": "str",
            "reason": "str?",
            "version": "uint",
        },
        "heartbeat": {"shard": "uint", "seq": "uint"},
        "status_reply": {"status": "map"},
        "bye_ok": {},
        "rejected": {"reason": "str", "detail": "str"},
    },
    PUB: {
        "update": {
            "shard": "uint",
            "seq": "uint",
            "fragment": "uint",
            "version": "uint",
            "mode": "str",
        },
        "heartbeat": {"shard": "uint", "seq": "uint"},
    },
}

# Optional fields checked when present, per role.
_OPTIONAL: dict[str, dict[str, str]] = {
    REQUEST: {"id": "int", "t_step": "seconds", "session": "island"},
    REPLY: {
        "id": "int",
        "merged_version": "uint?",
        "credited": "number",
        "max_message_bytes": "pos",
        "detail": "str",
    },
    PUB: {"credited": "map"},
}


def pack(header: Mapping[str, Any], payload: Sequence[Any] = ()) -> list[Any]:
    """Build the frames of one message.

    Args:
        header: header fields including `kind`; `v` is set to PROTOCOL_VERSION
            unless the caller set it (tests send other versions on purpose).
        payload: payload frames (bytes, memoryview, zmq.Frame), passed through
            unchanged so they are sent zero-copy.

    Returns:
        [msgpack header bytes, *payload].
    """
    if not isinstance(header.get("kind"), str):
        raise ProtocolError("malformed", f"header needs a str 'kind', got {header.get('kind')!r}")
    full = {"v": PROTOCOL_VERSION, **header}
    return [msgpack.packb(full, use_bin_type=True), *payload]


def unpack(frames: Sequence[Any], role: str = REQUEST) -> tuple[dict[str, Any], list[Any]]:
    """Decode and validate one message.

    Args:
        frames: the message frames (bytes, memoryview or zmq.Frame), without
            the ROUTER identity frame.
        role: which table the kind must come from: REQUEST (what a shard
            receives), REPLY (what a DEALER receives) or PUB (what a SUB receives).

    Returns:
        (header dict, payload frames as given).

    Raises:
        ProtocolError: reason "malformed" (no frames, header not a msgpack map,
            too big, missing or mistyped field), "bad_version" or "unknown_kind".
    """
    if role not in SCHEMAS:
        raise ValueError(f"role={role!r}: use one of {tuple(SCHEMAS)}")
    if not frames:
        raise ProtocolError("malformed", "empty message: frame 0 must be a msgpack header")
    raw = memoryview(frames[0])
    if raw.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(
            "malformed", f"header frame is {raw.nbytes} bytes; limit {MAX_HEADER_BYTES}"
        )
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises many types on garbage input
        raise ProtocolError("malformed", f"header is not msgpack: {exc!r}") from exc
    if not isinstance(header, dict):
        raise ProtocolError("malformed", f"header must be a map, got {type(header).__name__}")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            "bad_version",
            f"protocol version {version!r}; this build speaks {PROTOCOL_VERSION}",
            header,
        )
    kind = header.get("kind")
    schema = SCHEMAS[role].get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(
            "unknown_kind", f"kind {kind!r} is not a {role} kind: {sorted(SCHEMAS[role])}", header
        )
    for field, type_name in schema.items():
        if field not in header:
            raise ProtocolError("malformed", f"{kind}: missing field {field!r}", header)
        _check_field(kind, field, header[field], type_name, header)
    for field, type_name in _OPTIONAL[role].items():
        if field in header:
            _check_field(kind, field, header[field], type_name, header)
    return header, list(frames[1:])


def _check_field(kind: str, field: str, value: object, type_name: str, header: dict) -> None:
    check, what = _CHECKS[type_name]
    if not check(value):
        raise ProtocolError(
            "malformed", f"{kind}: field {field!r} must be {what}, got {value!r}", header
        )


def message_bytes(frames: Sequence[Any]) -> int:
    """Total size of a message's frames in bytes.

    Args:
        frames: bytes, memoryview or zmq.Frame objects.

    Returns:
        The sum of the frames' byte lengths.
    """
    return sum(memoryview(f).nbytes for f in frames)


def reply_header(request: Mapping[str, Any] | None, kind: str, **fields: Any) -> dict[str, Any]:
    """A reply header echoing the request's `id` when it had an int one.

    Args:
        request: the request header (or None when it could not be decoded).
        kind: the reply kind.
        **fields: the reply's fields.

    Returns:
        The header dict to `pack`.
    """
    header: dict[str, Any] = {"kind": kind, **fields}
    if request is not None and _is_int(request.get("id")):
        header["id"] = request["id"]
    return header


def versions_to_wire(versions: Mapping[int, int]) -> dict[str, int]:
    """Fragment -> version map with str keys, as sent on the wire.

    Args:
        versions: fragment index -> version.

    Returns:
        {"<fragment>": version}.
    """
    return {str(k): int(v) for k, v in sorted(versions.items())}


def versions_from_wire(obj: Mapping[Any, Any]) -> dict[int, int]:
    """Inverse of `versions_to_wire`.

    Args:
        obj: {"<fragment>": version}.

    Returns:
        fragment index -> version.

    Raises:
        ProtocolError: reason "malformed" if a key or value is not an int.
    """
    try:
        return {int(k): int(v) for k, v in obj.items()}
    except (TypeError, ValueError, AttributeError) as exc:
        raise ProtocolError("malformed", f"versions map {obj!r}: {exc!r}") from exc


def vector_problem(arr: Any, size: int) -> tuple[str, str] | None:
    """Why a decoded payload cannot be a fragment vector (the rejection reason and detail).

    Args:
        arr: the decoded tensor.
        size: the fragment's element count.

    Returns:
        ("bad_shape" | "bad_dtype" | "non_finite", detail), or None when `arr` is a
        finite 1-D float32 vector of `size` elements.
    """
    if not isinstance(arr, np.ndarray):
        return "bad_shape", f"expected an array, got {type(arr).__name__}"
    if arr.dtype != np.float32:
        return "bad_dtype", f"dtype {arr.dtype}; fragment vectors are float32"
    if arr.shape != (size,):
        return "bad_shape", f"shape {arr.shape}; the fragment needs ({size},)"
    # max/min propagate NaN and expose +-inf without a temporary boolean array.
    if size and not (np.isfinite(arr.max()) and np.isfinite(arr.min())):
        return "non_finite", "values contain NaN or Inf"
    return None
