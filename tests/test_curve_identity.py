"""CURVE identity: a key acts only as its island ids; status and metrics speak CURVE.

The rule (`paramserver.plumbing.identity`) is tested as pure functions; then on a live
CURVE shard over real sockets on 127.0.0.1: an allow-listed key `isl` acts as
`isl` but its hello, push, heartbeat or bye for another id is refused
`forbidden_island`, logged and counted; an allow map lets it use more ids;
`diloco-server status` (a subprocess) reads a CURVE shard with keys and,
without them, says in one line that CURVE is the likely cause; the metrics
endpoint reports the shard `up` under CURVE.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import urllib.request
from typing import Any

import numpy as np
import pytest
import zmq
from conftest import REPLY_TIMEOUT_S, RunningShard, free_port, wait_for
from curve_helpers import SLOW_HB, curve_shard
from shard_helpers import delta_frames, push_header, small_flat

from paramserver.client import Client, ClientConfig, ClientError
from paramserver.plumbing import identity
from paramserver.plumbing.curve import ClientKeys, CurveError, write_keypair
from paramserver.server.config import ConfigError, ShardConfig
from paramserver.wire import protocol

pytestmark = pytest.mark.timeout(120)
CLI_TIMEOUT_S = 60


# -- the rule, pure --------------------------------------------------------------------------


def test_may_act_as_binds_a_key_to_its_ids():
    allow = {"K1": frozenset({"isl", "isl-b"}), "SERVER": frozenset()}
    assert identity.may_act_as("K1", "isl", allow)
    assert identity.may_act_as("K1", "isl-b", allow)
    assert not identity.may_act_as("K1", "mallory", allow)
    assert not identity.may_act_as("SERVER", "isl", allow)  # the server's own key: no island
    assert not identity.may_act_as("K2", "isl", allow)  # a key the map does not know
    assert not identity.may_act_as(None, "isl", allow)  # no User-Id under CURVE
    assert identity.may_act_as(None, "anyone", None)  # no CURVE: no binding


def test_island_ids_are_the_stems_plus_the_map():
    allow = identity.island_ids(
        {"K1": ["isl"], "K2": ["a", "a-copy"]}, {"isl": ["isl-b", "isl-c"], "a-copy": ["z"]}
    )
    assert allow == {
        "K1": frozenset({"isl", "isl-b", "isl-c"}),
        "K2": frozenset({"a", "a-copy", "z"}),
    }


def test_allow_map_file_is_checked(tmp_path):
    good = tmp_path / "map.toml"
    good.write_text('# extra ids\nisl = ["isl-b"]\nops = []\n')
    assert identity.read_allow_map(good, ["isl", "ops"]) == {
        "isl": frozenset({"isl-b"}),
        "ops": frozenset(),
    }
    cases = [
        ('nobody = ["x"]\n', "no nobody.key"),
        ('isl = "isl-b"\n', "give a list of island ids"),
        ("isl = [1]\n", "give a list of island ids"),
        ('isl = [""]\n', "give a list of island ids"),
        ("isl = [\n", "not valid TOML"),
    ]
    for text, match in cases:
        good.write_text(text)
        with pytest.raises(identity.AllowMapError, match=match):
            identity.read_allow_map(good, ["isl", "ops"])
    with pytest.raises(identity.AllowMapError, match="cannot read"):
        identity.read_allow_map(tmp_path / "missing.toml", ["isl"])


def test_guard_refuses_and_logs_at_most_once_a_minute(caplog):
    caplog.set_level(logging.WARNING, logger="paramserver.plumbing.identity")
    guard = identity.IslandGuard({"K1": frozenset({"isl"})}, {"K1": "isl"}, shard=0)
    assert guard.refusal("K1", "isl", "push", 0.0) is None
    assert guard.refusal("K1", "mallory", "status", 0.0) is None  # status acts as nobody
    assert guard.refusal("K1", "mallory", "snapshot", 0.0) is None  # reading needs no id
    detail = guard.refusal("K1", "mallory", "hello", 100.0)
    assert detail is not None and "key isl may not act as island 'mallory'" in detail
    assert "'isl'" in detail and "curve_allow_map" in detail
    for kind in ("push", "heartbeat", "bye", "init"):
        assert guard.refusal("K1", "mallory", kind, 101.0) is not None
    assert guard.refused == 5
    lines = [r for r in caplog.records if "may not act as" in r.getMessage()]
    assert len(lines) == 1
    guard.refusal("K1", "mallory", "push", 100.0 + identity.LOG_EVERY_S)
    lines = [r for r in caplog.records if "may not act as" in r.getMessage()]
    assert len(lines) == 2 and "4 more since the last such line" in lines[1].getMessage()


def test_allow_map_setting_needs_curve():
    with pytest.raises(ConfigError, match="curve_allow_map"):
        ShardConfig(curve_allow_map="map.toml")


# -- a live CURVE shard ----------------------------------------------------------------------


@pytest.fixture
def keys(tmp_path):
    """Server pair; islands `isl` and `mal` allow-listed; `stranger` not."""
    server_pub, server_secret = write_keypair(tmp_path / "server", "server")
    allow = tmp_path / "allow"
    allow.mkdir()
    out: dict[str, str] = {
        "server_pub": str(server_pub),
        "server_secret": str(server_secret),
        "allow": str(allow),
    }
    for name in ("isl", "mal"):
        public, secret = write_keypair(tmp_path / "islands", name)
        (allow / public.name).write_text(public.read_text())
        out[name] = str(secret)
    out["stranger"] = str(write_keypair(tmp_path / "strangers", "stranger")[1])
    return out


def _curve_shard(tmp_path, keys, allow_map: str = "") -> RunningShard:
    return curve_shard(tmp_path, keys["server_secret"], keys["allow"], allow_map)


class CurvePeer:
    """A raw CURVE DEALER speaking paramserver.wire.protocol (no client library)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, secret: str, server_pub: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        ClientKeys.load(secret, server_pub).apply(self.sock)
        self.sock.connect(endpoint)
        self._ids = iter(range(1, 1_000_000))

    def request(self, header: dict[str, Any], payload: list[Any] = ()) -> dict[str, Any]:
        rid = next(self._ids)
        self.sock.send_multipart(protocol.pack({**header, "id": rid}, list(payload)))
        assert self.sock.poll(int(REPLY_TIMEOUT_S * 1000)), f"no reply to {header['kind']}"
        reply, _ = protocol.unpack(self.sock.recv_multipart(), role=protocol.REPLY)
        assert reply.get("id") == rid, reply
        return reply

    def close(self) -> None:
        self.sock.close(linger=0)


