"""Pure pieces of the chaos harness: fault schedules from a seed, goodput, recovery, relay corruption."""

from __future__ import annotations

import random

import numpy as np
import pytest
from shard_helpers import delta_frames

import codec
from bench import faults as fl
from bench.children.chaos_relay import corrupt
from worker.goodput import goodput

ISLANDS = ["island-0", "island-1"]


def test_same_seed_same_schedule_and_another_seed_differs():
    a = fl.make_schedule(7, 9, 120.0, ISLANDS, 2)
    assert a == fl.make_schedule(7, 9, 120.0, ISLANDS, 2)
    assert a != fl.make_schedule(8, 9, 120.0, ISLANDS, 2)


def test_schedule_covers_every_kind_in_order_without_overlap():
    faults = fl.make_schedule(3, len(fl.KINDS), 200.0, ISLANDS, 2, settle_s=5.0)
    assert sorted(f.kind for f in faults) == sorted(fl.KINDS)
    assert [f.at_s for f in faults] == sorted(f.at_s for f in faults)
    for prev, nxt in zip(faults, faults[1:], strict=False):
        assert prev.end_s <= nxt.at_s
    assert faults[0].at_s >= 5.0 and faults[-1].end_s <= 195.0
    for f in faults:
        assert f.target.startswith("shard-") == (f.kind == "kill_shard")
        assert f.target in ISLANDS or f.target in ("shard-0", "shard-1")


@pytest.mark.timeout(10)
def test_the_soak_schedule_leaves_each_fault_time_to_recover():
    # an hour with 120 faults (slot (3600 - 6) / 120 = 29.95 s, faults of 4 s starting within
    # the slot's first quarter): >= 0.75 x 29.95 - 4 = 18.5 s quiet after each, more than an
    # island's restart (~10 s on a loaded machine); every kind 13 or 14 times
    for seed in range(3):
        faults = fl.make_schedule(seed, 120, 3600.0, ISLANDS, 2, settle_s=3.0)
        quiet = [nxt.at_s - prev.end_s for prev, nxt in zip(faults, faults[1:], strict=False)]
        assert min(quiet) >= 0.75 * (3594 / 120) - 4.0
        counts = {k: sum(f.kind == k for f in faults) for k in fl.KINDS}
        assert set(counts.values()) <= {13, 14}, counts
        assert faults[-1].end_s <= 3597.0


def test_schedule_rejects_what_cannot_be_run():
    assert fl.make_schedule(1, 0, 10.0, ISLANDS, 1) == []
    with pytest.raises(ValueError, match="do not fit"):
        fl.make_schedule(1, 20, 30.0, ISLANDS, 1)
    with pytest.raises(ValueError, match="fault kinds"):
        fl.make_schedule(1, 2, 60.0, ISLANDS, 1, kinds=["meteor"])
    with pytest.raises(ValueError, match="kind"):
        fl.Fault.from_json({"kind": "meteor", "target": "x", "at_s": 1, "duration_s": 1})


def test_fault_json_round_trip_and_activity_window():
    f = fl.Fault("drop", "island-0", 10.0, 2.0, prob=0.5)
    assert fl.Fault.from_json(f.to_json()) == f
    assert fl.active([f], 9.99) == [] and fl.active([f], 10.0) == [f]
    assert fl.active([f], 11.99) == [f] and fl.active([f], 12.0) == []


def test_goodput_recovery_and_ack_keys():
    assert goodput(90.0, 100.0) == pytest.approx(0.9)
    assert goodput(5.0, 0.0) is None
    # tokens over seconds, summed: 300 / 7 (the median round's rate would say 50)
    assert fl.training_rate([(100.0, 1.0), (100.0, 4.0), (100.0, 2.0)]) == pytest.approx(300 / 7)
    assert fl.training_rate([(100.0, 1.0), (100.0, 2.0)]) == pytest.approx(200 / 3)
    assert fl.training_rate([]) is None
    assert fl.recovery_s(10.0, [3.0, 12.5, 11.0]) == pytest.approx(1.0)
    assert fl.recovery_s(10.0, [3.0]) is None
    keys = fl.ack_keys([["a", 0, 5, "accepted", 1.0], ["a", 0, 5, "duplicate", 2.0], ["b", 1, 5]])
    assert keys == {("a", 0, 5), ("b", 1, 5)}
    tokens = {("a", 0, 5): 100, ("b", 1, 5): 100}
    assert fl.useful_tokens(keys, tokens, fragments=2) == 100.0


def test_corrupting_a_push_is_caught_by_the_codec_checksum():
    frames = [b"header", *(bytes(f) for f in delta_frames(np.ones(64, np.float32), "int8"))]
    bad = corrupt(frames, random.Random(0))
    assert bad[0] == frames[0] and bad != frames
    with pytest.raises(codec.CodecError):
        codec.decode(bad[1:])
    assert corrupt([b"header"], random.Random(0)) == [b"header"]
