"""`diloco-server` as a user runs it: real subprocesses, random ports, real shards."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port, wait_for
from shard_helpers import delta_frames, small_flat

from paramserver.client import Client, ClientConfig
from paramserver.plumbing import daemon, probe

CMD_TIMEOUT_S = 90


def run_cli(*args: str, env: dict | None = None, timeout: float = CMD_TIMEOUT_S):
    """Run `diloco-server ARGS` to completion; returns the CompletedProcess."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "paramserver.ops.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


def stepped(connect: str, shard: int) -> bool:
    """Whether `shard` of the cluster at `connect` has stepped fragment 0 (in-process probe)."""
    status = probe.cluster_status(connect)["shards"][shard]
    return status.get("versions", {}).get("0", 0) >= 1


def assert_one_line_error(proc, code: int, *needles: str) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def stop_after(tmp_path):
    """Data dirs to stop at teardown even when a test fails half-way."""
    dirs: list = []
    yield dirs.append
    for data_dir in dirs:
        run_cli("stop", "--data-dir", str(data_dir))


# -- configuration errors: one line, exit 2, no traceback -----------------------------------


@pytest.mark.parametrize(
    "args, needles",
    [
        (["start", "--shards", "0"], ["--shards", "shards=0", "int >= 1"]),
        (["start", "--port", "http"], ["--port", "'http'", "expected int"]),
        pytest.param(["start", "--port", "70000"], ["--port", "70000"], marks=pytest.mark.slow),
        (["start", "--mode", "fast"], ["--mode", "'fast'", "sync"]),
        (["start", "--max-pending-bytes", "0"], ["--max-pending-bytes", "=0", "int >= 1"]),
        pytest.param(
            ["start", "--max-pending-bytes", "lots"],
            ["--max-pending-bytes", "'lots'"],
            marks=pytest.mark.slow,
        ),
        pytest.param(["start", "--no-such-flag"], ["--no-such-flag"], marks=pytest.mark.slow),
        pytest.param(["restart"], ["restart"], marks=pytest.mark.slow),
        pytest.param(
            ["status", "--connect", "127.0.0.1:5555"],
            ["--connect", "127.0.0.1:5555"],
            marks=pytest.mark.slow,
        ),
        pytest.param(["start", "--shard", "0"], ["--cluster"], marks=pytest.mark.slow),
    ],
)
def test_bad_flags_exit_2_with_one_line(args, needles):
    assert_one_line_error(run_cli(*args), 2, *needles)


def test_unknown_key_in_toml_names_file_and_key(tmp_path):
    config = tmp_path / "server.toml"
    config.write_text('mode = "async"\nshard_count = 2\n')
    proc = run_cli("start", "--config", str(config))
    assert_one_line_error(proc, 2, f"{config}:shard_count", "unknown setting", "shards")


def test_bad_environment_value_names_the_variable():
    proc = run_cli("start", env={"DILOCO_SERVER_LIVENESS": "often"})
    assert_one_line_error(proc, 2, "env DILOCO_SERVER_LIVENESS", "'often'", "int")


def test_status_with_nobody_listening_fails_clearly():
    port = free_port()
    proc = run_cli("status", "--connect", f"tcp://127.0.0.1:{port}", "--timeout", "0.5")
    assert_one_line_error(proc, 1, f"tcp://127.0.0.1:{port}", "within 0.5s", "running")


def test_stop_with_nothing_running(tmp_path):
    proc = run_cli("stop", "--data-dir", str(tmp_path))
    assert_one_line_error(proc, 1, "no diloco-server is running", str(tmp_path))


