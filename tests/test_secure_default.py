"""Secure by default: plain TCP only on loopback, unless CURVE keys or --insecure.

A shard that would bind a host other than loopback without CURVE refuses to
start (one line naming both ways out, exit 2, nothing created); with
`--insecure`, or with the keys `diloco-server keys --islands` writes, it starts
and serves. An island refuses to talk plain TCP to an endpoint other than
loopback, its `connect` (at validation, before any connection) and every shard a
welcome names, unless `insecure`. Real subprocesses for the daemons, real
sockets; the "elsewhere" shard of a cluster file is 192.0.2.10 (TEST-NET-1,
never contacted: the join fails before connecting to it). A client reaches a
local shard through tcp://0.0.0.0:PORT (Linux connects that to this host), an
endpoint that the rule counts as not loopback.
"""

from __future__ import annotations

import logging
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port, wait_for
from shard_helpers import delta_frames, small_flat
from test_server_cli import assert_one_line_error, run_cli

from paramserver.client import Client, ClientConfig, ClientConfigError, ClientError
from paramserver.client.welcome import leaves_of, read_welcome
from paramserver.plumbing.curve import CurveError
from paramserver.plumbing.exposure import endpoint_host, is_loopback, plain_tcp_problem
from paramserver.plumbing.keyset import parse_islands, write_key_set
from paramserver.plumbing.settings import SettingsError, load_settings
from paramserver.server.config import ShardConfig

pytestmark = pytest.mark.timeout(180)

ELSEWHERE = "192.0.2.10"  # TEST-NET-1: a documentation address, never reached here
WAYS_OUT = ("--curve-secret-key-file", "--curve-allow-dir", "diloco-server keys", "--insecure")


def _names(table: dict[str, list[str]]):
    return lambda name: table.get(name, [])


def test_the_loopback_rule():
    names = _names({"localhost": ["127.0.0.1", "::1"], "lan": ["127.0.0.1", "10.0.0.7"]})
    for host in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "::ffff:127.0.0.1", "localhost"):
        assert is_loopback(host, names), host
    for host in ("0.0.0.0", "*", "::", "", "10.0.0.1", ELSEWHERE, "fe80::1", "lan", "nowhere"):
        assert not is_loopback(host, names), host
    assert endpoint_host("tcp://[::1]:5555") == "::1"
    assert endpoint_host("tcp://10.0.0.1;127.0.0.1:5555") == "127.0.0.1"  # SOURCE;HOST
    assert endpoint_host("ipc:///tmp/x") is None
    plain = {"curve": False, "insecure": False, "resolver": names}
    assert "0.0.0.0, which is not a loopback" in plain_tcp_problem("0.0.0.0", **plain)
    assert "on *," in plain_tcp_problem("tcp://*:5555", **plain)
    for local in ("tcp://127.0.0.1:5555", "tcp://localhost:1", "ipc:///tmp/s", "inproc://s"):
        assert plain_tcp_problem(local, **plain) is None, local
    for way_out in ({"curve": True}, {"insecure": True}):
        assert plain_tcp_problem("tcp://*:5555", **{**plain, **way_out}) is None


# -- the shard's side ---------------------------------------------------------------------


def test_a_plain_shard_off_loopback_refuses_to_start(tmp_path):
    data_dir = tmp_path / "server"
    proc = run_cli("start", "--host", "0.0.0.0", "--data-dir", str(data_dir))
    assert_one_line_error(proc, 2, "--host", "0.0.0.0", "not a loopback address", *WAYS_OUT)
    env = {"DILOCO_SERVER_HOST": "10.1.2.3", "DILOCO_SERVER_DATA_DIR": str(data_dir)}
    assert_one_line_error(run_cli("start", env=env), 2, "env DILOCO_SERVER_HOST", *WAYS_OUT)
    config = tmp_path / "server.toml"
    config.write_text(f'host = "*"\ndata_dir = "{data_dir}"\n')
    assert_one_line_error(run_cli("start", "--config", str(config)), 2, "'*'", *WAYS_OUT)
    assert not data_dir.exists()


