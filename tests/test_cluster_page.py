"""The cluster page's endpoint and data: `/`, `/api/cluster`, 404s, the islands' training fields.

Real shards in threads on 127.0.0.1 (conftest's `start_shard`), a real HTTP
server from `serve_metrics`, real ZeroMQ peers and clients. The page in a real
browser is `test_cluster_page_browser.py`.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import numpy as np
import pytest
from client_helpers import clients
from conftest import free_port, wait_for
from shard_helpers import delta_frames, init_payload, plan_for, push_header, small_flat

from paramserver.client import ClientError
from paramserver.ops.cluster_view import History, Sample, island_views, shard_view
from paramserver.ops.metrics import serve_metrics
from paramserver.plumbing.probe import cluster_status


@pytest.fixture
def client():
    yield from clients()


def get(port: int, path: str) -> tuple[int, bytes, str]:
    """(status, body, content type) of one GET."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
            return response.status, response.read(), response.headers["Content-Type"]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers["Content-Type"]


def api(port: int) -> dict:
    status, body, kind = get(port, "/api/cluster")
    assert status == 200 and kind == "application/json"
    return json.loads(body)


@pytest.fixture
def page_server():
    servers = []

    def start(endpoints):
        server = serve_metrics(free_port(), endpoints, host="127.0.0.1")
        servers.append(server)
        return server.server_port

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def initialized_shard(start_shard, peer):
    """A one-shard cluster that island "a" initialised; returns (shard, plan, peer of a)."""
    shard = start_shard(mode="async", shards=1, heartbeat_interval_s=0.5)
    flat = small_flat()
    plan = plan_for(flat)
    island = peer(shard.router, "a")
    island.hello()
    reply, _ = island.request(
        {"kind": "init", "island": "a", "plan": plan.to_wire()}, init_payload(plan, flat)
    )
    assert reply["kind"] == "init_ok", reply
    return shard, plan, island


def test_api_cluster_shows_a_real_shard_and_what_its_island_reported(
    start_shard, peer, page_server
):
    shard, plan, island = initialized_shard(start_shard, peer)
    size = plan.fragments[0].size
    header = {
        **push_header(plan, "a", round=7, fragment=0),
        "inner_loss": 2.5,
        "steps_per_s": 12.0,
        "goodput": 0.75,
    }
    reply, _ = island.request(header, delta_frames(np.full(size, 0.01, np.float32)))
    assert reply["kind"] == "ack" and reply["outcome"] == "accepted", reply
    dead = f"tcp://127.0.0.1:{free_port()}"
    port = page_server([shard.router, dead])

    def two_samples_after_the_step():
        island.request({"kind": "heartbeat", "island": "a"})  # alive; keeps its last report
        view = api(port)
        if not view["shards"]:
            return None  # before the first sample
        up = view["shards"][0]
        if up.get("bytes_in_per_s") is None or up.get("versions", {}).get("0") != 1:
            return None
        return view

    view = wait_for(
        two_samples_after_the_step, "two samples after the step", timeout_s=30, poll_s=0.2
    )
    up, down = view["shards"]
    assert up["up"] and up["shard"] == 0 and up["endpoint"] == shard.router
    assert up["versions"] == {"0": 1, "1": 0}
    assert up["accepted"] == 1 and up["duplicates"] == 0 and up["rejected"] == {}
    assert up["pending"] == {"0": 0, "1": 0} and up["pending_deltas"] == 0
    assert up["pending_bytes"] == 0 and up["max_pending_bytes"] > 0
    assert up["islands_live"] == ["a"] and up["bytes_out"] > 0
    assert up["bytes_in"] >= 4 * sum(f.size for f in plan.fragments)  # the float32 init at least
    assert up["bytes_in_per_s"] >= 0 and up["bytes_out_per_s"] >= 0
    assert down["up"] is False and down["endpoint"] == dead and "no reply" in down["error"]
    (a,) = view["islands"]
    assert a["island"] == "a" and a["live"] is True
    assert a["rounds"] == 1 and a["accepted"] == 1 and a["staleness"] == 0
    assert (a["inner_loss"], a["steps_per_s"], a["goodput"]) == (2.5, 12.0, 0.75)
    assert 0 <= a["last_push_s_ago"] < 30 and 0 <= a["heard_s_ago"] < 30
    assert a["credited_tokens"] > 0
    history = view["history"]
    assert len(history["t"]) >= 2 and history["t"] == sorted(history["t"])
    assert history["versions"]["0"][-1] == 1
    losses = [x for x in history["loss"]["a"] if x is not None]
    assert losses == [2.5]  # one report: one point, however many samples saw it
    assert view["interval_s"] > 0


