"""Streaming fragments: the push schedule (hand-computed table), sync refusal, a real island."""

from __future__ import annotations

import threading

import jax_cache
import pytest
from client_helpers import RecordingClient
from conftest import Cluster

from worker.config import IslandConfig
from worker.push_thread import (
    StreamingError,
    check_streaming_mode,
    due_fragments,
    flush_fragments,
    fragment_offsets,
)

# (H, P) -> offsets floor(p * H / P), computed by hand
OFFSETS = [
    (8, 4, [0, 2, 4, 6]),
    (10, 4, [0, 2, 5, 7]),  # 10/4 = 2.5, 20/4 = 5, 30/4 = 7.5
    (3, 4, [0, 0, 1, 2]),  # H < P: 3/4 -> 0, 6/4 -> 1, 9/4 -> 2
    (5, 1, [0]),
    (1, 2, [0, 0]),
    (100, 8, [0, 12, 25, 37, 50, 62, 75, 87]),
]

# (step k done in the round, H, P) -> fragments due; offset 0 is the round's end (k = H)
DUE = [
    (1, 8, 4, []),
    (2, 8, 4, [1]),
    (3, 8, 4, []),
    (4, 8, 4, [2]),
    (6, 8, 4, [3]),
    (8, 8, 4, [0]),
    (2, 10, 4, [1]),
    (5, 10, 4, [2]),
    (7, 10, 4, [3]),
    (10, 10, 4, [0]),
    (1, 3, 4, [2]),
    (2, 3, 4, [3]),
    (3, 3, 4, [0, 1]),
    (4, 5, 1, []),
    (5, 5, 1, [0]),
    (1, 1, 2, [0, 1]),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("h", "p", "expected"), OFFSETS)
def test_offsets_table(h, p, expected):
    assert fragment_offsets(h, p) == expected


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("step", "h", "p", "expected"), DUE)
def test_due_table(step, h, p, expected):
    assert due_fragments(step, h, p) == expected


@pytest.mark.timeout(10)
@pytest.mark.parametrize("h", [1, 2, 3, 7, 8, 50])
@pytest.mark.parametrize("p", [1, 2, 4, 5, 8])
def test_every_fragment_is_due_exactly_once_per_round(h, p):
    pushed = [f for k in range(1, h + 1) for f in due_fragments(k, h, p)]
    assert sorted(pushed) == list(range(p))


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("step", "h", "p"), [(0, 8, 4), (9, 8, 4), (1, 0, 4), (1, 8, 0)])
def test_out_of_range_is_refused(step, h, p):
    with pytest.raises(ValueError):
        due_fragments(step, h, p)


@pytest.mark.timeout(10)
def test_flush_takes_the_fragments_with_unsent_steps():
    assert flush_fragments({0: 0, 1: 6, 2: 4, 3: 0}) == [1, 2]
    assert flush_fragments({0: 0, 1: 0}) == []


@pytest.mark.timeout(10)
def test_streaming_refuses_a_sync_cluster_in_one_line():
    with pytest.raises(StreamingError) as info:
        check_streaming_mode(True, "sync")
    assert "mode sync" in str(info.value) and "\n" not in str(info.value)
    check_streaming_mode(False, "sync")
    check_streaming_mode(True, "quorum")
    check_streaming_mode(True, "async")


@pytest.mark.timeout(30)
def test_streaming_flag_is_documented_and_off_by_default():
    from worker.cli import _parser

    assert IslandConfig().streaming is False
    start = _parser()._subparsers._group_actions[0].choices["start"]
    text = " ".join(start.format_help().split())
    assert "--streaming" in text and "floor(p * H / P)" in text


def _island_cfg(tmp_path, connect: str, streaming: bool) -> IslandConfig:
    return IslandConfig(
        connect=connect,
        island="s",
        data_dir=str(tmp_path / "island"),
        compile_cache_dir=jax_cache.DIR,
        inner_steps=8,
        batch_size=2,
        seq_len=16,
        warmup_steps=0,
        eval_every=0,
        max_rounds=2,
        streaming=streaming,
        heartbeat_interval_s=0.2,
        flush_timeout_s=5.0,
    )


