"""The write-ahead log's records of a shard's events: `event_to_record` and `record_to_event`.

This module owns what the records of a shard's log mean (the framing is
`paramserver.server.storage.log_file`'s, the events `paramserver.server.events`').

Log records (msgpack header + raw payload):

    init    {"t": "init", "plan": wire plan, "fragments": [[index, size], ...]}
            payload: the fragments' float32 values back to back (a whole `init`)
    init_begin {"t": "init_begin", "plan": wire plan, "island": id}
    init_piece {"t": "init_piece", "fragment": index, "offset": first element}
            payload: the piece's float32 values (one record per piece, so no
            record grows with the model)
    accept  {"t": "accept", island, round, fragment, base_version, tokens,
            steps, arrived, codec: [frame lengths] or nil}; payload: the codec
            frames as received, back to back (read again on replay into the
            same coded pending delta: `codec.coded.read` is deterministic), or
            the float32 delta when codec is nil (an event built without frames)
    step    {"t": "step", fragment, keys: [[island, round], ...], at, expected,
            outside?: [[path, fragment, [[island, round], ...], [float64 row-major]], ...]}
            (expected: the islands the step's round expected; absent in older
            logs, read as 0: a whole round; outside: an RDA step's PieceGrams;
            absent when none)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from codec import coded
from paramserver.server.events import (
    AcceptEvent,
    Contribution,
    Event,
    InitBeginEvent,
    InitEvent,
    InitPieceEvent,
    PieceGram,
    StepEvent,
)
from paramserver.server.storage.log_file import Record, WalError


def _piece_gram(item: Any) -> PieceGram:
    path, fragment, keys, flat = item
    keys = tuple((str(island), int(rnd)) for island, rnd in keys)
    gram = np.asarray(flat, dtype=np.float64).reshape(len(keys), len(keys))
    return PieceGram(str(path), int(fragment), keys, gram)


def event_to_record(event: Event) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The log record of an event.

    Args:
        event: InitEvent, AcceptEvent or StepEvent.

    Returns:
        (record header, payload arrays).
    """
    if isinstance(event, AcceptEvent):
        c = event.contribution
        header = {
            "t": "accept",
            "island": c.island,
            "round": c.round,
            "fragment": c.fragment,
            "base_version": c.base_version,
            "tokens": c.tokens,
            "steps": c.steps,
            "arrived": c.arrived,
        }
        if event.frames is not None:
            header["codec"] = [memoryview(f).nbytes for f in event.frames]
            return header, list(event.frames)
        header["codec"] = None
        values = np.empty(c.delta.size, np.float32)
        c.delta.decode_into(0, c.delta.size, values)
        return header, [values]
    if isinstance(event, StepEvent):
        header = {
            "t": "step",
            "fragment": event.fragment,
            "keys": [list(k) for k in event.keys],
            "at": event.at,
            "expected": event.expected,
        }
        if event.outside:
            header["outside"] = [
                [g.path, g.fragment, [list(k) for k in g.keys], g.gram.ravel().tolist()]
                for g in event.outside
            ]
        return header, []
    if isinstance(event, InitEvent):
        order = sorted(event.values)
        header = {
            "t": "init",
            "plan": event.plan_wire,
            "fragments": [[i, int(event.values[i].shape[0])] for i in order],
        }
        return header, [np.ascontiguousarray(event.values[i], dtype=np.float32) for i in order]
    if isinstance(event, InitBeginEvent):
        return {"t": "init_begin", "plan": event.plan_wire, "island": event.island}, []
    if isinstance(event, InitPieceEvent):
        header = {"t": "init_piece", "fragment": event.fragment, "offset": event.offset}
        return header, [np.ascontiguousarray(event.values, dtype=np.float32)]
    raise TypeError(f"not an event: {type(event).__name__}")


def record_to_event(record: Record) -> Event:
    """Inverse of `event_to_record`.

    Args:
        record: a record read back from the log.

    Returns:
        The event.

    Raises:
        WalError: an unknown or inconsistent record.
    """
    h = record.header
    try:
        kind = h["t"]
        if kind == "accept":
            lengths = h.get("codec")
            if lengths is None:
                delta = coded.from_array(np.frombuffer(record.payload, dtype=np.float32))
            else:
                frames, offset = [], 0
                view = memoryview(record.payload)
                for n in lengths:
                    frames.append(view[offset : offset + n])
                    offset += n
                if offset != len(view):
                    raise ValueError(f"payload has {len(view)} bytes, frames need {offset}")
                delta = _coded_delta(frames)
            c = Contribution(
                h["island"],
                h["round"],
                h["fragment"],
                h["base_version"],
                h["tokens"],
                h["steps"],
                h["arrived"],
                delta,
            )
            return AcceptEvent(c)
        if kind == "step":
            keys = tuple((str(island), int(rnd)) for island, rnd in h["keys"])
            outside = tuple(_piece_gram(g) for g in h.get("outside", ()))
            expected = int(h.get("expected", 0))
            return StepEvent(int(h["fragment"]), keys, float(h["at"]), outside, expected)
        if kind == "init":
            flat = np.frombuffer(record.payload, dtype=np.float32)
            values, offset = {}, 0
            for index, size in h["fragments"]:
                values[int(index)] = flat[offset : offset + size]
                offset += size
            if offset != flat.shape[0]:
                raise ValueError(f"payload has {flat.shape[0]} values, fragments need {offset}")
            return InitEvent(h["plan"], values)
        if kind == "init_begin":
            return InitBeginEvent(h["plan"], str(h["island"]))
        if kind == "init_piece":
            values = np.frombuffer(record.payload, dtype=np.float32)
            return InitPieceEvent(int(h["fragment"]), int(h["offset"]), values)
    except (KeyError, TypeError, ValueError) as exc:  # codec.CodecError is a ValueError
        raise WalError(f"log record at byte {record.offset} is inconsistent: {exc!r}") from exc
    raise WalError(f"log record at byte {record.offset} has unknown type {h.get('t')!r}")


def _coded_delta(frames: list) -> coded.CodedTensor:
    """The coded delta of an accept record's frames (raises ValueError: not one 'delta')."""
    tensors = coded.read(frames)
    if len(tensors) != 1 or tensors[0].path != ("delta",):
        raise ValueError(f"frames hold {[t.path for t in tensors]}, not one 'delta'")
    return tensors[0]