def test_insecure_is_a_setting_like_every_other(tmp_path):
    config = tmp_path / "server.toml"
    config.write_text('host = "0.0.0.0"\ninsecure = true\n')
    assert load_settings(ShardConfig, file=config).insecure is True
    env = {"X_HOST": "0.0.0.0", "X_INSECURE": "true"}
    assert load_settings(ShardConfig, env=env, env_prefix="X_").host == "0.0.0.0"
    with pytest.raises(SettingsError, match="not a loopback"):
        load_settings(ShardConfig, env={**env, "X_INSECURE": "false"}, env_prefix="X_")
    keys = {"curve_secret_key_file": "s.key_secret", "curve_allow_dir": "allow"}
    assert ShardConfig(host="0.0.0.0", **keys).insecure is False  # CURVE: no need
    for host in ("127.0.0.1", "localhost", "::1"):
        assert ShardConfig(host=host).host == host


@pytest.mark.slow
def test_insecure_plain_shard_on_every_interface_serves(tmp_path):
    data_dir = tmp_path / "server"
    port = free_port(2)
    proc = run_cli(
        "start", "--detach", "--host", "0.0.0.0", "--insecure", "--port", str(port),
        "--data-dir", str(data_dir), "--mode", "async", "--fsync", "false",
    )  # fmt: skip
    try:
        assert proc.returncode == 0, proc.stderr
        # the welcome's map: a wildcard bind is reached on loopback (local_endpoints)
        assert f"islands connect to tcp://127.0.0.1:{port}" in proc.stdout
        wide = f"tcp://0.0.0.0:{port}"  # reaches this host, but is no loopback address
        with pytest.raises(ClientConfigError, match="insecure=True"):
            ClientConfig(connect=wide, island="a")
        cfg = ClientConfig(connect=wide, island="a", insecure=True, join_timeout_s=60)
        with Client(cfg) as client:
            res = client.join(small_flat(0))
            size = res.plan.fragments[0].size
            client.push(0, 0, 0, 100, 10, delta_frames(np.full(size, 0.01, np.float32)))
            wait_for(lambda: client.stats()["acked"] >= 1, "the ack", timeout_s=60)
        import worker  # a session takes the same setting: joins the cluster the client made

        flat = small_flat(0)
        tree = {"a": {"w": flat["a/w"]}, "b": flat["b"]}
        settings = {"insecure": True, "exchange": "host", "join_timeout_s": 60}
        with worker.join(wide, island="s", params=tree, inner_steps=1, **settings) as session:
            assert session.version >= 1  # it holds the global model the client pushed to
    finally:
        run_cli("stop", "--data-dir", str(data_dir))


def _cluster_file(tmp_path: Path, port: int) -> Path:
    """Shard 0 binds every interface (islands here reach it on loopback); shard 1 is elsewhere."""
    path = tmp_path / "cluster.toml"
    path.write_text(
        f'[server]\ndata_dir = "{tmp_path / "server"}"\nfsync = false\nmode = "async"\n'
        f'[[shard]]\nrouter = "tcp://127.0.0.1:{port}"\npub = "tcp://127.0.0.1:{port + 1}"\n'
        f'router_bind = "tcp://0.0.0.0:{port}"\npub_bind = "tcp://0.0.0.0:{port + 1}"\n'
        f'[[shard]]\nrouter = "tcp://{ELSEWHERE}:5555"\npub = "tcp://{ELSEWHERE}:5556"\n'
    )
    return path


