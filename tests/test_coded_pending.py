"""Pending deltas kept coded: bit-equal merges against a numpy reference, their size, the budget.

The reference decoder here is written from the format's text (codec/format.py) with numpy,
msgpack and zstandard only; expected parameters are merged by hand in float32.
"""

from __future__ import annotations

import gc
import tracemalloc
from dataclasses import replace

import msgpack
import numpy as np
import pytest
import zstandard
from conftest import wait_for
from shard_helpers import delta_frames, init_payload, plan_for, push_header, small_flat

import codec
from codec.coded import read_coded as read
from paramserver.client import Client, ClientConfig
from paramserver.server.config import ShardConfig
from paramserver.server.state import ShardState
from paramserver.server.step.merge import Segment, chunk_merge, rda_merge
from paramserver.server.storage.checkpoint import export_state, restore_state
from paramserver.wire.plan import Fragment, Slice
from paramserver.wire.protocol import ACCEPTED, REJECTED

pytestmark = pytest.mark.timeout(60)
T0 = 1_000_000.0
SLOW_HB = {"heartbeat_interval_s": 5.0, "liveness": 20}


def numpy_decode(frames) -> np.ndarray:
    """The one int8/int4 tensor of a message, decoded by the format's text."""
    head = msgpack.unpackb(bytes(frames[0]), raw=False)
    pieces = [bytes(f) for f in frames[1:]]
    if head["zstd"]:
        pieces = [zstandard.ZstdDecompressor().decompress(p) for p in pieces]
    payload = np.frombuffer(b"".join(pieces), np.uint8)
    (_, shape, _, offset) = head["tensors"][0]
    n, block = int(np.prod(shape)), head["block"]
    if head["scheme"] == "int8":
        levels, codes_bytes = 127, n
        q = payload[offset : offset + n].view(np.int8).astype(np.float32)
    else:
        levels, codes_bytes = 7, (n + 1) // 2
        packed = payload[offset : offset + codes_bytes]
        q = np.empty(2 * codes_bytes, np.float32)
        q[0::2], q[1::2] = (
            (packed & 15).astype(np.float32) - 8,
            (packed >> 4).astype(np.float32) - 8,
        )
        q = q[:n]
    start = offset + -(-codes_bytes // 4) * 4
    m = payload[start : start + 4 * -(-n // block)].view(np.float32)
    step = m * np.float32(1 / levels)  # float32 times float32
    return q * np.repeat(step, block)[:n]


def random_delta(n: int, seed: int, scale: float = 0.01) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


@pytest.mark.parametrize("c", [codec.int8(), codec.int8(zstd_level=None), codec.int4()])
def test_a_coded_tensor_decodes_any_range_like_the_numpy_reference(c):
    n = 70_001  # more than one merge piece, a short last block
    frames, _ = c.encode({"delta": random_delta(n, 1)})
    [t] = read(frames)
    want = numpy_decode(frames)
    for lo, hi in [(0, n), (0, 1), (3, 700), (256, 512), (n - 5, n), (1000, 69_999)]:
        out = np.empty(hi - lo, np.float32)
        t.decode_into(lo, hi, out)
        assert out.tobytes() == want[lo:hi].tobytes(), (lo, hi)
    per = 1.0 if c.scheme == "int8" else 0.5
    assert t.nbytes == int(np.ceil(per * n)) + 4 * -(-n // c.block_size)  # codes + scales


@pytest.mark.parametrize("c", [codec.topk(), codec.raw("float32"), codec.raw("bfloat16")])
def test_topk_and_raw_ranges_match_decode(c):
    n = 5_000
    frames, _ = c.encode({"delta": random_delta(n, 2)})
    [t] = read(frames)
    want = codec.decode(frames)["delta"]
    for lo, hi in [(0, n), (17, 4_000), (n - 1, n)]:
        out = np.empty(hi - lo, np.float32)
        t.decode_into(lo, hi, out)
        assert out.tobytes() == want[lo:hi].tobytes()


def _state(**kw) -> tuple[ShardState, object, object]:
    """A one-shard state of 150,000 parameters in 2 fragments: (state, plan, its init event)."""
    cfg = ShardConfig(mode="sync", fsync=False, outer_optimizer="sgd", outer_lr=1.0,
                      weighting="uniform", downlink="float32", **kw)  # fmt: skip
    flat = {"w": random_delta(150_000, 0, 1.0)}
    plan = plan_for(flat, 1, 2)
    state = ShardState(cfg, 0)
    out = state.initialize(plan.to_wire(), init_payload(plan, flat))
    assert out.status == ACCEPTED
    return state, plan, out.event


def test_a_step_of_coded_deltas_is_bit_equal_to_a_hand_merge(start_shard, peer):
    shard = start_shard(mode="sync", outer_optimizer="sgd", outer_lr=1.0, weighting="uniform",
                        downlink="float32", **SLOW_HB)  # fmt: skip
    flat = {"w": random_delta(150_000, 0, 1.0)}
    plan = plan_for(flat, 1, 2)
    a, b = peer(shard.router, "a"), peer(shard.router, "b")
    a.hello(), b.hello()
    reply, _ = a.request({"kind": "init", "island": "a", "plan": plan.to_wire()},
                         init_payload(plan, flat))  # fmt: skip
    assert reply["kind"] == "init_ok", reply
    size = plan.fragments[0].size
    before = plan.gather(flat, 0)
    # sync: the step comes when b, the last live island, has a delta pending
    pushes = [("a", 1, codec.int8()), ("a", 2, codec.int8(zstd_level=None)), ("b", 1, codec.int4())]
    decoded = []
    for k, (island, rnd, c) in enumerate(pushes):
        frames, _ = c.encode({"delta": random_delta(size, 10 + k)})
        decoded.append((island, numpy_decode(frames)))
        ack, _ = (a if island == "a" else b).request(push_header(plan, island, rnd, 0), frames)
        assert ack["outcome"] == "accepted", ack
        if k == 1:  # a's two int8 deltas wait for b's: their codes and scales, as kept
            assert a.status()["pending_bytes"] == 2 * (size + 4 * -(-size // 256))
    status = wait_for(lambda: (s := a.status())["versions"]["0"] == 1 and s, "the step")
    assert status["pending_bytes"] == 0
    # uniform weighting: c = 1/2 per island; mean: sum of c_i * delta in float32, in order
    merged = decoded[0][1] * np.float32(0.5)
    for _, d in decoded[1:]:
        merged += d * np.float32(0.5)
    _, got = a.snapshot(0, size)
    assert np.asarray(got).tobytes() == (before - merged).tobytes()


def test_fills_over_any_split_equal_one_whole_fill():
    n = 140_000
    frag = Fragment(
        0, 0, (Slice("a", 0, 70_000), Slice("embed", 0, 30_000), Slice("c", 0, 40_000)), n
    )
    islands = [("a", codec.int8()), ("b", codec.int4()), ("a", codec.topk()), ("c", codec.int8())]
    deltas = []
    for k, (island, c) in enumerate(islands):
        frames, _ = c.encode({"delta": random_delta(n, 20 + k)})
        deltas.append((island, read(frames)[0]))
    coefficients = [0.5, 0.3, 0.4, 0.2]  # one per delta
    for rule in ("mean", "rda"):
        merge = chunk_merge(rule, deltas, coefficients, frag)
        whole = merge.whole()
        pieces = np.empty(n, np.float32)
        for lo, hi in [(0, 1), (1, 65_537), (65_537, 65_600), (65_600, 139_999), (139_999, n)]:
            merge.fill(lo, hi, pieces[lo:hi])
        assert pieces.tobytes() == whole.tobytes(), rule


def test_rda_of_coded_deltas_matches_a_float64_reference():
    n = 90_000  # one segment over more than one merge piece
    frames = [codec.int8().encode({"delta": random_delta(n, 30 + k)})[0] for k in range(3)]
    sums = {"a": numpy_decode(frames[0]) + numpy_decode(frames[1]), "b": numpy_decode(frames[2])}
    deltas = [("a", read(frames[0])[0]), ("b", read(frames[2])[0]), ("a", read(frames[1])[0])]
    frag = Fragment(0, 0, (Slice("w", 0, n),), n)
    got = chunk_merge("rda", deltas, [0.6, 0.2, 0.6], frag)
    # u_i = sum_k c_ik d_ik, C_i = sum_k c_ik: u_a = 0.6 * sum_a, C_a = 1.2; u_b = 0.2 * d_b
    u = {"a": 0.6 * sums["a"].astype(np.float64), "b": 0.2 * sums["b"].astype(np.float64)}
    weight = {"a": 1.2, "b": 0.2}
    norm = sum(np.linalg.norm(u[k]) for k in u)
    direction = sum(weight[k] * u[k] / np.linalg.norm(u[k]) for k in u)
    want = norm * direction / np.linalg.norm(direction)
    np.testing.assert_allclose(got.whole(), want, rtol=2e-5, atol=1e-9)
    # one delta per island: the per-island factor of rda_merge (C_i = c_i) is the
    # old one, (sum_i c_i |v_i|) * phi(sum_i c_i phi(v_i))
    one = rda_merge([sums["a"], sums["b"]], [0.6, 0.2], [Segment(0, n)])
    v = {k: d.astype(np.float64) for k, d in sums.items()}
    direction = 0.6 * v["a"] / np.linalg.norm(v["a"]) + 0.2 * v["b"] / np.linalg.norm(v["b"])
    norm = 0.6 * np.linalg.norm(v["a"]) + 0.2 * np.linalg.norm(v["b"])
    want = norm * direction / np.linalg.norm(direction)
    np.testing.assert_allclose(one, want, rtol=2e-5, atol=1e-9)


def test_pending_deltas_keep_their_coded_size_not_a_decoded_copy():
    state, plan, _ = _state()
    for island in ("a", "b", "c"):
        state.hello(island, T0)
    size = plan.fragments[0].size
    frames = [codec.int8().encode({"delta": random_delta(size, k)})[0] for k in range(3)]
    coded = size + 4 * -(-size // 256)
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        for k, island in enumerate(("a", "b")):
            out = state.submit_delta(push_header(plan, island, 1, 0), frames[k], T0)
            assert out.status == ACCEPTED
            del out  # the event holds the frames for the log, until it is written
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert state.pending_bytes() == 2 * coded
    assert state.status(T0)["pending_bytes"] == 2 * coded
    assert coded < 1.03 * size
    assert grown < 2 * 1.3 * size, grown  # two decoded float32 copies would be 8 B/param


def test_the_budget_refuses_too_many_pending_and_a_step_frees_it():
    kept = 75_000 + 4 * -(-75_000 // 256)  # what an int8 delta of a fragment keeps
    budget = 2 * kept + 100
    state, plan, init = _state(max_pending_bytes=budget)
    for island in ("a", "b", "c"):
        state.hello(island, T0)
    events = [init]

    def push(island, fragment, seed):
        size = plan.fragments[fragment].size
        frames, _ = codec.int8().encode({"delta": random_delta(size, seed)})
        out = state.submit_delta(push_header(plan, island, 1, fragment), frames, T0)
        if out.event is not None:
            events.append(out.event)
        return out

    assert push("a", 0, 1).status == ACCEPTED
    assert push("b", 0, 2).status == ACCEPTED
    refused = push("c", 1, 3)
    assert (refused.status, refused.reason) == (REJECTED, "too_many_pending")
    assert f"max_pending_bytes={budget}" in refused.detail
    assert state.counters.rejected == {"too_many_pending": 1}
    assert push("c", 0, 4).reason == "too_many_pending"
    events.append(state.step(0, T0)[0])  # merges a's and b's deltas
    assert state.pending_bytes() == 0
    assert push("c", 1, 3).status == ACCEPTED
    assert push("a", 1, 5).status == ACCEPTED  # two fit again
    # a log accepted under a larger budget replays under a smaller one: replay is never refused
    replica = ShardState(replace(state.cfg, max_pending_bytes=1), 0)
    for event in events:
        replica.apply(event)
    assert replica.pending_bytes() == state.pending_bytes() > 1
    assert replica.snapshot(0)[1].tobytes() == state.snapshot(0)[1].tobytes()


def test_one_island_cannot_fill_the_budget_the_others_still_get_in():
    kept = 75_000 + 4 * -(-75_000 // 256)  # what an int8 delta of a fragment keeps
    state, plan, _ = _state(max_pending_bytes=10 * kept, max_pending_bytes_per_island=2 * kept)
    assert state.status(T0)["max_pending_bytes_per_island"] == 2 * kept
    for island in ("flood", "b"):
        state.hello(island, T0)

    def push(island, rnd, fragment):
        size = plan.fragments[fragment].size
        frames, _ = codec.int8().encode({"delta": random_delta(size, rnd)})
        return state.submit_delta(push_header(plan, island, rnd, fragment), frames, T0)

    assert push("flood", 1, 0).status == ACCEPTED
    assert push("flood", 1, 1).status == ACCEPTED  # 2 x kept: at its share
    refused = push("flood", 2, 0)  # refused before its payload is read
    assert (refused.reason, state.pending_bytes("flood")) == ("too_many_pending", 2 * kept)
    assert "max_pending_bytes_per_island" in refused.detail
    assert push("b", 1, 0).status == ACCEPTED  # the shard's budget has room for the others
    assert state.pending_bytes() == 3 * kept
    state.step(0, T0)
    assert push("flood", 2, 0).status == ACCEPTED  # its step freed flood's share
    # the default share is a quarter of the shard's budget
    assert ShardConfig(max_pending_bytes=1000).pending_bytes_per_island == 250


@pytest.mark.slow
def test_a_client_defers_a_push_over_the_budget_and_lands_it_after_the_step(start_shard, peer):
    # quorum 1 with a fixed 3 s grace window: b's delta waits 3 s for company, long enough
    # for the client's push to find the budget (one int8 delta of 168 elements) full
    kept = 168 + 4  # int8 codes + one block scale
    shard = start_shard(mode="quorum", quorum=1, grace_rule="fraction", grace_min_s=3.0,
                        grace_max_s=3.0, fragments=1, max_pending_bytes=kept + kept // 2,
                        liveness=20)  # fmt: skip
    client = Client(ClientConfig(connect=shard.router, island="a", heartbeat_interval_s=0.2))
    try:
        plan = client.join(small_flat()).plan
        b = peer(shard.router, "b")
        b.hello()
        frames = delta_frames(random_delta(168, 1), "int8")
        ack, _ = b.request(push_header(plan, "b", 1, 0), frames)
        assert ack["outcome"] == "accepted", ack
        client.push(0, 1, 0, 1000, 10, delta_frames(random_delta(168, 2), "int8"))
        wait_for(lambda: client.stats()["deferred"] >= 1, "the push to be deferred")
        stats = wait_for(lambda: (s := client.stats())["acked"] >= 1 and s, "the re-send's ack")
        assert stats["rejected"] == {}  # deferred, never finally rejected
        status = b.status()
        assert status["rejected"]["too_many_pending"] >= 1
        assert status["versions"]["0"] >= 1  # b's delta was stepped, freeing the budget
        assert status["accepted"] == 2
    finally:
        client.close(flush_timeout_s=1.0)


def test_a_checkpoint_stores_pending_deltas_coded_and_restores_them():
    state, plan, _ = _state()
    for island in ("a", "b"):
        state.hello(island, T0)
    size = plan.fragments[0].size
    frames = codec.int8().encode({"delta": random_delta(size, 7)})[0]
    assert state.submit_delta(push_header(plan, "a", 1, 0), frames, T0).status == ACCEPTED
    state.fragments[0].pending[0] = replace(state.fragments[0].pending[0], clip=0.5)
    meta, arrays = export_state(state)
    assert arrays["pending/0/0/codes"].dtype == np.int8
    assert arrays["pending/0/0/codes"].nbytes == size  # codes, not a float32 copy
    restored = restore_state(state.cfg, 0, meta, arrays)
    [c] = restored.fragments[0].pending
    assert c.clip == 0.5 and c.delta.scheme == "int8"
    out = np.empty(size, np.float32)
    c.delta.decode_into(0, size, out)
    assert out.tobytes() == numpy_decode(frames).tobytes()
    # an older checkpoint kept the decoded float32 delta: it restores as raw float32
    meta["fragments"][0]["pending"][0] = meta["fragments"][0]["pending"][0][:6]
    old = {k: v for k, v in arrays.items() if not k.startswith("pending/")}
    old["pending/0/0"] = out
    [c] = restore_state(state.cfg, 0, meta, old).fragments[0].pending
    assert (c.delta.scheme, c.clip) == ("raw", 1.0) and c.delta.codes.tobytes() == out.tobytes()


def test_the_default_island_budget_admits_two_whole_model_deltas_of_the_island():
    kept = 75_000 + 4 * -(-75_000 // 256)  # what an int8 delta of a fragment keeps
    # the shard's budget holds 5 fragment deltas: a quarter of it is 1.25, less than one round
    state, plan, _ = _state(max_pending_bytes=5 * kept)
    assert state.island_budget(kept, 75_000) == 2 * 2 * kept  # two rounds of two fragments
    state.hello("a", T0)

    def push(rnd, fragment):
        frames, _ = codec.int8().encode({"delta": random_delta(75_000, rnd)})
        return state.submit_delta(push_header(plan, "a", rnd, fragment), frames, T0)

    for rnd in (1, 2):  # two whole-model deltas of a, pending at once
        assert push(rnd, 0).status == ACCEPTED and push(rnd, 1).status == ACCEPTED
    refused = push(3, 0)  # a third is over its share
    assert refused.reason == "too_many_pending" and "per_island" in refused.detail
    # an explicit setting is the budget, whatever the deltas
    explicit, _, _ = _state(max_pending_bytes=5 * kept, max_pending_bytes_per_island=kept)
    assert explicit.island_budget(kept, 75_000) == kept
