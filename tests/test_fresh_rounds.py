"""No fresh round of a live session is refused `replayed_round` (issue 34 item 2).

The examples' settings (islands as threads of one process, fast steps, small
H, async and quorum) through two real shards. The shards' dedup window is cut
to 2 rounds and their request rate to a few a second, so that throttled
pushes are re-sent after later rounds were accepted: with the window alone
those re-sends (fresh rounds, never accepted) were refused `replayed_round`;
with the push's `floor` a shard forgets only rounds the client had acked.
"""

from __future__ import annotations

import threading

import mlp_helpers as mlp
import numpy as np
import pytest

import worker
from paramserver.plumbing import probe

pytestmark = pytest.mark.timeout(240)
FAST = {"heartbeat_interval_s": 0.2, "join_timeout_s": 30.0, "flush_timeout_s": 20.0}


def _island(connect, name, steps, data_dir, out, errors):
    try:
        rng = np.random.default_rng(len(name))
        with worker.join(
            connect, island=name, params=mlp.init_mlp(0), inner_steps=1, data_dir=data_dir, **FAST
        ) as session:
            params = session.params
            opt_state = mlp.OPTIMIZER.init(params)
            for _ in range(steps):
                x, y = mlp.batch(rng)
                params, opt_state, _loss = mlp.train_step(params, opt_state, x, y)
                params = session.step(params, tokens=mlp.BATCH)
        out[name] = session.stats
    except BaseException as exc:  # surfaced by the test
        errors.append(exc)


@pytest.mark.parametrize("mode", ["async", "quorum"])
def test_no_fresh_round_is_refused_as_replayed(cluster, zmq_ctx, tmp_path, mode):
    c = cluster(
        2, mode=mode, quorum=2, dedup_window=2, max_requests_per_s=10.0, request_burst=2,
        max_refusals_per_s=0.0,
    )  # fmt: skip
    out: dict = {}
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_island, args=(c.connect, n, 40, tmp_path / n, out, errors))
        for n in ("a", "b")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    statuses = [probe.shard_status(zmq_ctx, endpoint[0]) for endpoint in c.endpoints]
    shard_refusals = [s["rejected"] for s in statuses]
    island_refusals = {name: dict(stats["rejected"]) for name, stats in out.items()}
    # the race was there: pushes were throttled and re-sent
    assert sum(r.get("throttled", 0) for r in shard_refusals) > 0, shard_refusals
    assert all("replayed_round" not in r for r in shard_refusals), shard_refusals
    final = {
        n: {k: v for k, v in r.items() if k != "throttled"} for n, r in island_refusals.items()
    }
    assert final == {"a": {}, "b": {}}, island_refusals
