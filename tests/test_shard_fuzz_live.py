"""Property-based fuzzing of one live shard subprocess while an honest island keeps pushing.

One real shard (``python -m paramserver.ops.cli shard``, tests/shard_process.py) is started
once for the module on loopback, in async mode, with its request limits off
(`max_requests_per_s` and `max_refusals_per_s` 0: every request is answered, none is
dropped) and `max_message_bytes` 1 MiB. An honest island (a `paramserver.client.Client`
driven by a thread) initialises it and keeps pushing small int8 deltas the whole time.

Hypothesis then drives, through a raw DEALER that said hello as island "fuzz":

- header fields: kinds, `v`, island ids, rounds (huge, negative, 2^62, 2^63, 2^64 - 1),
  fragment indices, base versions, tokens and steps (0, negative, 2^62, 2^63, floats,
  strings, None, booleans), plan hashes, ids, missing fields;
- frame layouts: 0 .. 1000 payload frames (any legal cut of the payload, docs/protocol.md
  section 7.3), truncated, dropped or extra frames, raw random bytes;
- values: NaN, +-Inf, 3e38, denormals, small honest-looking deltas, in raw float32 or int8.

Per message (checked at once): exactly one reply comes back in time, it decodes as a
reply, echoes the request's int id, and a refusal names one of `protocol.REASONS`, never
`internal_error` nor `storage_error` (nothing here is a disk fault).
After the examples: the model read back by snapshots (`paramserver.plumbing.probe.
global_params`) is finite, every honest push was acked (accepted or duplicate) and none
refused, the shard's peak RSS (psutil, sampled after every message) stayed below
baseline + 64 x the model's bytes + 256 MiB, the process is alive, answers `status`,
and dropped nothing.

A push cut into more frames than one `writev` takes (IOV_MAX = 1024) is stored too
(`test_push_of_many_frames_is_stored`; the fuzz also draws such layouts).

The default corpus is small for CI (60 examples). A longer run:

    DILOCO_FUZZ_EXAMPLES=2000 python -m pytest tests/test_shard_fuzz_live.py -m slow

(the timeouts grow with the count). Marked slow: it starts a shard subprocess and runs for
tens of seconds on a shared CI machine.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import psutil
import pytest
import zmq
from conftest import REPLY_TIMEOUT_S, Peer, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shard_process import ShardProcess

import codec
from paramserver.client import Client, ClientConfig
from paramserver.plumbing.probe import global_params
from paramserver.wire import protocol

EXAMPLES = int(os.environ.get("DILOCO_FUZZ_EXAMPLES", "60"))
TIMEOUT_S = 180 + EXAMPLES // 4  # the fuzz test's bound, grows with the corpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S)]

MAX_MESSAGE_BYTES = 1 << 20  # per-frame ZeroMQ limit is twice this: every fuzz frame stays below
LEAF = 4096  # two leaves of LEAF floats, two fragments of LEAF floats (16 KiB raw payload each)
MIB = 1 << 20
RSS_ALLOWANCE = 256 * MIB
RSS_PER_MODEL = 64  # model copies allowed on top of the allowance (params, optimizer, pending)
HONEST_PERIOD_S = 0.05
MAX_LEGAL_FRAMES = 1100  # past IOV_MAX: the log append writes its I/O vector in batches


def model() -> dict[str, np.ndarray]:
    """The honest island's parameters: two float32 leaves of LEAF elements."""
    rng = np.random.default_rng(7)
    return {
        "a": rng.standard_normal(LEAF).astype(np.float32),
        "b": rng.standard_normal(LEAF).astype(np.float32),
    }


MODEL_BYTES = sum(v.nbytes for v in model().values())


