"""RDA through the live shard state: a tensor cut into 1, 2 or 4 fragments merges as a whole.

Three islands push the same deltas to `ShardState`s (sync mode, SGD at rate 1,
uniform weights) whose plans cut the tensors into 1, 2 or 4 fragments on 1 or
2 shards. Expected values: a float64 numpy reference of the whole-tensor rule,
merged = c * (sum_i |d_i|) * phi(sum_i phi(d_i)) per tensor (c = 1/3, checked
by the mean rule), written here from the definition. The same steps replayed
from the write-ahead log give the same bits.
"""

import numpy as np
import pytest

from paramserver.server.config import ShardConfig
from paramserver.server.state import ShardState
from paramserver.server.storage.shard_storage import ShardStorage
from paramserver.server.storage.wal import (
    LogReader,
    WriteAheadLog,
    event_to_record,
    record_to_event,
)
from paramserver.wire.plan import LeafSpec, leaf_specs, make_plan
from paramserver.wire.protocol import ACCEPTED
from tests.shard_helpers import delta_frames, init_payload, push_header

pytestmark = pytest.mark.timeout(120)

T0 = 1_000_000.0
ISLANDS = ("p", "q", "r")
# "a/w" fills fragments 0-1 of 4 (shard 0 of 2), "b" fragments 2-3 (shard 1)
SIZES = {"a/w": 40, "b": 40}


def params():
    rng = np.random.default_rng(1)
    return {path: rng.standard_normal(n).astype(np.float32) for path, n in SIZES.items()}


def island_deltas():
    """Per island and tensor: a shared part on the first half, independent noise everywhere."""
    rng = np.random.default_rng(5)
    shared = {path: rng.standard_normal(n) for path, n in SIZES.items()}
    out = {}
    for k, island in enumerate(ISLANDS):
        out[island] = {}
        for path, n in SIZES.items():
            d = (0.5 + k) * rng.standard_normal(n)
            d[: n // 2] += 2.0 * shared[path][: n // 2]
            out[island][path] = d.astype(np.float32)
    return out


def reference(flat, deltas, merge):
    out = {}
    for path in SIZES:
        ds = [deltas[i][path].astype(np.float64) for i in ISLANDS]
        if merge == "mean":
            merged = sum(ds) / 3
        else:
            direction = sum(d / np.linalg.norm(d) for d in ds)
            merged = sum(np.linalg.norm(d) for d in ds) / 3 * direction / np.linalg.norm(direction)
        out[path] = flat[path].astype(np.float64) - merged
    return out


def run_cluster(merge, shards, fragments):
    """One round through real ShardStates; returns the new params and each shard's events."""
    cfg = ShardConfig(shards=shards, fragments=fragments, mode="sync", fsync=False,
                      outer_optimizer="sgd",
                      outer_lr=1.0, weighting="uniform", merge=merge,
                      downlink="float32")  # fmt: skip
    flat, deltas = params(), island_deltas()
    plan = make_plan(leaf_specs(flat), shards, fragments)
    states, events = [], []
    for index in range(shards):
        state = ShardState(cfg, index)
        out = state.initialize(plan.to_wire(), init_payload(plan, flat, index))
        assert out.status == ACCEPTED
        for island in ISLANDS:
            state.hello(island, T0)
        states.append(state)
        events.append([out.event])
    for island in ISLANDS:  # every push of the round arrives before the first step
        for frag in plan.fragments:
            header = push_header(plan, island, 1, frag.index, 0)
            vec = plan.gather(deltas[island], frag.index)
            out = states[frag.shard].submit_delta(header, delta_frames(vec), T0)
            assert out.status == ACCEPTED
            events[frag.shard].append(out.event)
    new = {path: np.zeros(n, np.float32) for path, n in SIZES.items()}
    for index, state in enumerate(states):
        due, _ = state.due_fragments(T0)
        assert due == [f.index for f in plan.fragments_of(index)]
        for fragment in due:
            event, update = state.step(fragment, T0)
            events[index].append(event)
            plan.scatter(fragment, update.values, new)
    return plan, flat, deltas, new, events, cfg


@pytest.mark.parametrize("merge", ["rda", "mean"])
@pytest.mark.parametrize("shards, fragments", [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4)])
def test_a_cut_tensor_merges_as_a_whole_for_one_two_and_four_fragments(merge, shards, fragments):
    plan, flat, deltas, new, _, _ = run_cluster(merge, shards, fragments)
    if fragments == 4:  # each tensor is cut in two, both pieces on one shard
        assert [len(f.slices) for f in plan.fragments] == [1, 1, 1, 1]
        assert len({f.shard for f in plan.fragments if f.slices[0].path == "a/w"}) == 1
    want = reference(flat, deltas, merge)
    for path in SIZES:
        np.testing.assert_allclose(new[path], want[path], rtol=1e-6, atol=1e-6, err_msg=path)