def test_a_key_acts_only_as_its_own_island(tmp_path, keys, zmq_ctx, caplog):
    caplog.set_level(logging.WARNING, logger="paramserver.plumbing.identity")
    shard = _curve_shard(tmp_path, keys)
    isl = _client(shard.router, "isl", keys)
    mal = CurvePeer(zmq_ctx, shard.router, keys["mal"], keys["server_pub"])
    try:
        plan = isl.join(small_flat()).plan  # key isl acts as isl: welcomed, initialises
        size = plan.fragments[0].size

        # key mal acting as isl: every request that acts as an island is refused
        hello = mal.request({"kind": "hello", "island": "isl"})
        assert (hello["kind"], hello["reason"]) == ("rejected", "forbidden_island")
        assert "key mal may not act as island 'isl'" in hello["detail"]
        frames = delta_frames(np.full(size, 0.1, np.float32))
        ack = mal.request(push_header(plan, "isl", 1, 0), frames)
        assert (ack["kind"], ack["outcome"], ack["reason"]) == (
            "ack",
            "rejected",
            "forbidden_island",
        )
        for kind in ("heartbeat", "bye"):
            reply = mal.request({"kind": kind, "island": "isl"})
            assert (reply["kind"], reply["reason"]) == ("rejected", "forbidden_island"), kind

        # key mal as itself is fine; reading needs no island binding
        assert mal.request({"kind": "hello", "island": "mal"})["kind"] == "welcome"
        snap = mal.request({"kind": "snapshot", "island": "mal", "fragment": 0})
        assert snap["kind"] == "snapshot_reply"

        # nothing of it reached the state: isl still live and bound, no delta of mal's
        state = shard.server.state
        assert state is not None
        assert state.counters.rejected == {"forbidden_island": 4}
        assert state.counters.accepted == 0
        assert set(state.last_seen) == {"isl", "mal"}
        isl.push(0, 1, 0, 100, 1, frames)
        wait_for(lambda: isl.stats()["acked"] == 1)
        assert state.counters.accepted == 1

        status = mal.request({"kind": "status"})["status"]
        assert status["rejected"] == {"forbidden_island": 4}
        lines = [r.getMessage() for r in caplog.records if "may not act as" in r.getMessage()]
        assert len(lines) == 1 and "key mal" in lines[0]  # logged once, not four times

        # the client library says why in one error
        mallory = _client(shard.router, "mallory", keys, secret=keys["isl"], join_timeout_s=10)
        with pytest.raises(ClientError, match="forbidden_island"):
            mallory.join(small_flat())
        mallory.close(0)
    finally:
        mal.close()
        isl.close(flush_timeout_s=1.0)
        shard.stop()