def test_bad_training_fields_are_refused_and_change_nothing(start_shard, peer):
    shard, plan, island = initialized_shard(start_shard, peer)
    reply, _ = island.request({"kind": "heartbeat", "island": "a", "inner_loss": 3.0})
    assert reply["kind"] == "heartbeat", reply
    for field, value in [
        ("inner_loss", math.nan),
        ("inner_loss", math.inf),
        ("inner_loss", "low"),
        ("steps_per_s", 0),
        ("steps_per_s", -2.0),
        ("goodput", 1.5),
        ("goodput", -0.1),
        ("goodput", True),
    ]:
        reply, _ = island.request({"kind": "heartbeat", "island": "a", field: value})
        assert reply["kind"] == "rejected" and reply["reason"] == "malformed", (field, reply)
        assert field in reply["detail"], reply["detail"]
    size = plan.fragments[1].size
    bad_push = {**push_header(plan, "a", round=1, fragment=1), "goodput": 2.0}
    reply, _ = island.request(bad_push, delta_frames(np.zeros(size, np.float32)))
    assert reply["kind"] == "rejected" and reply["reason"] == "malformed", reply
    status = island.status()
    assert status["islands"]["a"]["inner_loss"] == 3.0  # only the good report was kept
    assert status["accepted"] == 0 and status["rejected"]["malformed"] == 9


def test_client_sends_its_training_report_with_heartbeats(start_shard, client):
    shard = start_shard(mode="async", shards=1)
    c = client(shard.router, "a")
    c.join(small_flat())
    c.report_training(inner_loss=np.float32(1.25), steps_per_s=3.0, goodput=0.5)

    def reported():
        (only,) = cluster_status(shard.router, timeout_s=10)["shards"]
        return only.get("islands", {}).get("a", {}).get("inner_loss") == 1.25 and only

    status = wait_for(reported, "the report to reach the shard")
    assert status["islands"]["a"]["steps_per_s"] == 3.0 and status["islands"]["a"]["goodput"] == 0.5
    for kwargs, named in [
        ({"inner_loss": float("nan")}, "inner_loss must be a finite number, got nan"),
        ({"steps_per_s": 0.0}, "steps_per_s must be a finite number > 0, got 0.0"),
        ({"goodput": 1.01}, "goodput must be a number from 0 to 1, got 1.01"),
        ({"inner_loss": "2"}, "inner_loss must be a finite number, got '2'"),
    ]:
        with pytest.raises(ClientError, match=named):
            c.report_training(**kwargs)


def test_the_page_and_its_files_are_served_and_other_paths_are_404(start_shard, page_server):
    port = page_server([start_shard().router])
    status, body, kind = get(port, "/")
    assert status == 200 and kind.startswith("text/html")
    html = body.decode()
    for src in ("/static/uPlot.iife.min.js", "/static/page.js", "/static/uPlot.min.css"):
        assert src in html
        code, content, _ = get(port, src)
        assert code == 200 and len(content) > 500, src
    assert "://" not in html  # nothing is fetched from elsewhere
    code, license_text, _ = get(port, "/static/uPlot.LICENSE.txt")
    assert code == 200 and b"MIT License" in license_text
    code, metrics, _ = get(port, "/metrics")
    assert code == 200 and b'diloco_shard_up{shard="0"} 1.0' in metrics
    for path in ("/nope", "/static/../metrics.py", "/api", "/api/cluster/x", "/static/"):
        code, text, _ = get(port, path)
        assert code == 404, path
        assert b"not found" in text


# -- the pure parts, with expected values written out by hand ---------------------------


