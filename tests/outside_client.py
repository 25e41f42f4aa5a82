"""An island written from docs/protocol.md alone: pyzmq, msgpack, numpy and zstandard, nothing of ours.

Run by tests/test_outside_client.py as its own interpreter against a fresh
2-shard cluster started in async mode with plain SGD (`--outer-optimizer sgd
--outer-lr LR`) and `--fragments 4`:

    python -I tests/outside_client.py --connect tcp://127.0.0.1:P --downlink int8 --lr 0.5

It computes the plan itself (cut, assignment, hash), initialises both
shards (shard 0 in pieces with a re-sent and an overlapping piece, shard 1
in one `init`), joins (snapshots of shard 0 in pieces), follows both PUB streams, pushes
one delta to each shard (one raw float32 frame with crc32, one int8 frame with zstd, both encoded here),
decodes the published updates (int8 deltas or full float32 values), checks
them against snapshots bit for bit, and exercises duplicate and rejected
acks, strict headers (`v` true, a push header that fails validation, a
header over 4 MiB: each `rejected` with its id), a REQ socket, heartbeats,
status and bye. It prints one JSON summary line and exits 0,
or fails with an AssertionError.

The project's packages are blocked: importing any of them raises ImportError,
and none may be in sys.modules at the end.
"""

from __future__ import annotations

import sys

FORBIDDEN = ("codec", "paramserver", "worker", "bench")


class _Blocker:
    """A meta-path finder refusing the project's packages: this client must not need them."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in FORBIDDEN:
            raise ImportError(f"outside client imported {name!r}: the spec must suffice")
        return None


sys.meta_path.insert(0, _Blocker())

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import secrets  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402
import zstandard  # noqa: E402

TIMEOUT_S = 15.0
FRAME_BYTES = 1 << 20
F32 = np.float32
ISLAND = "outside-ñ"  # any 1-128 characters

# --------------------------------------------------------------------------- plan (section 6)


def leaves_of(params: dict[str, np.ndarray]) -> list[list]:
    """[[path, shape, dtype name], ...] sorted by path (code point order)."""
    return [[p, list(params[p].shape), str(params[p].dtype)] for p in sorted(params)]


def cut_bounds(total: int, num_fragments: int) -> list[int]:
    """b_i = floor((2 i total + F) / (2 F)): i * total / F rounded half up."""
    f = num_fragments
    return [(2 * i * total + f) // (2 * f) for i in range(f + 1)]


def make_plan(leaves: list[list], num_shards: int, num_fragments: int) -> dict:
    """The wire plan (with hash) of section 6, from [[path, shape, dtype name], ...]."""
    leaves = sorted(leaves)
    sizes = [math.prod(shape) for _, shape, _ in leaves]
    total = sum(sizes)
    assert num_shards <= num_fragments <= total
    bounds = cut_bounds(total, num_fragments)
    slices: list[list] = [[] for _ in range(num_fragments)]
    start = 0
    for (path, _, _), size in zip(leaves, sizes, strict=True):
        for f in range(num_fragments):
            lo, hi = max(start, bounds[f]), min(start + size, bounds[f + 1])
            if lo < hi:
                slices[f].append([path, lo - start, hi - start])
        start += size
    runs = cut_bounds(num_fragments, num_shards)  # shard k: fragments [runs[k], runs[k + 1])
    owner = [k for k in range(num_shards) for _ in range(runs[k], runs[k + 1])]
    plan = {
        "format": 1,
        "leaves": leaves,
        "num_shards": num_shards,
        "num_fragments": num_fragments,
        "fragments": [[f, owner[f], slices[f]] for f in range(num_fragments)],
    }
    text = json.dumps(plan, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    plan["hash"] = hashlib.sha256(text.encode("ascii")).hexdigest()
    return plan


def fragment_values(plan: dict, params: dict[str, np.ndarray], f: int) -> np.ndarray:
    """The fragment's slices, concatenated, as float32."""
    parts = [np.asarray(params[p], F32).reshape(-1)[a:b] for p, a, b in plan["fragments"][f][2]]
    return np.concatenate(parts).astype(F32)


