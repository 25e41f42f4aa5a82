"""The wire protocol between islands and shards in code: kinds, header schemas, pack / unpack.

This module owns the message kinds, the header schema of each kind, the
protocol version and the rejection reasons, plus `pack` / `unpack` (which
check a header against its schema). It does no I/O; shards and clients call
it on the frames they send and receive. The specification (framing, every
field, the replies, published messages, deduplication, island ids, sizes,
the join conversation) is docs/protocol.md; the codec frames inside a
message are specified in `codec/format.py`. Change the schemas here only
together with that page.

Liveness decisions (Paranoid Pirate style): pure functions of time.

This module owns when a peer counts as dead (silent for more than `liveness`
heartbeat intervals) and the capped exponential back-off of reconnects. When an
unacked delta is sent again is the ack timer of `paramserver.client.ledger` (an adaptive timeout).
Callers pass a monotonic clock's `now`.
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
# A larger header frame is refused unread, but its `id` is looked for among this many
# of its map's first keys, so that the refusal can echo it (`oversize_header_id`).
OVERSIZE_ID_KEYS = 256
# A shard's `max_message_bytes` when its welcome does not say (the shards' default).
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

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
    "throttled",
    "delta_too_large",
    "bad_tokens",
    "bad_round",
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


def _finite(x: object) -> bool:
    return _number(x) and math.isfinite(x)


def _finite_positive(x: object) -> bool:
    return _finite(x) and x > 0


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
    "seconds": (_finite_positive, "a finite number > 0"),
    "rate": (_finite_positive, "a finite number > 0"),
    "finite": (_finite, "a finite number"),
    "share": (lambda x: _number(x) and 0 <= x <= 1, "a number from 0 to 1"),
}

# kind -> {required field: type name}, per role.
SCHEMAS: dict[str, dict[str, dict[str, str]]] = {
    REQUEST: {
        "hello": {"island": "island"},
        "init": {"island": "island", "plan": "map"},
        "init_begin": {"island": "island", "plan": "map"},
        "init_piece": {
            "island": "island",
            "plan_hash": "str",
            "fragment": "uint",
            "offset": "uint",
        },
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
        "init_begun": {"plan_hash": "str", "missing": "uint"},
        "init_piece_ok": {"fragment": "uint", "offset": "uint", "count": "uint", "missing": "uint"},
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
    REQUEST: {
        "id": "int",
        "t_step": "seconds",
        # the island's own configured H (inner steps per round), when it says it: the
        # shards warn when it would take other default outer settings than theirs
        "inner_steps": "pos",
        # what an island reports of its training (pushes and heartbeats; shown by the page)
        "inner_loss": "finite",
        "steps_per_s": "rate",
        "goodput": "share",
        "session": "island",
        # hello: add this connection to the island's (a bulk link) instead of moving the id
        "attach": "bool",
        "offset": "uint",
        "count": "pos",
        # push: the lowest round of the island the client may still send (DEDUP_MAX_ROUNDS)
        "floor": "uint",
    },
    REPLY: {
        "id": "int",
        "merged_version": "uint?",
        "credited": "number",
        "max_message_bytes": "pos",
        "detail": "str",
        "offset": "uint",
        "size": "uint",
        "retry_after_s": "seconds",
    },
    PUB: {"credited": "map"},
}


# What an island may report of its training: an optional field of `push` and `heartbeat`.
TRAINING_FIELDS = ("inner_loss", "steps_per_s", "goodput")


def request_field_problem(field: str, value: object) -> str | None:
    """Why `value` cannot be sent as the optional request field `field`.

    Args:
        field: an optional request field (e.g. one of TRAINING_FIELDS).
        value: the value to send.

    Returns:
        None when a shard accepts it, else what the field must be.

    Raises:
        KeyError: `field` is not an optional request field.
    """
    check, what = _CHECKS[_OPTIONAL[REQUEST][field]]
    return None if check(value) else f"{field} must be {what}, got {value!r}"


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
            too big, missing or mistyped field), "bad_version" (`v` is not the int
            1: `true` and `1.0` are not ints) or "unknown_kind". Its `header` is
            what decoded of a map header (for a header over MAX_HEADER_BYTES,
            only its int `id`, see `oversize_header_id`), so a reply can echo the id.
    """
    if role not in SCHEMAS:
        raise ValueError(f"role={role!r}: use one of {tuple(SCHEMAS)}")
    if not frames:
        raise ProtocolError("malformed", "empty message: frame 0 must be a msgpack header")
    raw = memoryview(frames[0])
    if raw.nbytes > MAX_HEADER_BYTES:
        rid = oversize_header_id(raw)
        raise ProtocolError(
            "malformed",
            f"header frame is {raw.nbytes} bytes; limit {MAX_HEADER_BYTES}",
            None if rid is None else {"id": rid},
        )
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except msgpack.ExtraData as exc:  # a map followed by more bytes: its id can be echoed
        decoded = exc.unpacked if isinstance(exc.unpacked, dict) else None
        raise ProtocolError("malformed", "header frame has bytes after the map", decoded) from exc
    except Exception as exc:  # msgpack raises many types on garbage input
        raise ProtocolError("malformed", f"header is not msgpack: {exc!r}") from exc
    if not isinstance(header, dict):
        raise ProtocolError("malformed", f"header must be a map, got {type(header).__name__}")
    version = header.get("v")
    if not _is_int(version) or version != PROTOCOL_VERSION:
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