@pytest.mark.slow
def test_cluster_file_shard_off_loopback_and_a_welcome_naming_a_shard_elsewhere(tmp_path):
    port = free_port(2)
    cluster = _cluster_file(tmp_path, port)
    refused = run_cli("start", "--cluster", str(cluster), "--shard", "0", "--detach")
    assert_one_line_error(
        refused, 2, f"shard[0] binds tcp://0.0.0.0:{port}", "not a loopback", *WAYS_OUT
    )
    assert not (tmp_path / "server").exists()
    started = run_cli("start", "--cluster", str(cluster), "--shard", "0", "--insecure", "--detach")
    try:
        assert started.returncode == 0, started.stderr
        # a plain island on loopback: shard 0 is fine, but its welcome names shard 1 elsewhere
        cfg = ClientConfig(connect=f"tcp://127.0.0.1:{port}", island="a", join_timeout_s=60)
        with Client(cfg) as client, pytest.raises(ClientError) as failed:
            client.join(small_flat(0))
        message = str(failed.value)
        assert f"shard 1 at tcp://{ELSEWHERE}:5555" in message and "insecure=True" in message
        assert "curve_secret_key_file" in message and len(message.splitlines()) == 1
    finally:
        run_cli("stop", "--data-dir", str(tmp_path / "server"))


# -- the islands' side ----------------------------------------------------------------------


def test_client_refuses_plain_tcp_off_loopback_unless_insecure_or_curve():
    far = f"tcp://{ELSEWHERE}:5555"
    with pytest.raises(ClientConfigError, match=rf"connect='{far}'.*insecure=True"):
        ClientConfig(connect=far, island="a")
    assert ClientConfig(connect=far, island="a", insecure=True).insecure is True
    keys = {"curve_secret_key_file": "a.key_secret", "curve_server_key_file": "server.key"}
    assert ClientConfig(connect=far, island="a", **keys).connect == far
    for local in ("tcp://127.0.0.1:5555", "tcp://localhost:5555", "ipc:///tmp/x", "inproc://x"):
        assert ClientConfig(connect=local, island="a").connect == local
    with pytest.raises(ClientConfigError, match="insecure"):
        ClientConfig(connect=local, island="a", insecure="yes")


def test_a_welcome_naming_a_shard_elsewhere_is_refused():
    welcome = {
        "kind": "welcome", "shard": 0, "num_shards": 2, "num_fragments": 2,
        "endpoints": [["tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"],
                      ["tcp://127.0.0.1:5557", f"tcp://{ELSEWHERE}:5558"]],
        "initialized": False, "plan_hash": None, "heartbeat_interval_s": 1.0, "liveness": 5,
    }  # fmt: skip
    leaves = leaves_of(small_flat(0))
    cfg = ClientConfig(connect="tcp://127.0.0.1:5555", island="a")
    with pytest.raises(ClientError, match=rf"shard 1 at tcp://{ELSEWHERE}:5558: plain TCP"):
        read_welcome(welcome, cfg, leaves)
    trusted = ClientConfig(connect="tcp://127.0.0.1:5555", island="a", insecure=True)
    assert read_welcome(welcome, trusted, leaves).endpoints[1][1] == f"tcp://{ELSEWHERE}:5558"


def test_worker_join_refuses_before_connecting_and_takes_insecure():
    import worker
    from worker.session_config import session_config

    far = f"tcp://{ELSEWHERE}:5555"
    params = {"w": np.zeros(4, np.float32)}
    with pytest.raises(ValueError, match=r"IslandConfig\.connect.*insecure=True"):
        worker.join(far, island="a", params=params, inner_steps=1, join_timeout_s=0.5)
    cfg = session_config(far, "a", 1, None, {"insecure": True})
    assert cfg.client_config().insecure is True and cfg.client_config().connect == far


def _worker_cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    argv = [sys.executable, "-m", "worker.cli", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)