def test_an_allow_map_grants_more_ids(tmp_path, keys, zmq_ctx):
    allow_map = tmp_path / "allow-map.toml"
    allow_map.write_text('isl = ["isl-b"]\n')
    shard = _curve_shard(tmp_path, keys, str(allow_map))
    peer = CurvePeer(zmq_ctx, shard.router, keys["isl"], keys["server_pub"])
    try:
        for island in ("isl", "isl-b"):
            assert peer.request({"kind": "hello", "island": island})["kind"] == "welcome"
        reply = peer.request({"kind": "hello", "island": "isl-c"})
        assert reply["reason"] == "forbidden_island" and "'isl', 'isl-b'" in reply["detail"]
        assert peer.request({"kind": "bye", "island": "isl-b"})["kind"] == "bye_ok"
    finally:
        peer.close()
        shard.stop()


def test_a_bad_allow_map_stops_the_shard_clearly(tmp_path, keys):
    allow_map = tmp_path / "allow-map.toml"
    allow_map.write_text('islx = ["isl-b"]\n')
    with pytest.raises(CurveError, match="no islx.key"):
        _curve_shard(tmp_path, keys, str(allow_map))


def _client(router, island, keys, secret=None, join_timeout_s=30.0):
    return Client(
        ClientConfig(
            connect=router,
            island=island,
            join_timeout_s=join_timeout_s,
            curve_secret_key_file=secret or keys[island],
            curve_server_key_file=keys["server_pub"],
            **SLOW_HB,
        )
    )


# -- status and metrics under CURVE ----------------------------------------------------------


def _status_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "paramserver.ops.cli", "status", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )


def test_status_speaks_curve_and_names_curve_when_it_cannot(tmp_path, keys):
    shard = _curve_shard(tmp_path, keys)
    try:
        server_keys = ["--curve-server-key-file", keys["server_pub"]]
        for secret in (keys["server_secret"], keys["isl"]):  # the server's pair, an allowed one
            proc = _status_cli(
                "--connect",
                shard.router,
                "--json",
                "--timeout",
                "10",
                *[
                    "--curve-secret-key-file",
                    secret,
                    *server_keys,
                ],
            )
            assert proc.returncode == 0, proc.stderr
            (only,) = json.loads(proc.stdout)["shards"]
            assert only["shard"] == 0 and only["endpoint"] == shard.router

        # a --timeout far beyond the CLI's own (CLI_TIMEOUT_S): only the failed handshake
        # can end the wait in time
        plain = _status_cli("--connect", shard.router, "--timeout", "3600")
        assert plain.returncode == 1, (plain.stdout, plain.stderr)
        (line,) = plain.stderr.strip().splitlines()
        assert "speaks CURVE" in line and "--curve-secret-key-file" in line, line
        assert "--curve-server-key-file" in line

        stranger = _status_cli(
            "--connect", shard.router, "--timeout", "30",
            "--curve-secret-key-file", keys["stranger"], *server_keys,
        )  # fmt: skip
        assert stranger.returncode == 1
        (line,) = stranger.stderr.strip().splitlines()
        assert "refused our CURVE key" in line and "curve_allow_dir" in line, line

        half = _status_cli("--connect", shard.router, *server_keys)
        assert half.returncode == 2 and "--curve-secret-key-file" in half.stderr
        assert shard.server.state is not None and not shard.server.state.counters.rejected
    finally:
        shard.stop()