def oversize_header_id(raw: memoryview) -> int | None:
    """The int `id` of a header frame too large to decode, read without building the map.

    The frame is walked as a msgpack map (values skipped unread) through its first
    OVERSIZE_ID_KEYS keys; its size is bounded by the receiver's frame limit.

    Args:
        raw: the header frame.

    Returns:
        The value of the key "id" when the frame starts as a map with that key among
        its first OVERSIZE_ID_KEYS keys and the value is an int; else None.
    """
    size = raw.nbytes
    reader = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(size, 1))
    try:
        reader.feed(raw)
        for _ in range(min(reader.read_map_header(), OVERSIZE_ID_KEYS)):
            if reader.unpack() == "id":
                rid = reader.unpack()
                return rid if _is_int(rid) else None
            reader.skip()
    except Exception:  # not a map, truncated, or garbage: no id to echo
        return None
    return None


def _check_field(kind: str, field: str, value: object, type_name: str, header: dict) -> None:
    check, what = _CHECKS[type_name]
    if not check(value):
        raise ProtocolError(
            "malformed", f"{kind}: field {field!r} must be {what}, got {value!r}", header
        )


def piece_elements(max_message_bytes: int) -> int:
    """The most fp32 elements one piece of an init or a snapshot holds under a message limit.

    An eighth of the limit is left for the protocol and codec headers (docs/protocol.md
    section 8).

    Args:
        max_message_bytes: the shard's limit (the welcome's `max_message_bytes`).

    Returns:
        (max_message_bytes - max_message_bytes // 8) // 4, at least 1.
    """
    return max(1, (max_message_bytes - max_message_bytes // 8) // 4)


def pieces(size: int, per_piece: int) -> list[tuple[int, int]]:
    """Cut a fragment of `size` elements into consecutive pieces of at most `per_piece`.

    Args:
        size: the fragment's element count (>= 1).
        per_piece: the most elements of one piece (`piece_elements`).

    Returns:
        [(offset, count), ...] in order, covering [0, size) once.
    """
    return [(lo, min(per_piece, size - lo)) for lo in range(0, size, per_piece)]


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


class LivenessError(ValueError):
    """An invalid time, interval, or attempt number."""


def _checked_number(name: str, value: object, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise LivenessError(f"{name}={value!r} must be a finite number")
    if positive and value <= 0:
        raise LivenessError(f"{name}={value!r} must be > 0")
    return float(value)


def is_silent(now: float, last_heard: float, interval_s: float, liveness: float) -> bool:
    """Whether a peer has been silent too long.

    Args:
        now: current time, seconds.
        last_heard: when anything was last received from the peer.
        interval_s: heartbeat interval, > 0.
        liveness: intervals of silence tolerated, > 0.

    Returns:
        True once now - last_heard exceeds liveness * interval_s.
    """
    now = _checked_number("now", now)
    last_heard = _checked_number("last_heard", last_heard)
    budget = _checked_number("interval_s", interval_s, positive=True) * _checked_number(
        "liveness", liveness, positive=True
    )
    return now - last_heard > budget


def live_islands(
    now: float, last_seen: Mapping[str, float], interval_s: float, liveness: float
) -> frozenset[str]:
    """The islands that are not silent.

    Args:
        now: current time, seconds.
        last_seen: island -> when it was last heard from.
        interval_s: heartbeat interval, > 0.
        liveness: intervals of silence tolerated, > 0.

    Returns:
        The live island ids.
    """
    _checked_number("interval_s", interval_s, positive=True)
    _checked_number("liveness", liveness, positive=True)
    return frozenset(
        island for island, t in last_seen.items() if not is_silent(now, t, interval_s, liveness)
    )


def next_backoff(attempt: int, base_s: float, cap_s: float) -> float:
    """Capped exponential back-off.

    Args:
        attempt: attempts already made, >= 0.
        base_s: delay for attempt 0, > 0.
        cap_s: upper bound, >= base_s.

    Returns:
        min(cap_s, base_s * 2**attempt).
    """
    if isinstance(attempt, bool) or not isinstance(attempt, numbers.Integral) or attempt < 0:
        raise LivenessError(f"attempt={attempt!r} must be an int >= 0")
    base_s = _checked_number("base_s", base_s, positive=True)
    cap_s = _checked_number("cap_s", cap_s, positive=True)
    if cap_s < base_s:
        raise LivenessError(f"cap_s={cap_s} < base_s={base_s}; raise cap_s")
    # 2**attempt beyond the cap would overflow a float for huge attempts.
    if attempt >= math.log2(cap_s / base_s) + 1:
        return cap_s
    return min(cap_s, base_s * 2.0 ** int(attempt))