def test_islands_merge_over_shards_newest_report_and_most_staleness():
    def shard(index, credited_a, islands):
        return {"shard": index, "islands_live": ["a"], "credited_tokens": {"a": credited_a},
                "islands": islands}  # fmt: skip

    s0 = shard(0, 10.0, {
        "a": {"heard": 95.0, "last_push": 90.0, "rounds": 3, "accepted": 6,
              "staleness": 1, "reported": 94.0, "inner_loss": 2.0, "goodput": 0.5},
        "b": {"heard": 50.0, "last_push": None, "rounds": 0, "accepted": 0,
              "staleness": None, "reported": None},
    })  # fmt: skip
    s1 = shard(1, 5.0, {
        "a": {"heard": 99.0, "last_push": 80.0, "rounds": 4, "accepted": 4,
              "staleness": 3, "reported": 98.0, "inner_loss": 1.5, "steps_per_s": 8.0},
    })  # fmt: skip
    down = {"shard": 2, "endpoint": "tcp://x:1", "error": "no reply"}
    a, b = island_views([s0, s1, down], now=100.0)
    assert a == {
        "island": "a", "live": True, "heard_s_ago": 1.0, "last_push_s_ago": 10.0,
        "rounds": 4, "accepted": 10, "staleness": 3, "credited_tokens": 15.0,
        "reported_s_ago": 2.0, "inner_loss": 1.5, "steps_per_s": 8.0, "goodput": None,
    }  # fmt: skip
    assert b["live"] is False and b["heard_s_ago"] == 50.0 and b["last_push_s_ago"] is None
    assert b["inner_loss"] is None and b["reported_s_ago"] is None and b["rounds"] == 0


def test_shard_rates_from_two_samples_and_a_restarted_counter():
    before = {"shard": 0, "bytes_in": 1000, "bytes_out": 500}
    now = {"shard": 0, "bytes_in": 5000, "bytes_out": 100, "pending": {"0": 2, "1": 1}}
    row = shard_view(now, before, dt=2.0)
    assert row["bytes_in_per_s"] == 2000.0  # (5000 - 1000) / 2
    assert row["bytes_out_per_s"] is None  # went down: the shard restarted
    assert row["pending_deltas"] == 3
    assert shard_view(now, None, dt=0.0)["bytes_in_per_s"] is None
    assert shard_view({"shard": 1, "error": "gone"}, None, 0.0) == {
        "shard": 1, "endpoint": None, "up": False, "error": "gone"
    }  # fmt: skip


def test_history_plots_each_report_once_and_keeps_the_newest_points():
    history = History(limit=3)

    def status(version, reported, loss):
        report = {"reported": reported, "inner_loss": loss}
        return {"shard": 0, "versions": {"0": version}, "islands": {"a": report}}

    history.add(Sample(1.0, (status(0, 0.5, 3.0),)))
    history.add(Sample(2.0, (status(1, 0.5, 3.0), {"shard": 1, "error": "down"})))
    history.add(Sample(3.0, (status(2, 2.5, 2.0),)))
    history.add(Sample(4.0, (status(3, 2.5, 2.0),)))
    assert history.series() == {
        "t": [2.0, 3.0, 4.0],
        "versions": {"0": [1, 2, 3]},
        "loss": {"a": [None, 2.0, None]},
    }


def test_a_session_reports_its_rounds_mean_loss_and_step_rate(start_shard):
    import worker

    shard = start_shard(mode="async", shards=1)
    params = {"w": np.zeros(8, np.float32)}
    with worker.join(shard.router, island="own", params=params, inner_steps=2) as session:
        params = session.params
        with pytest.raises(ValueError, match="loss must be a number.*got 'low'"):
            session.step(params, tokens=4, loss="low")
        for loss in (4.0, 2.0):  # one round: its mean, 3.0, is reported
            params = session.step({"w": params["w"] - 0.1}, tokens=4, loss=loss)

        def reported():
            (only,) = cluster_status(shard.router, timeout_s=10)["shards"]
            return only.get("islands", {}).get("own", {}).get("inner_loss") == 3.0 and only

        status = wait_for(reported, "the session's report")
        own = status["islands"]["own"]
        assert own["steps_per_s"] > 0 and 0 <= own["goodput"] <= 1 and own["rounds"] == 1