def _run_island(cfg: IslandConfig) -> list[tuple[int, int, int, int]]:
    from worker.island import Island

    made: list[RecordingClient] = []

    def factory(client_cfg):
        made.append(RecordingClient(client_cfg))
        return made[-1]

    island = Island(cfg, client_factory=factory)
    assert island.run(threading.Event()) == 0
    return [(p.fragment, p.round, p.steps, p.tokens) for p in made[0].pushes]


def _pushes_on_a_4_fragment_shard(tmp_path, streaming: bool) -> list:
    """The pushes of one island run against a fresh async shard with 4 fragments."""
    cluster = Cluster(tmp_path, shards=1, mode="async", fragments=4)
    try:
        return _run_island(_island_cfg(tmp_path, cluster.connect, streaming=streaming))
    finally:
        cluster.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_streaming_island_pushes_each_fragment_at_its_step_and_flushes_at_the_end(tmp_path):
    pushes = _pushes_on_a_4_fragment_shard(tmp_path, streaming=True)
    tokens_per_step = 2 * 16
    base = pushes[0][1]
    # H = 8, P = 4: offsets 0, 2, 4, 6; round 0, round 1, then the flush (a new round id)
    expected = [
        (1, 0, 2), (2, 0, 4), (3, 0, 6), (0, 0, 8),
        (1, 1, 8), (2, 1, 8), (3, 1, 8), (0, 1, 8),
        (1, 2, 6), (2, 2, 4), (3, 2, 2),
    ]  # fmt: skip
    assert [(f, r - base, s) for f, r, s, _ in pushes] == expected
    assert all(t == s * tokens_per_step for _, _, s, t in pushes)
    for fragment in range(4):  # every fragment carries the same 16 steps as without streaming
        assert sum(s for f, _, s, _ in pushes if f == fragment) == 16


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_without_streaming_every_fragment_is_pushed_at_the_round_end(tmp_path):
    pushes = _pushes_on_a_4_fragment_shard(tmp_path, streaming=False)
    base = pushes[0][1]
    expected = [(f, r, 8) for r in (0, 1) for f in range(4)]
    assert [(f, r - base, s) for f, r, s, _ in pushes] == expected


@pytest.mark.timeout(120)
def test_a_streaming_island_refuses_a_sync_cluster(tmp_path):
    cluster = Cluster(tmp_path, shards=1, mode="sync", fragments=4)
    try:
        with pytest.raises(StreamingError, match="mode sync"):
            _run_island(_island_cfg(tmp_path, cluster.connect, streaming=True))
    finally:
        cluster.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_two_process_streaming_island_pushes_through_the_announced_gather(tmp_path):
    """Each streaming push gathers the parameters through the call process 0 announces."""
    from test_multihost_island import metrics, run_island

    # P = 2 fragments, 2 rounds: each process warms up (compiles, slowly across processes)
    # a push, a fold and a refund per fragment; two fragments are already pushed mid-round
    run = run_island(
        tmp_path, "s", 2, 2, "--streaming", "true",
        shard_flags=("--mode", "async", "--fragments", "2"), rounds=2,
    )  # fmt: skip
    versions = run["versions"]
    # H = 4, P = 2: fragment 1 at step 2, fragment 0 at step 4; 2 rounds, then fragment 1
    # flushed: 5 pushes, every one accepted (a version counts steps: a step may merge two
    # pushes of a fragment when the shard lags, so versions are only known to have moved)
    assert len(versions) == 2 and all(int(v) >= 1 for v in versions.values()), versions
    assert run["shard"]["accepted"] == 2 * 2 + 1, run["shard"]
    final = [r for r in metrics(tmp_path / "s-p0") if r.get("final")][-1]
    assert final["pushes"] == 2 * 2 + 1 and final["acked"] == final["pushes"], final
    follower = run["status"][1]
    assert follower["state"] == "stopped" and "client" not in follower