def fragment_size(plan: dict, f: int) -> int:
    return sum(b - a for _, a, b in plan["fragments"][f][2])


# --------------------------------------------------------------------------- codec (section 7)


def _zstd_frame(piece: bytes) -> tuple[bytes, list[int]]:
    c = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True)
    data = c.compress(piece)
    return data, [len(piece), len(data), int.from_bytes(data[-4:], "little")]


def _frames(payload: bytes, use_zstd: bool) -> tuple[list[bytes], list[list[int]]]:
    frames, entries = [], []
    for a in range(0, len(payload), FRAME_BYTES):
        piece = payload[a : a + FRAME_BYTES]
        if use_zstd:
            data, entry = _zstd_frame(piece)
        else:
            data, entry = piece, [len(piece), len(piece), zlib.crc32(piece)]
        frames.append(data)
        entries.append(entry)
    return frames, entries


def _align(pos: int, to: int) -> int:
    return -(-pos // to) * to


def encode(
    tree: dict[str, np.ndarray], scheme: str = "raw", use_zstd: bool = False, block: int = 256
) -> list[bytes]:
    """Codec frames of a flat tree {key: float32 array}: scheme raw (float32 store) or int8."""
    payload = bytearray()
    tensors = []
    for key in sorted(tree):
        x = np.ascontiguousarray(tree[key], dtype=F32)
        n = x.size
        payload += b"\0" * (_align(len(payload), 8) - len(payload))
        offset = len(payload)
        if scheme == "raw":
            payload += x.astype("<f4").tobytes()
        else:
            flat = x.reshape(-1)
            nb = -(-n // block)
            padded = np.zeros(nb * block, F32)
            padded[:n] = flat
            m = np.abs(padded.reshape(nb, block)).max(axis=1).astype(F32)
            m[m < F32(2.0**-118)] = 0
            with np.errstate(divide="ignore", invalid="ignore"):
                inv = np.where(m > 0, F32(127) / m, F32(0)).astype(F32)
            q = np.rint(padded.reshape(nb, block) * inv[:, None]).reshape(-1)[:n]
            payload += q.astype(np.int8).tobytes()
            payload += b"\0" * (_align(len(payload), 4) - len(payload))
            payload += m.astype("<f4").tobytes()
        tensors.append([[key], list(x.shape), "float32", offset])
    frames, entries = _frames(bytes(payload), use_zstd)
    header = {
        "magic": "ddcodec",
        "version": 1,
        "scheme": scheme,
        "block": 0 if scheme == "raw" else block,
        "store": "float32" if scheme == "raw" else None,
        "zstd": use_zstd,
        "payload": len(payload),
        "tensors": tensors,
        "frames": entries,
    }
    return [msgpack.packb(header, use_bin_type=True), *frames]


def decode(frames: list[bytes]) -> dict[str, np.ndarray]:
    """A flat tree {key: array} from codec frames (raw float32 or int8; zstd or crc32)."""
    header = msgpack.unpackb(frames[0], raw=False)
    assert header["magic"] == "ddcodec" and header["version"] == 1, header
    body = frames[1:]
    assert len(body) == len(header["frames"])
    pieces = []
    for i, (frame, (raw_len, wire_len, check)) in enumerate(
        zip(body, header["frames"], strict=True)
    ):
        frame = bytes(frame)
        assert len(frame) == wire_len, f"frame {i}: wire length"
        if header["zstd"]:
            assert int.from_bytes(frame[-4:], "little") == check, f"frame {i}: zstd check"
            params = zstandard.get_frame_parameters(frame)
            assert params.content_size == raw_len and params.has_checksum
            piece = zstandard.ZstdDecompressor().decompress(frame, max_output_size=raw_len)
        else:
            assert zlib.crc32(frame) == check, f"frame {i}: crc32"
            piece = frame
        assert len(piece) == raw_len
        pieces.append(piece)
    payload = b"".join(pieces)
    assert len(payload) == header["payload"]
    out = {}
    pos = 0
    for path, shape, dtype, offset in header["tensors"]:
        assert dtype == "float32", dtype
        n = math.prod(shape)
        pos = _align(pos, 8)
        assert offset == pos, "offsets follow the layout"
        if header["scheme"] == "raw":
            assert header["store"] == "float32"
            values = np.frombuffer(payload, "<f4", n, offset).astype(F32)
            pos = offset + _align(4 * n, 4)
        else:
            assert header["scheme"] == "int8", header["scheme"]
            block = header["block"]
            nb = -(-n // block)
            codes = np.frombuffer(payload, np.int8, n, offset)
            scales_at = offset + _align(n, 4)
            m = np.frombuffer(payload, "<f4", nb, scales_at).astype(F32)
            assert np.all(np.isfinite(m)) and np.all(m >= 0)
            step = (m * F32(1.0 / 127)).astype(F32)
            values = codes.astype(F32) * np.repeat(step, block)[:n]
            pos = scales_at + 4 * nb
        out["/".join(path)] = values.reshape(shape)
    assert pos == header["payload"]
    return out


# --------------------------------------------------------------------------- messages (sections 1-5)


class Shard:
    """A DEALER to one shard's ROUTER, with request ids."""

    ids = iter(range(1, 1 << 30))

    def __init__(self, ctx: zmq.Context, router: str) -> None:
        self.router = router
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(router)
        self.sub: zmq.Socket | None = None

    def send(self, header: dict, payload: list = ()) -> int:
        rid = next(self.ids)
        frame0 = msgpack.packb({"v": 1, "id": rid, **header}, use_bin_type=True)
        self.dealer.send_multipart([frame0, *payload])
        return rid

    def request(self, header: dict, payload: list = ()) -> tuple[dict, list]:
        """One request and its reply; a `throttled` one is sent again after retry_after_s."""
        for _ in range(100):
            rid = self.send(header, payload)
            assert self.dealer.poll(int(TIMEOUT_S * 1000)), f"no reply to {header['kind']}"
            frames = self.dealer.recv_multipart()
            reply = msgpack.unpackb(frames[0], raw=False)
            assert reply["v"] == 1 and reply.get("id") == rid, (reply, rid)
            if reply.get("reason") != "throttled":  # section 8: not read; wait, send again
                return reply, frames[1:]
            time.sleep(reply["retry_after_s"])
        raise AssertionError(f"{header['kind']} throttled 100 times")

    def published(self, kind: str) -> tuple[dict, list]:
        """The next PUB message of `kind` (others skipped)."""
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no {kind} published by {self.router}"
            if self.sub.poll(int(left * 1000)):
                frames = self.sub.recv_multipart()
                header = msgpack.unpackb(frames[0], raw=False)
                assert header["v"] == 1
                if header["kind"] == kind:
                    return header, frames[1:]

    def close(self) -> None:
        self.dealer.close(0)
        if self.sub is not None:
            self.sub.close(0)


def island_params() -> dict[str, np.ndarray]:
    """93 elements (93 = 4 * 23 + 1: with 4 fragments, bound 2 is the tie 46.5 -> 47)."""
    rng = np.random.default_rng(7)
    return {
        "blocks/0/w": rng.standard_normal((7, 9)).astype(F32),
        "blocks/0/b": rng.standard_normal(9).astype(F32),
        "emb/ñ": rng.standard_normal((5, 3)).astype(np.float16),  # non-ASCII path, float16
        "head": rng.standard_normal(3).astype(F32),
        "scale": np.asarray(1.5, F32),  # a scalar leaf: shape []
        "Zeta": rng.standard_normal(2).astype(F32),  # uppercase sorts before lowercase
        "zz/empty": np.zeros((0, 4), F32),  # no elements: in leaves, in no fragment
    }


# The worked examples of docs/protocol.md, section 6.5 (the test checks the doc shows these).
DOC_EXAMPLES = [
    (
        [["b", [5], "float32"], ["a", [2, 2], "float32"]],
        2,
        4,
        "4e2edc32b0861de8ee343a904282b6c4a180683b654735e8430132ee691af85e",
    ),
    (
        [["émb", [3], "bfloat16"]],
        1,
        1,
        "6eb092361aa475af9db3897fcecbb05e31659320d370ef7953c972ed6433e705",
    ),
]


def expect_ack(reply: dict, outcome: str, reason: str | None = None) -> None:
    assert reply["kind"] == "ack", reply
    assert reply["outcome"] == outcome and reply["reason"] == reason, reply
    if outcome == "rejected":
        assert isinstance(reply["detail"], str) and reply["detail"], reply
    else:
        assert "detail" not in reply, reply


def init_in_pieces(shard: Shard, plan: dict, values: dict[int, np.ndarray], most: int) -> dict:
    """Initialise one shard in pieces (section 3.2): init_begin, then each fragment in three.

    One piece is sent twice (a re-send is harmless) and one overlapping piece is
    refused. Returns the reply to the last piece (init_ok).
    """
    begun, _ = shard.request({"kind": "init_begin", "island": ISLAND, "plan": plan})
    assert begun["kind"] == "init_begun" and begun["plan_hash"] == plan["hash"], begun
    assert begun["missing"] == sum(len(v) for v in values.values()), begun
    reply: dict = {}
    for f, vec in sorted(values.items()):
        step = min(most, -(-len(vec) // 3))
        for offset in range(0, len(vec), step):
            header = {
                "kind": "init_piece",
                "island": ISLAND,
                "plan_hash": plan["hash"],
                "fragment": f,
                "offset": offset,
            }
            frames = encode({"values": vec[offset : offset + step]}, "raw", use_zstd=True)
            reply, _ = shard.request(header, frames)
            if offset == 0:
                again, _ = shard.request(header, frames)
                assert again["kind"] == "init_piece_ok" and again["missing"] == reply["missing"]
                wrong = encode({"values": vec[1 : step + 1]}, "raw", use_zstd=True)
                bad, _ = shard.request({**header, "offset": 1}, wrong)
                assert bad["kind"] == "rejected" and bad["reason"] == "bad_shape", bad
    return reply


def strict_header_cases(shard: Shard, header: dict, frames: list) -> None:
    """Sections 1-3: `v` is the int 1; a push header failing its checks, or over 4 MiB, is
    `rejected` with its id."""
    for v in (True, 1.0):  # a bool is never an int (section 1), nor is a float
        reply, _ = shard.request({**header, "round": 1, "v": v}, frames)
        assert reply["kind"] == "rejected" and reply["reason"] == "bad_version", reply
    huge = {"kind": "status", "pad": "x" * (4 * 1024 * 1024)}  # a header frame over 4 MiB
    for bad in ({"round": -1}, {"tokens": True}, {"plan_hash": None}, huge):
        reply, _ = shard.request({**header, **bad}, frames)  # decodes, fails validation
        assert reply["kind"] == "rejected" and reply["reason"] == "malformed", reply
        assert isinstance(reply["detail"], str) and reply["detail"], reply


def req_socket_round_trip(ctx: zmq.Context, router: str) -> list[str]:
    """Section 1: a REQ socket gets every reply (the shard repeats its delimiter)."""
    req = ctx.socket(zmq.REQ)
    req.connect(router)
    island = "outside-req"  # its own id: a hello would move ours to this socket
    kinds, asks = [], [{"kind": k, "island": island} for k in ("hello", "heartbeat", "bye")]
    try:
        for rid, ask in enumerate([*asks[:2], {"kind": "status"}, asks[2]], start=1):
            req.send_multipart([msgpack.packb({"v": 1, "id": rid, **ask}, use_bin_type=True)])
            assert req.poll(int(TIMEOUT_S * 1000)), f"the REQ socket got no reply to {ask}"
            reply = msgpack.unpackb(req.recv_multipart()[0], raw=False)
            assert reply["id"] == rid and reply["kind"] != "rejected", reply
            kinds.append(reply["kind"])
        assert kinds == ["welcome", "heartbeat", "status_reply", "bye_ok"], kinds
    finally:
        req.close(0)  # linger 0
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--connect", required=True)
    parser.add_argument("--downlink", choices=("int8", "float32"), required=True)
    parser.add_argument("--lr", type=float, required=True)
    args = parser.parse_args()
    summary: dict = {}
    ctx = zmq.Context()
    session = secrets.token_hex(8)
    params = island_params()
    first = Shard(ctx, args.connect)
    shards: list[Shard] = []
    try:
        # hello to the shard we know; its welcome describes the cluster
        welcome, _ = first.request({"kind": "hello", "island": ISLAND, "session": session})
        assert welcome["kind"] == "welcome", welcome
        assert welcome["initialized"] is False and welcome["plan_hash"] is None
        assert welcome["num_shards"] == 2 and welcome["seq"] == 0
        assert isinstance(welcome["max_message_bytes"], int) and welcome["max_message_bytes"] > 0
        num_shards, num_fragments = welcome["num_shards"], welcome["num_fragments"]
        for leaves, s, f, digest in DOC_EXAMPLES:
            assert make_plan(leaves, s, f)["hash"] == digest, "docs/protocol.md section 6.5"
        summary["doc_hashes"] = [digest for *_, digest in DOC_EXAMPLES]
        plan = make_plan(leaves_of(params), num_shards, num_fragments)
        total = sum(math.prod(s) for _, s, _ in plan["leaves"])
        bounds = cut_bounds(total, num_fragments)
        naive = [round(i * total / num_fragments) for i in range(num_fragments + 1)]
        assert bounds != naive, "the parameters should exercise a half-way tie of the cut rule"
        summary.update(plan_hash=plan["hash"], bounds=bounds, owners=plan["fragments"])

        # a DEALER and a hello per shard
        for index, (router, _pub) in enumerate(welcome["endpoints"]):
            shard = first if index == welcome["shard"] else Shard(ctx, router)
            shards.append(shard)
            if shard is not first:
                w, _ = shard.request({"kind": "hello", "island": ISLAND, "session": session})
                assert w["kind"] == "welcome" and w["shard"] == index and not w["initialized"], w
        owned = {i: [f for f, at, _ in plan["fragments"] if at == i] for i in range(num_shards)}
        initial = {f: fragment_values(plan, params, f) for f in range(num_fragments)}

        # init shard 0 in pieces (section 3.2) with zstd frames: pieces smaller than the
        # limit allows (section 8), so each fragment takes three; the others whole, crc32
        limit = welcome["max_message_bytes"]
        most = (limit - limit // 8) // 4
        for index, shard in enumerate(shards):
            if index == 0:
                reply = init_in_pieces(shard, plan, {f: initial[f] for f in owned[0]}, most)
            else:
                tree = {str(f): initial[f] for f in owned[index]}
                frames = encode(tree, "raw", use_zstd=False)
                reply, _ = shard.request({"kind": "init", "island": ISLAND, "plan": plan}, frames)
            assert reply["kind"] == "init_ok", reply
            assert reply["versions"] == {str(f): 0 for f in owned[index]}, reply
        again, _ = shards[1].request({"kind": "init", "island": ISLAND, "plan": plan}, [])
        assert again["kind"] == "rejected" and again["reason"] == "already_initialized", again
        begun, _ = shards[0].request({"kind": "init_begin", "island": "other", "plan": plan})
        assert begun["kind"] == "rejected" and begun["reason"] == "already_initialized", begun
        rewelcome, _ = first.request({"kind": "hello", "island": ISLAND, "session": session})
        assert rewelcome["initialized"] and rewelcome["plan_hash"] == plan["hash"], rewelcome
        assert rewelcome["plan"] == plan, "the shard's wire plan is ours"

        # subscribe, see each PUB's heartbeat (the subscription is live), then snapshot
        for index, shard in enumerate(shards):
            shard.sub = ctx.socket(zmq.SUB)
            shard.sub.setsockopt(zmq.LINGER, 0)
            shard.sub.setsockopt(zmq.SUBSCRIBE, b"")
            shard.sub.connect(welcome["endpoints"][index][1])
        for index, shard in enumerate(shards):  # the subscription is live once one arrives
            beat, _ = shard.published("heartbeat")
            assert beat["shard"] == index and beat["seq"] == 0, beat
        replica: dict[int, tuple[int, np.ndarray]] = {}
        for index, shard in enumerate(shards):
            for f in owned[index]:
                size = fragment_size(plan, f)
                # shard 0's fragments in pieces of 7 elements (section 3.3), the others whole
                count = 7 if index == 0 else size
                parts = []
                for offset in range(0, size, count):
                    ask = {"kind": "snapshot", "island": ISLAND, "fragment": f}
                    if index == 0:
                        ask.update(offset=offset, count=count)
                    reply, payload = shard.request(ask)
                    assert reply["kind"] == "snapshot_reply", reply
                    assert reply["fragment"] == f and reply["version"] == 0 and reply["seq"] == 0
                    assert reply["offset"] == offset and reply["size"] == size, reply
                    parts.append(decode(payload)["values"])
                values = np.concatenate(parts)
                assert values.dtype == F32 and values.shape == (size,)
                assert values.tobytes() == initial[f].tobytes(), "snapshot == init values"
                replica[f] = (0, values)

        # one push per shard: raw float32 + crc32 on shard 0's first fragment, int8 + zstd on
        # shard 1's first fragment
        rng = np.random.default_rng(11)
        pushed = {}
        for index, shard in enumerate(shards):
            f = owned[index][0]
            delta = (0.01 * rng.standard_normal(fragment_size(plan, f))).astype(F32)
            scheme, use_zstd = ("raw", False) if index == 0 else ("int8", True)
            frames = encode({"delta": delta}, scheme, use_zstd)
            sent = decode(frames)["delta"]  # what the shard will merge
            header = {
                "kind": "push",
                "island": ISLAND,
                "round": 0,
                "fragment": f,
                "base_version": 0,
                "tokens": 100,
                "steps": 10,
                "plan_hash": plan["hash"],
                "t_step": 0.05,
            }
            reply, _ = shard.request(header, frames)
            expect_ack(reply, "accepted")
            assert reply["round"] == 0 and reply["fragment"] == f
            assert reply["version"] == 0 and reply["merged_version"] == 1, reply
            pushed[index] = (f, header, frames, sent)

        # each shard steps (async mode) and publishes update seq 1, version 1
        mode = "increment" if args.downlink == "int8" else "full"
        for index, shard in enumerate(shards):
            f, _, _, sent = pushed[index]
            update, payload = shard.published("update")
            assert update["shard"] == index and update["seq"] == 1, update
            assert update["fragment"] == f and update["version"] == 1, update
            assert update["mode"] == mode, update
            assert isinstance(update["credited"][ISLAND], float | int), update
            decoded = decode(payload)["values"]
            version, old = replica[f]
            assert version == 0
            # "increment": add in float32 to the previous version; "full": the new values
            new = np.add(old, decoded, dtype=F32) if mode == "increment" else decoded.astype(F32)
            replica[f] = (1, new)
            # the model moved by -lr * delta (int8 downlink: within one quantization step)
            expected = old - F32(args.lr) * sent
            tol = float(np.abs(F32(args.lr) * sent).max()) / 127 + 1e-6
            assert np.allclose(new, expected, rtol=0, atol=tol), np.abs(new - expected).max()
            reply, snap = shard.request({"kind": "snapshot", "island": ISLAND, "fragment": f})
            assert reply["version"] == 1 and reply["seq"] == 1, reply
            exact = decode(snap)["values"]
            assert exact.tobytes() == new.tobytes(), "replica == snapshot, bit for bit"
        summary["updates_bit_exact"] = True

        # re-send: duplicate, already merged (merged_version = current version)
        f, header, frames, _ = pushed[0]
        reply, _ = shards[0].request(header, frames)
        expect_ack(reply, "duplicate")
        assert reply["version"] == 1 and reply["merged_version"] == 1, reply

        # rejections carry reason and detail
        bad = {**header, "round": 1, "plan_hash": "0" * 64}
        reply, _ = shards[0].request(bad, frames)
        expect_ack(reply, "rejected", "plan_mismatch")
        assert reply["merged_version"] is None
        corrupt = list(frames)
        corrupt[1] = bytes([corrupt[1][0] ^ 1]) + corrupt[1][1:]
        reply, _ = shards[0].request({**header, "round": 1}, corrupt)
        expect_ack(reply, "rejected", "codec_error")
        nested = encode({"delta": np.zeros((1, fragment_size(plan, f)), F32)})
        reply, _ = shards[0].request({**header, "round": 1}, nested)
        expect_ack(reply, "rejected", "bad_shape")
        non_finite = encode({"delta": np.full(fragment_size(plan, f), np.nan, F32)})
        reply, _ = shards[0].request({**header, "round": 1}, non_finite)
        expect_ack(reply, "rejected", "non_finite")
        other = owned[1][0]
        reply, _ = shards[0].request({**header, "round": 1, "fragment": other}, frames)
        expect_ack(reply, "rejected", "unknown_fragment")
        rid = shards[0].send({**header, "v": 2})
        assert shards[0].dealer.poll(int(TIMEOUT_S * 1000))
        raw = msgpack.unpackb(shards[0].dealer.recv_multipart()[0], raw=False)
        assert raw["kind"] == "rejected" and raw["reason"] == "bad_version", raw
        assert raw["id"] == rid and isinstance(raw["detail"], str)
        strict_header_cases(shards[0], header, frames)
        summary["req_socket"] = req_socket_round_trip(ctx, shards[0].router)
        # another connection cannot act as this island while we are live (heard just now)
        intruder = Shard(ctx, shards[0].router)
        try:
            shards[0].request({"kind": "heartbeat", "island": ISLAND})
            reply, _ = intruder.request({"kind": "hello", "island": ISLAND})
            assert reply["kind"] == "rejected" and reply["reason"] == "island_in_use", reply
            shards[0].request({"kind": "heartbeat", "island": ISLAND})
            reply, _ = intruder.request({**header, "round": 2}, frames)
            expect_ack(reply, "rejected", "island_in_use")
        finally:
            intruder.close()

        # heartbeat, status, bye
        for index, shard in enumerate(shards):
            beat, _ = shard.request({"kind": "heartbeat", "island": ISLAND, "t_step": 0.05})
            assert beat["kind"] == "heartbeat" and beat["shard"] == index and beat["seq"] == 1
            assert beat["credited"] > 0, beat
            status, _ = shard.request({"kind": "status"})
            assert status["kind"] == "status_reply", status
            st = status["status"]
            assert st["accepted"] == 1 and st["duplicates"] == (1 if index == 0 else 0), st
            assert st["plan_hash"] == plan["hash"] and ISLAND in st["islands_live"], st
            assert st["versions"] == {str(g): int(g == pushed[index][0]) for g in owned[index]}
            summary.setdefault("rejected", {})[index] = st["rejected"]
        for shard in shards:
            bye, _ = shard.request({"kind": "bye", "island": ISLAND})
            assert bye["kind"] == "bye_ok", bye
    finally:
        for shard in shards or [first]:
            shard.close()
        ctx.term()
    used = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
    assert not used, f"the outside client used {used}"
    summary["forbidden_modules"] = used
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