def test_port_taken_is_refused(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = run_cli("start", "--port", str(port), "--data-dir", str(tmp_path / "d"))
    assert_one_line_error(proc, 3, f"port {port}", "already in use")  # 3: pick another port


@pytest.mark.slow
def test_bad_cluster_file(tmp_path):
    cluster = tmp_path / "cluster.toml"
    cluster.write_text('[[shard]]\nrouter = "tcp://127.0.0.1:1"\npub = "10.0.0.1:2"\n')
    proc = run_cli("start", "--cluster", str(cluster), "--shard", "0")
    assert_one_line_error(proc, 2, "shard[0].pub", "'10.0.0.1:2'")
    cluster.write_text('[[shard]]\nrouter = "tcp://127.0.0.1:1"\npub = "tcp://127.0.0.1:2"\n')
    proc = run_cli("start", "--cluster", str(cluster), "--shard", "3")
    assert_one_line_error(proc, 2, "--shard", "3", "lists 1 shard")


# -- life cycle -------------------------------------------------------------------------------


@pytest.mark.slow
def test_detached_cluster_status_client_and_stop(tmp_path, stop_after):
    data_dir = tmp_path / "server"
    port = free_port(4)
    metrics_port = free_port()
    stop_after(data_dir)
    proc = run_cli(
        "start",
        "--detach",
        "--metrics-port",
        str(metrics_port),
        "--shards",
        "2",
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
        "--mode",
        "async",
        "--fsync",
        "false",
    )
    assert proc.returncode == 0, proc.stderr
    assert f"tcp://127.0.0.1:{port}" in proc.stdout
    assert f"cluster page http://127.0.0.1:{metrics_port}/" in proc.stdout, proc.stdout
    supervisor_pid = daemon.read_pid(daemon.pid_path(data_dir))
    assert supervisor_pid and daemon.pid_alive(supervisor_pid)
    shard_pids = [daemon.read_pid(daemon.pid_path(daemon.shard_dir(data_dir, i))) for i in range(2)]
    assert all(pid and daemon.pid_alive(pid) for pid in shard_pids)
    environ = Path(f"/proc/{shard_pids[0]}/environ")  # Linux: the supervisor capped malloc's arenas
    if environ.exists() and "MALLOC_ARENA_MAX" not in os.environ:
        assert b"MALLOC_ARENA_MAX=2" in environ.read_bytes().split(b"\0")

    again = run_cli("start", "--detach", "--port", str(port + 10), "--data-dir", str(data_dir))
    assert_one_line_error(again, 1, "in use by a running diloco-server")

    connect = f"tcp://127.0.0.1:{port}"
    with Client(ClientConfig(connect=connect, island="cli-test", join_timeout_s=30)) as client:
        res = client.join(small_flat(0))
        size = res.plan.fragments[0].size
        client.push(0, 0, 0, 100, 10, delta_frames(np.full(size, 0.01, np.float32)))
        wait_for(lambda: client.stats()["acked"] >= 1, "the ack", timeout_s=30)
        owner = res.plan.fragments[0].shard
        # an ack does not mean the step ran (the shard steps in its own thread)
        wait_for(lambda: stepped(connect, owner), "the acked push's step", timeout_s=30)

        status = run_cli("status", "--connect", connect, "--json")
        assert status.returncode == 0, status.stderr
        shards = json.loads(status.stdout)["shards"]
        assert [s["shard"] for s in shards] == [0, 1]
        for s in shards:
            assert {"versions", "islands_live", "accepted", "rejected"} <= set(s)
            assert "cli-test" in s["islands_live"]
        assert shards[owner]["accepted"] == 1
        assert shards[owner]["versions"]["0"] == 1

        table = run_cli("status", "--connect", connect)
        assert table.returncode == 0 and "cli-test" in table.stdout

        import urllib.request

        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=30) as response:
            metrics = response.read().decode()
        assert 'diloco_shard_up{shard="1"} 1.0' in metrics
        assert f'diloco_shard_accepted_total{{shard="{owner}"}} 1.0' in metrics

    stopped = run_cli("stop", "--data-dir", str(data_dir))
    assert stopped.returncode == 0, stopped.stderr
    assert not daemon.pid_path(data_dir).exists()
    for i in range(2):
        assert not daemon.pid_path(daemon.shard_dir(data_dir, i)).exists()
        assert "drained and stopped" in daemon.log_path(daemon.shard_dir(data_dir, i)).read_text()
    assert "drained and stopped" in daemon.log_path(data_dir).read_text()
    assert not any(daemon.pid_alive(pid) for pid in [supervisor_pid, *shard_pids])