class HonestIsland:
    """A Client that pushes a 1e-3 int8 delta every HONEST_PERIOD_S, alternating fragments."""

    def __init__(self, router: str) -> None:
        self.client = Client(
            ClientConfig(connect=router, island="honest", heartbeat_interval_s=0.5)
        )
        self.plan = self.client.join(model()).plan
        self.size = self.plan.fragments[0].size
        self.frames, _ = codec.int8().encode({"delta": np.full(self.size, 1e-3, np.float32)})
        self.pushes = 0
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="honest", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop_event.wait(HONEST_PERIOD_S):
                rnd = self.pushes + 1
                self.client.push(rnd % 2, rnd, 0, 1000, 10, self.frames, stop=self.stop_event)
                self.pushes += 1
        except BaseException as exc:  # surfaced by finish()
            self.error = exc

    def finish(self) -> dict[str, Any]:
        """Stop pushing, wait until every push is answered; the client's stats."""
        self.stop_event.set()
        self.thread.join(REPLY_TIMEOUT_S)
        assert not self.thread.is_alive(), "honest island thread did not stop"
        assert self.error is None, f"honest island failed: {self.error!r}"

        def answered() -> dict | None:
            stats = self.client.stats()
            done = stats["acked"] + sum(stats["rejected"].values()) >= self.pushes
            return stats if done else None

        return wait_for(answered, f"{self.pushes} honest pushes to be answered", timeout_s=60)

    def close(self) -> None:
        self.stop_event.set()
        self.thread.join(REPLY_TIMEOUT_S)
        self.client.close(flush_timeout_s=1.0)


class LiveShard:
    """The module's shard subprocess, its honest island, and a ZeroMQ context for peers."""

    def __init__(self, data_dir) -> None:
        self.ctx = zmq.Context()
        self.proc = ShardProcess(
            data_dir,
            "--mode", "async", "--fsync", "false",
            "--max-requests-per-s", "0", "--max-refusals-per-s", "0",
            "--max-message-bytes", str(MAX_MESSAGE_BYTES),
            "--heartbeat-interval-s", "0.5", "--liveness", "20",
        )  # fmt: skip
        self.honest: HonestIsland | None = None
        self.proc.wait_ready(self.ctx)
        self.honest = HonestIsland(self.proc.router)
        self.ps = psutil.Process(self.proc.proc.pid)
        self.baseline_rss = self.ps.memory_info().rss
        self.peak_rss = self.baseline_rss

    def sample_rss(self) -> None:
        self.peak_rss = max(self.peak_rss, self.ps.memory_info().rss)

    def close(self) -> None:
        try:
            if self.honest is not None:
                self.honest.close()
        finally:
            self.proc.stop()
            self.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[LiveShard]:
    """One shard subprocess with an honest island pushing; stopped whatever happens."""
    shard = None
    try:
        shard = LiveShard(tmp_path_factory.mktemp("fuzz") / "server")
        yield shard
    finally:
        if shard is not None:
            shard.close()


# --------------------------------------------------------------------------- messages

SPECIAL_INTS = (0, 1, -1, 2, 2**31, 2**32, 2**40 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1)
JUNK = st.one_of(
    st.sampled_from(SPECIAL_INTS),
    st.integers(-(2**63), 2**64 - 1),  # what msgpack can carry
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.none(),
    st.booleans(),
    st.binary(max_size=4),
    st.lists(st.integers(0, 3), max_size=2),
)
KINDS = ("push",) * 12 + (
    "hello", "heartbeat", "snapshot", "status", "init", "init_begin", "init_piece", "bye",
    "", "PUSH", "pull",
)  # fmt: skip
VALUES = ("small", "zeros", "nan", "inf", "-inf", "3e38", "-3e38", "denormal", "max", "mixed")