def test_the_whole_tensor_merge_differs_from_per_piece_norms_here():
    # the reference is not the per-piece rule in disguise: per piece, the halves differ
    _, flat, deltas, _, _, _ = run_cluster("rda", 1, 1)
    piece = piece_rule(deltas, "a/w", 20)
    whole = flat["a/w"][20:] - reference(flat, deltas, "rda")["a/w"][20:]
    assert np.max(np.abs(piece - whole)) > 1e-2


@pytest.mark.parametrize("shards, fragments", [(1, 4), (2, 4)])
def test_replaying_the_logged_steps_gives_the_same_bits(tmp_path, shards, fragments):
    plan, _, _, _, events, cfg = run_cluster("rda", shards, fragments)
    assert any(e.outside for shard in events for e in shard if hasattr(e, "outside"))
    for index, shard_events in enumerate(events):
        path = tmp_path / f"shard{index}.log"
        log = WriteAheadLog(path, fsync=False)
        for event in shard_events:
            log.append(*event_to_record(event))
        log.close()
        live = ShardState(cfg, index)
        for event in shard_events:
            live.apply(event)
        replica = ShardState(cfg, index)  # its cache of sibling Grams is empty: the log decides
        for record in LogReader(path):
            replica.apply(record_to_event(record))
        for f in plan.fragments_of(index):
            assert replica.snapshot(f.index)[1].tobytes() == live.snapshot(f.index)[1].tobytes()


def one_shard_of_four_fragments():
    """A 1-shard, 4-fragment rda state with the islands known, and a push function."""
    cfg = ShardConfig(fragments=4, mode="sync", fsync=False, outer_optimizer="sgd", outer_lr=1.0,
                      weighting="uniform", merge="rda", downlink="float32")  # fmt: skip
    flat, deltas = params(), island_deltas()
    plan = make_plan(leaf_specs(flat), 1, 4)
    state = ShardState(cfg, 0)
    state.initialize(plan.to_wire(), init_payload(plan, flat))
    for island in ISLANDS:
        state.hello(island, T0)

    def send(island, fragment):
        vec = plan.gather(deltas[island], fragment)
        header = push_header(plan, island, 1, fragment, 0)
        assert state.submit_delta(header, delta_frames(vec), T0).status == ACCEPTED

    return plan, flat, deltas, state, send


def piece_rule(deltas, path, lo):
    """RDA over elements [lo:] of `path` alone (the per-piece rule), c = 1/3."""
    d = [deltas[i][path][lo:].astype(np.float64) for i in ISLANDS]
    direction = sum(x / np.linalg.norm(x) for x in d)
    return sum(np.linalg.norm(x) for x in d) / 3 * direction / np.linalg.norm(direction)


def test_a_sibling_without_the_pushes_is_left_out():
    # only fragment 1 gets the round: fragment 0 holds none of its pushes and never
    # stepped them, so fragment 1's piece of "a/w" is normalised on its own
    _, flat, deltas, state, send = one_shard_of_four_fragments()
    for island in ISLANDS:
        send(island, 1)
    event, update = state.step(1, T0)
    assert event.outside == ()
    want = flat["a/w"][20:] - piece_rule(deltas, "a/w", 20)
    np.testing.assert_allclose(update.values, want, rtol=1e-6, atol=1e-6)