def test_a_curve_probe_of_a_plain_shard_says_so_at_once(start_shard, keys, zmq_ctx):
    from paramserver.plumbing import probe

    shard = start_shard()
    curve = ClientKeys.load(keys["isl"], keys["server_pub"])
    # a timeout far beyond the test's (120 s): only the failed handshake ends the wait
    with pytest.raises(probe.ProbeError, match="CURVE"):
        probe.shard_status(zmq_ctx, shard.router, timeout_s=3600, curve=curve)
    assert probe.shard_status(zmq_ctx, shard.router, timeout_s=10)["shard"] == 0


def test_metrics_report_up_under_curve(tmp_path, keys):
    from paramserver.ops.metrics import serve_metrics

    shard = _curve_shard(tmp_path, keys)
    servers = []
    try:
        with_keys = serve_metrics(free_port(), [shard.router], "127.0.0.1", keys["server_secret"])
        servers.append(with_keys)
        without = serve_metrics(free_port(), [shard.router], "127.0.0.1")
        servers.append(without)
        texts = []
        for server in servers:
            url = f"http://127.0.0.1:{server.server_port}/metrics"
            with urllib.request.urlopen(url, timeout=30) as response:
                texts.append(response.read().decode())
        assert 'diloco_shard_up{shard="0"} 1.0' in texts[0]
        assert 'diloco_shard_up{shard="0"} 0.0' in texts[1]  # plain probes cannot get in
        # the cluster page's data comes through the same keys
        pages = []
        for server in servers:
            url = f"http://127.0.0.1:{server.server_port}/api/cluster"

            def first_sample(url=url):
                with urllib.request.urlopen(url, timeout=30) as response:
                    return json.loads(response.read())["shards"]

            pages.append(wait_for(first_sample, "the page's first sample", timeout_s=60)[0])
        assert pages[0]["up"] is True and pages[0]["initialized"] is False
        assert pages[1]["up"] is False and "CURVE" in pages[1]["error"]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
        shard.stop()


@pytest.mark.slow
def test_detached_curve_cluster_status_and_metrics(tmp_path, keys):
    """Real daemons: the supervisor's metrics and `status` both get through CURVE."""
    data_dir, port, metrics_port = tmp_path / "server", free_port(2), free_port()
    start = [
        sys.executable, "-m", "paramserver.ops.cli", "start", "--detach", "--shards", "1",
        "--port", str(port), "--data-dir", str(data_dir), "--fsync", "false",
        "--metrics-port", str(metrics_port),
        "--curve-secret-key-file", keys["server_secret"], "--curve-allow-dir", keys["allow"],
    ]  # fmt: skip
    proc = subprocess.run(start, capture_output=True, text=True, timeout=CLI_TIMEOUT_S * 2)
    assert proc.returncode == 0, proc.stderr
    connect = f"tcp://127.0.0.1:{port}"
    try:
        status = _status_cli(
            "--connect", connect, "--json", "--timeout", "10",
            "--curve-secret-key-file", keys["server_secret"],
            "--curve-server-key-file", keys["server_pub"],
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        assert [s["shard"] for s in json.loads(status.stdout)["shards"]] == [0]
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=30) as response:
            assert 'diloco_shard_up{shard="0"} 1.0' in response.read().decode()
    finally:
        stop = [sys.executable, "-m", "paramserver.ops.cli", "stop", "--data-dir", str(data_dir)]
        stopped = subprocess.run(stop, capture_output=True, text=True, timeout=CLI_TIMEOUT_S * 2)
    assert stopped.returncode == 0, stopped.stderr


def test_an_attached_connection_is_held_to_its_key_too(tmp_path, keys, zmq_ctx):
    shard = _curve_shard(tmp_path, keys)
    peers = [
        CurvePeer(zmq_ctx, shard.router, keys[name], keys["server_pub"])
        for name in ("isl", "isl", "mal")
    ]
    control, bulk, mal = peers
    try:
        hello = {"kind": "hello", "island": "isl", "session": "s-1"}
        assert control.request(hello)["kind"] == "welcome"
        # another key with the right session still may not act as isl
        reply = mal.request({**hello, "attach": True})
        assert (reply["kind"], reply["reason"]) == ("rejected", "forbidden_island")
        assert bulk.request({**hello, "attach": True})["kind"] == "welcome"
        assert bulk.request({"kind": "heartbeat", "island": "isl"})["kind"] == "heartbeat"
        status = control.request({"kind": "status"})["status"]
        assert status["islands_live"] == ["isl"] and status["rejected"] == {"forbidden_island": 1}
    finally:
        for peer in peers:
            peer.close()
        shard.stop()