@pytest.mark.slow
def test_foreground_sigterm_drains_and_exits_0(tmp_path):
    data_dir = tmp_path / "server"
    port = free_port(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env["DILOCO_SERVER_FSYNC"] = "false"
    proc = subprocess.Popen(
        [sys.executable, "-m", "paramserver.ops.cli", "start", "--port", str(port)]
        + ["--data-dir", str(data_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + CMD_TIMEOUT_S
        for line in proc.stdout:  # the supervisor logs to stderr (merged here)
            if "cluster ready" in line:
                break
            assert time.monotonic() < deadline
        else:
            raise AssertionError(f"no ready line; exit code {proc.wait()}")
        proc.send_signal(signal.SIGTERM)
        rest = proc.stdout.read()
        assert proc.wait(timeout=CMD_TIMEOUT_S) == 0, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "all 1 shard(s) drained and stopped" in rest
    assert not daemon.pid_path(data_dir).exists()
    assert "drained and stopped" in daemon.log_path(data_dir).read_text()


@pytest.mark.slow
def test_cluster_file_shards_start_and_stop(tmp_path, stop_after):
    data_dir = tmp_path / "server"
    port = free_port(4)
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(
        f'[server]\ndata_dir = "{data_dir}"\nfsync = false\nmode = "async"\n'
        + "".join(
            f'[[shard]]\nrouter = "tcp://127.0.0.1:{port + 2 * i}"\n'
            f'pub = "tcp://127.0.0.1:{port + 2 * i + 1}"\n'
            for i in range(2)
        )
    )
    stop_after(data_dir)
    for i in range(2):
        proc = run_cli("start", "--cluster", str(cluster), "--shard", str(i), "--detach")
        assert proc.returncode == 0, proc.stderr
        assert f"shard {i} of 2 serving" in proc.stdout
        if i == 0:  # shard 1 is not up yet: status shows it as unreachable, exit 1
            half = run_cli(
                "status", "--connect", f"tcp://127.0.0.1:{port}", "--json", "--timeout", "0.5"
            )
            assert half.returncode == 1
            down = json.loads(half.stdout)["shards"][1]
            assert "within 0.5s" in down["error"]
    status = run_cli("status", "--connect", f"tcp://127.0.0.1:{port}", "--json")
    assert status.returncode == 0, status.stderr
    shards = json.loads(status.stdout)["shards"]
    assert [s["endpoint"] for s in shards] == [
        f"tcp://127.0.0.1:{port}",
        f"tcp://127.0.0.1:{port + 2}",
    ]
    stopped = run_cli("stop", "--data-dir", str(data_dir))
    assert stopped.returncode == 0, stopped.stderr
    for i in range(2):
        assert not daemon.pid_path(daemon.shard_dir(data_dir, i)).exists()


# -- the pieces behind status and metrics, in-process against a real shard ----------------


def test_probe_cluster_status_of_a_live_shard(start_shard):
    from paramserver.plumbing import probe

    shard = start_shard()
    result = probe.cluster_status(shard.router, timeout_s=10)
    (only,) = result["shards"]
    assert only["shard"] == 0 and only["endpoint"] == shard.router
    assert only["initialized"] is False and only["islands_live"] == []  # the probe said bye


def test_metrics_endpoint_serves_shard_counters(start_shard):
    import urllib.request

    from paramserver.ops.metrics import serve_metrics

    shard = start_shard()
    dead = f"tcp://127.0.0.1:{free_port()}"
    server = serve_metrics(free_port(), [shard.router, dead], host="127.0.0.1")
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=30) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert 'diloco_shard_up{shard="0"} 1.0' in text
    assert 'diloco_shard_up{shard="1"} 0.0' in text
    assert 'diloco_shard_accepted_total{shard="0"} 0.0' in text
    assert 'diloco_shard_pending_bytes{shard="0"} 0.0' in text


def test_cluster_file_parsing(tmp_path):
    from paramserver.plumbing.clusterfile import load_cluster_file
    from paramserver.plumbing.settings import SettingsError

    path = tmp_path / "cluster.toml"
    path.write_text(
        '[server]\nmode = "sync"\n'
        '[[shard]]\nrouter = "tcp://10.0.0.1:5555"\npub = "tcp://10.0.0.1:5556"\n'
        'router_bind = "tcp://*:5555"\n'
        '[[shard]]\nrouter = "tcp://10.0.0.2:5555"\npub = "tcp://10.0.0.2:5556"\n'
    )
    cluster = load_cluster_file(path)
    assert cluster.server == {"mode": "sync"}
    assert [s.router for s in cluster.shards] == ["tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555"]
    assert cluster.shards[0].router_bind == "tcp://*:5555"
    assert cluster.shards[0].pub_bind == "tcp://10.0.0.1:5556"  # default: the connect address
    for text, match in [
        ("[servers]\n", r"servers: unknown table"),
        ("[server]\n", r"list every shard"),
        ('[[shard]]\nrouter = "tcp://a:1"\n', r"shard\[0\]: missing pub"),
        ('[[shard]]\nrouter = "tcp://a:1"\npub = "tcp://a:2"\nport = 3\n', r"shard\[0\]\.port"),
    ]:
        path.write_text(text)
        with pytest.raises(SettingsError, match=match):
            load_cluster_file(path)


@pytest.mark.slow
def test_client_resends_to_a_frozen_shard_and_the_shard_dedups(tmp_path, stop_after):
    """SIGSTOP the shard process: the client re-sends on ack timeout; after SIGCONT the
    shard sees every copy, applies one and acks the rest as duplicates."""
    data_dir = tmp_path / "server"
    port = free_port(2)
    stop_after(data_dir)
    started = run_cli(
        "start", "--detach", "--port", str(port), "--data-dir", str(data_dir),
        "--mode", "async", "--fsync", "false",
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    shard_pid = daemon.read_pid(daemon.pid_path(data_dir / "shard-0"))
    connect = f"tcp://127.0.0.1:{port}"
    cfg = ClientConfig(connect=connect, island="r", ack_timeout_s=0.1, ack_timeout_cap_s=0.4)
    with Client(cfg) as client:
        res = client.join(small_flat(0))
        os.kill(shard_pid, signal.SIGSTOP)
        try:
            frames = delta_frames(np.full(res.plan.fragments[0].size, 0.1, np.float32))
            client.push(0, 0, 0, 100, 10, frames)
            wait_for(lambda: client.stats()["resent"] >= 2, "two re-sends", timeout_s=30)
            assert client.stats()["acked"] == 0
        finally:
            os.kill(shard_pid, signal.SIGCONT)
        wait_for(lambda: client.stats()["acked"] >= 1, "the ack after SIGCONT", timeout_s=30)
        wait_for(lambda: stepped(connect, 0), "the acked push's step", timeout_s=30)
        status = run_cli("status", "--connect", connect, "--json")
        (shard,) = json.loads(status.stdout)["shards"]
        assert shard["accepted"] == 1 and shard["duplicates"] >= 1
        assert shard["versions"]["0"] == 1  # applied once


def test_rendered_cluster_file_reads_back_the_same(tmp_path):
    from paramserver.plumbing.clusterfile import (
        ShardAddress,
        load_cluster_file,
        render_cluster_file,
    )

    server = {"mode": "quorum", "quorum": 2, "fsync": False, "grace_fraction": 0.5}
    shards = [
        ShardAddress(f"tcp://h{i}:5555", f"tcp://h{i}:5556", "tcp://*:5555", "tcp://*:5556")
        for i in range(2)
    ]
    path = tmp_path / "cluster.toml"
    path.write_text(render_cluster_file({**server, "data_dir": 'C:\\dir "x"'}, shards))
    cluster = load_cluster_file(path)
    assert cluster.server == {**server, "data_dir": 'C:\\dir "x"'}
    assert list(cluster.shards) == shards


# -- a failed start: the reason on the terminal, nothing left behind ----------------------------


def tree(root: Path) -> dict[str, int]:
    """Every file under `root` with its size (logs left out: a failed start appends its reason)."""
    return {
        p.relative_to(root).as_posix(): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != daemon.LOG_FILE
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_start_on_another_clusters_data_dir_says_why_and_leaves_nothing(tmp_path, stop_after):
    data_dir = tmp_path / "server"
    port = free_port(4)
    stop_after(data_dir)
    flags = ("--port", str(port), "--data-dir", str(data_dir), "--fsync", "false")
    first = run_cli("start", "--detach", "--shards", "1", *flags)
    assert first.returncode == 0, first.stderr
    connect = f"tcp://127.0.0.1:{port}"
    with Client(ClientConfig(connect=connect, island="a", join_timeout_s=30)) as client:
        client.join(small_flat(0))  # the shard now holds a model of one shard's plan
    assert run_cli("stop", "--data-dir", str(data_dir)).returncode == 0
    assert (data_dir / "diloco-kind").read_text() == "server\n"  # written once it served
    before = tree(data_dir)
    assert before and not (data_dir / "shard-1").exists()

    for detach in (("--detach",), ()):
        proc = run_cli("start", *detach, "--shards", "2", *flags)
        assert proc.returncode == 1, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert "shard 0" in last and "DurabilityError" in last, proc.stderr
        assert "this process runs (0, 2," in last and "start with an empty one" in last, last
        assert "Traceback" not in last
        assert not (data_dir / "shard-1").exists(), "the failed start left a new shard folder"
        assert tree(data_dir) == before  # nothing written, nothing removed
    assert "Traceback" in daemon.log_path(data_dir / "shard-0").read_text()  # the whole story


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failed_start_in_a_new_data_dir_removes_it(tmp_path, stop_after):
    data_dir = tmp_path / "runs" / "server"
    stop_after(data_dir)
    with socket.socket() as holder:  # the metrics port is taken: the start fails once shards serve
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        metrics_port = holder.getsockname()[1]
        proc = run_cli("start", "--detach", "--port", str(free_port(2)), "--metrics-port",
                       str(metrics_port), "--data-dir", str(data_dir))  # fmt: skip
    assert_one_line_error(proc, 1, "not started", f"metrics port {metrics_port}")
    assert not (tmp_path / "runs").exists()