def test_worker_commands_refuse_plain_tcp_off_loopback(tmp_path):
    far = f"tcp://{ELSEWHERE}:5555"
    data_dir = tmp_path / "island"
    ways = ("curve_secret_key_file", "curve_server_key_file", "--insecure", "diloco-server keys")
    start = _worker_cli("start", "--connect", far, "--data-dir", str(data_dir))
    assert_one_line_error(start, 2, "--connect", far, "not a loopback", *ways)
    assert not data_dir.exists()
    assert_one_line_error(_worker_cli("eval", "--connect", far), 2, "--connect", *ways)
    # `--insecure` alone is true: the endpoint passes and the next bad setting is named
    passed = _worker_cli("start", "--connect", far, "--insecure", "--model", "huge")
    assert_one_line_error(passed, 2, "--model", "huge")


# -- keys for a whole cluster -------------------------------------------------------------


def _printed(stdout: str, command: str) -> list[list[str]]:
    return [shlex.split(line) for line in stdout.splitlines() if line.strip().startswith(command)]


@pytest.mark.slow
def test_keys_islands_writes_a_working_set(tmp_path):
    out = tmp_path / "keys"
    made = run_cli("keys", "--out", str(out), "--islands", "island-a,island-b")
    assert made.returncode == 0, made.stderr
    for secret in (out / "server.key_secret", *out.glob("islands/*/*.key_secret")):
        assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600, secret
    assert sorted(p.name for p in (out / "allow").iterdir()) == ["island-a.key", "island-b.key"]
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    again = run_cli("keys", "--out", str(out), "--islands", "island-b")
    assert_one_line_error(again, 2, "island-b.key", "exists", "never overwritten")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before

    (server,) = _printed(made.stdout, "diloco-server start")
    workers = _printed(made.stdout, "diloco-worker start")
    islands = {argv[argv.index("--island") + 1]: argv for argv in workers}
    assert sorted(islands) == ["island-a", "island-b"] and "0.0.0.0" in server
    data_dir, port = tmp_path / "server", free_port(2)
    flags = ["--port", str(port), "--data-dir", str(data_dir), "--mode", "async"]
    started = run_cli(*server[1:], *flags, "--fsync", "false", "--detach")  # the printed line
    try:
        assert started.returncode == 0, started.stderr
        island = islands["island-a"]
        option = lambda name: island[island.index(name) + 1]  # noqa: E731
        cfg = ClientConfig(  # not loopback, no --insecure: CURVE is the way
            connect=f"tcp://0.0.0.0:{port}",
            island="island-a",
            join_timeout_s=60,
            curve_secret_key_file=option("--curve-secret-key-file"),
            curve_server_key_file=option("--curve-server-key-file"),
        )
        with Client(cfg) as client:
            res = client.join(small_flat(0))
            size = res.plan.fragments[0].size
            client.push(0, 0, 0, 100, 10, delta_frames(np.full(size, 0.01, np.float32)))
            wait_for(lambda: client.stats()["acked"] >= 1, "the ack", timeout_s=60)
    finally:
        run_cli("stop", "--data-dir", str(data_dir))


def test_keys_islands_refuses_bad_lists_and_half_a_server_pair(tmp_path):
    for text, needle in (("a,,b", "separated by commas"), ("a,a", "twice"), ("a/b", "letters")):
        with pytest.raises(CurveError, match=needle):
            parse_islands(text)
    with pytest.raises(CurveError, match="server pair's name"):
        write_key_set(tmp_path, ["server"])
    (tmp_path / "server.key").write_text("a public key without its secret\n")
    with pytest.raises(CurveError, match="server.key exists without its pair"):
        write_key_set(tmp_path, ["a"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server.key"]  # nothing written


def test_metrics_off_loopback_says_it_asks_for_a_token(caplog):
    from paramserver.ops.metrics import serve_metrics

    for host, warned in (("127.0.0.1", False), ("0.0.0.0", True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="paramserver.ops.metrics"):
            server = serve_metrics(0, [], host=host)
            server.shutdown()
            server.server_close()
        said = [r.getMessage() for r in caplog.records if "ask for the token" in r.getMessage()]
        assert bool(said) is warned, (host, said)