def _vector(kind: str, size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    vec = (rng.standard_normal(size) * 1e-3).astype(np.float32)
    if kind == "zeros":
        vec[:] = 0
    elif kind == "denormal":
        vec[:] = np.float32(1e-45) * rng.integers(-3, 4, size)
    elif kind == "max":
        vec[:] = np.finfo(np.float32).max
    elif kind == "3e38":
        vec[:] = 3e38
    elif kind == "-3e38":
        vec[rng.integers(size)] = -3e38
    elif kind == "mixed":
        vec[rng.integers(size, size=4)] = (3e38, 1e-45, -1e30, 7e20)
    elif kind in ("nan", "inf", "-inf"):
        vec[rng.integers(size, size=rng.integers(1, 4))] = float(kind)
    return vec


def _raw_frames(vec: np.ndarray) -> list[bytes]:
    """Valid raw float32 codec frames of {"delta": vec}, whatever its values (crc fixed up)."""
    frames, _ = codec.raw("float32").encode({"delta": np.zeros(vec.size, np.float32)})
    head = msgpack.unpackb(bytes(frames[0]), raw=False)
    body = vec.astype("<f4").tobytes()
    head["frames"] = [[len(body), len(body), zlib.crc32(body)]]
    return [msgpack.packb(head, use_bin_type=True), body]


def recut(frames: list[bytes], pieces: int) -> list[bytes]:
    """The same codec message with its payload cut into `pieces` frames (section 7.3)."""
    head = msgpack.unpackb(bytes(frames[0]), raw=False)
    if head.get("zstd"):
        return frames
    body = b"".join(bytes(f) for f in frames[1:])
    pieces = max(1, min(pieces, len(body)))
    bounds = [len(body) * i // pieces for i in range(pieces + 1)]
    cut = [body[bounds[i] : bounds[i + 1]] for i in range(pieces)]
    head["frames"] = [[len(c), len(c), zlib.crc32(c)] for c in cut]
    return [msgpack.packb(head, use_bin_type=True), *cut]


@st.composite
def payloads(draw, size: int) -> list[bytes]:
    """Codec frames of a delta: values, scheme, layout, and damage drawn."""
    kind = draw(st.sampled_from(VALUES))
    vec = _vector(kind, size, draw(st.integers(0, 2**16)))
    if kind in ("small", "zeros", "denormal") and draw(st.booleans()):
        frames = [bytes(f) for f in codec.int8().encode({"delta": vec})[0]]
    else:
        frames = _raw_frames(vec)
    pieces = draw(st.sampled_from((1, 1, 1, 2, 3, 17, 255, 999, MAX_LEGAL_FRAMES)))
    frames = recut(frames, pieces)
    damage = draw(st.sampled_from(("none",) * 4 + ("truncate", "drop", "extra", "no_payload")))
    if damage == "truncate":
        j = draw(st.integers(0, len(frames) - 1))
        frames[j] = frames[j][: draw(st.integers(0, max(0, len(frames[j]) - 1)))]
    elif damage == "drop":
        frames = frames[: draw(st.integers(0, len(frames) - 1))]
    elif damage == "extra":
        frames = [*frames, *draw(st.lists(st.binary(max_size=64), min_size=1, max_size=3))]
    elif damage == "no_payload":
        frames = []
    return frames


@st.composite
def messages(draw, plan_hash: str, size: int, next_round) -> tuple[dict | None, list[bytes]]:
    """(header or None, frames) of one hostile request; header None: raw bytes, no header map."""
    if draw(st.integers(0, 15)) == 0:
        return None, draw(st.lists(st.binary(max_size=200), min_size=1, max_size=3))
    kind = draw(st.sampled_from(KINDS))
    header: dict[str, Any] = {
        "v": 1,
        "id": draw(st.integers(1, 2**31)),
        "kind": kind,
        "island": "fuzz",
        "round": next_round(),
        "fragment": draw(st.sampled_from((0, 1))),
        "base_version": 0,
        "tokens": 1000,
        "steps": 10,
        "plan_hash": plan_hash,
    }
    if kind == "snapshot":
        header["offset"], header["count"] = 0, size
    # retype some fields (none: a well-formed push that reaches the payload checks)
    fields = st.sampled_from(sorted(header) + ["floor", "session"])
    retyped = draw(st.sampled_from((0, 0, 0, 0, 1, 1, 2, 3)))
    for field in draw(st.lists(fields, min_size=retyped, max_size=retyped)):
        choice = draw(st.integers(0, 4))
        if choice == 0:
            header.pop(field, None)
        elif field == "island":
            header[field] = draw(st.sampled_from(("", "x" * 129, "other-1", "other-2", 5)))
        elif choice <= 2:  # a bound: 0, 2^62, 2^63, 2^64 - 1, ... (bad_tokens, bad_round)
            header[field] = draw(st.sampled_from(SPECIAL_INTS))
        else:
            header[field] = draw(JUNK)
    payload = draw(payloads(size)) if kind in ("push", "init", "init_piece") else []
    return header, [msgpack.packb(header, use_bin_type=True), *payload]


def read_reply(sock: zmq.Socket) -> dict[str, Any]:
    """The next reply's header (one to a message whose first frame was empty comes after one)."""
    assert sock.poll(int(REPLY_TIMEOUT_S * 1000)), "no reply in time: the shard hung or dropped"
    frames = sock.recv_multipart()
    if frames and not frames[0]:
        frames = frames[1:]
    return protocol.unpack(frames, role=protocol.REPLY)[0]


def check_reply(header: dict | None, reply: dict[str, Any]) -> str:
    """Assert the reply is a documented answer to `header`; return its label for the tally."""
    rid = header.get("id") if isinstance(header, dict) else None
    if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 2**63:
        assert reply.get("id") == rid, f"reply {reply} does not echo id {rid}"
    if reply["kind"] == "ack":
        assert reply["outcome"] in protocol.OUTCOMES, reply
        if reply["outcome"] != protocol.REJECTED:
            return reply["outcome"]
    elif reply["kind"] != "rejected":
        return f"served:{reply['kind']}"
    reason = reply["reason"]
    assert reason in protocol.REASONS, reply
    assert reason not in ("internal_error", "storage_error"), (header, reply)
    return f"rejected:{reason}"


# --------------------------------------------------------------------------- tests


def test_fuzz_live_shard_with_honest_island(live: LiveShard) -> None:
    plan = live.honest.plan
    size = plan.fragments[0].size
    attacker = Peer(live.ctx, live.proc.router, "fuzz")
    rounds = iter(range(1, 10**9))
    tally: Counter = Counter()
    try:
        attacker.hello()

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=EXAMPLES <= 60,  # CI: the same corpus every run
            suppress_health_check=list(HealthCheck),
        )
        @given(messages(plan.hash, size, lambda: next(rounds)))
        def one(message: tuple[dict | None, list[bytes]]) -> None:
            header, frames = message
            # a fresh hello each time: an earlier `bye` or a borrowed id must not end the run
            attacker.send({"kind": "hello", "island": "fuzz"})
            assert read_reply(attacker.sock)["kind"] == "welcome"
            attacker.send_raw(frames)
            tally[check_reply(header, read_reply(attacker.sock))] += 1
            assert live.proc.proc.poll() is None, f"shard exited: {live.proc.output[-4000:]}"
            live.sample_rss()

        one()
        stats = live.honest.finish()
        status = attacker.status()
    finally:
        attacker.close()

    # the model stays finite
    _, params, _ = global_params(live.proc.router, timeout_s=REPLY_TIMEOUT_S)
    for path, values in params.items():
        assert np.isfinite(values).all(), f"non-finite parameters in {path}"
    # every honest push was acked and none refused
    assert live.honest.pushes > 0
    assert stats["acked"] == live.honest.pushes and not stats["rejected"], stats
    # memory bounded, the process alive, nothing dropped
    bound = live.baseline_rss + RSS_PER_MODEL * MODEL_BYTES + RSS_ALLOWANCE
    assert live.peak_rss < bound, f"peak RSS {live.peak_rss / MIB:.0f} MiB >= {bound / MIB:.0f}"
    assert live.proc.proc.poll() is None
    assert not any(status.get("dropped", {}).values()), status["dropped"]
    print(f"fuzz replies: {dict(sorted(tally.items()))}; peak RSS {live.peak_rss / MIB:.0f} MiB")


def test_push_of_many_frames_is_stored(live: LiveShard) -> None:
    plan = live.honest.plan
    size = plan.fragments[0].size
    attacker = Peer(live.ctx, live.proc.router, "fuzz-frames")
    try:
        attacker.hello()
        frames = recut(_raw_frames(np.full(size, 1e-3, np.float32)), 1100)
        header = {
            "kind": "push", "island": "fuzz-frames", "round": 1, "fragment": 0,
            "base_version": 0, "tokens": 1000, "steps": 10, "plan_hash": plan.hash,
        }  # fmt: skip
        ack, _ = attacker.request(header, frames)
    finally:
        attacker.close()
    assert (ack["outcome"], ack.get("reason")) == ("accepted", None), ack.get("detail")