def test_in_sync_mode_a_due_piece_waits_for_its_siblings_round_then_both_are_whole():
    # the round's pushes arrive fragment by fragment: fragment 0 is due first
    plan, flat, deltas, state, send = one_shard_of_four_fragments()
    for island in ISLANDS:
        send(island, 0)
    send("p", 1)
    due, _ = state.due_fragments(T0)
    assert due == []  # fragment 0 is due, but fragment 1 is mid-round
    for island in ("q", "r"):
        send(island, 1)
    due, _ = state.due_fragments(T0)
    assert due == [0, 1]
    new = {path: v.copy() for path, v in flat.items()}
    for fragment in (0, 1):
        plan.scatter(fragment, state.step(fragment, T0)[1].values, new)
    want = reference(flat, deltas, "rda")["a/w"]
    np.testing.assert_allclose(new["a/w"], want, rtol=1e-6, atol=1e-6)
    # the mean never waits
    mean = ShardState(ShardConfig(fragments=4, mode="sync", fsync=False), 0)
    assert mean.stepper.groups.ready(state.plan, 0, "sync", state.fragments, [0]) == [0]


def test_a_checkpoint_between_a_groups_steps_recovers_the_same_bits(tmp_path):
    # fragment 1's step takes fragment 0's Gram from fragment 0's step (no longer
    # pending); a checkpoint between the two steps does not hold it, the log does
    cfg = ShardConfig(fragments=4, mode="sync", fsync=False, outer_optimizer="sgd", outer_lr=1.0,
                      weighting="uniform", merge="rda", downlink="float32",
                      data_dir=str(tmp_path), checkpoint_every_steps=0, checkpoint_every_s=0)  # fmt: skip
    flat, deltas = params(), island_deltas()
    plan = make_plan(leaf_specs(flat), 1, 4)
    storage = ShardStorage(cfg, 0)
    state = storage.recover()
    storage.append([state.initialize(plan.to_wire(), init_payload(plan, flat)).event])
    for island in ISLANDS:
        state.hello(island, T0)
        for fragment in (0, 1):
            vec = plan.gather(deltas[island], fragment)
            out = state.submit_delta(
                push_header(plan, island, 1, fragment, 0), delta_frames(vec), T0
            )
            storage.append([out.event])
    storage.append([state.step(0, T0)[0]])
    storage.sync()
    assert storage.checkpoint(state, T0)
    event, _ = state.step(1, T0)
    assert [g.fragment for g in event.outside] == [0]
    storage.append([event])
    storage.sync()
    storage.close()
    recovered = ShardStorage(cfg, 0).recover()
    for f in (0, 1):
        assert recovered.snapshot(f)[1].tobytes() == state.snapshot(f)[1].tobytes()
    new = {path: v.copy() for path, v in flat.items()}
    for f in (0, 1):
        plan.scatter(f, recovered.snapshot(f)[1], new)
    np.testing.assert_allclose(
        new["a/w"], reference(flat, deltas, "rda")["a/w"], rtol=1e-6, atol=1e-6
    )


def test_a_data_dir_written_under_the_greedy_placement_says_why_it_cannot_resume(tmp_path):
    from paramserver.server.fragment import InitEvent
    from paramserver.server.storage.recovery import DurabilityError

    cfg = ShardConfig(shards=2, fragments=3, fsync=False, data_dir=str(tmp_path))
    leaves = [LeafSpec("a", (4, 5), "float32"), LeafSpec("b", (7,), "float16")]
    wire = make_plan(leaves, 2, 3).to_wire()
    assert [f[1] for f in wire["fragments"]] == [0, 0, 1]
    # the same cut as the older version placed it (greedy: 0, 1, 0) and its hash
    wire["fragments"] = [[f[0], s, f[2]] for f, s in zip(wire["fragments"], (0, 1, 0), strict=True)]
    wire["hash"] = "0f07894d5b21740ec07bd0fad323dac5ab41f6071468898ea54a6005bbd71e76"
    storage = ShardStorage(cfg, 0)
    storage.recover()
    values = {0: np.zeros(9, np.float32), 2: np.zeros(9, np.float32)}
    storage.append([InitEvent(wire, values)])
    storage.sync()
    storage.close()
    with pytest.raises(DurabilityError, match="contiguous runs of fragments") as caught:
        ShardStorage(cfg, 0).recover()
    assert "start with an empty one" in str(caught.value)
