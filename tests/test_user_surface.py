"""What a user sees of the daemons (issue 34): status of a dead island, data dirs that know
their kind, the small things of a first run. Real commands as subprocesses, no tracebacks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax_cache
import pytest
from conftest import Cluster

from paramserver.plumbing import daemon
from worker import island_files

ROOT = Path(__file__).resolve().parent.parent
CMD_TIMEOUT_S = 60
FAST = ("--model", "tiny", "--batch-size", "2", "--seq-len", "16", "--eval-every", "0",
        "--inner-steps", "2", "--heartbeat-interval-s", "0.2", "--compile-cache-dir", jax_cache.DIR)  # fmt: skip


def run(*argv: str, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run a command to completion with no DILOCO_ settings from the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    return subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def worker(*args: str, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess:
    return run(sys.executable, "-m", "worker.cli", *args, timeout=timeout)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_island(data_dir: Path, state: str, age_s: float, pid: int | None = None) -> None:
    """An island data dir as a daemon leaves it: a status file written `age_s` ago, a pid file."""
    data_dir.mkdir(parents=True, exist_ok=True)
    status = {"island": "a", "state": state, "round": 3, "updated": time.time() - age_s}
    (data_dir / island_files.STATUS_FILE).write_text(json.dumps(status))
    if pid is not None:
        daemon.pid_path(data_dir).write_text(f"{pid}\n")


# -- status of an island that is not running ---------------------------------------------------


def test_status_of_an_island_gone_while_training_says_so_and_fails(tmp_path):
    data_dir = tmp_path / "island"
    write_island(data_dir, "training", 42, pid=dead_pid())  # killed -9: its files say training
    proc = worker("status", "--data-dir", str(data_dir))
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    state = next(line for line in proc.stdout.splitlines() if line.strip().startswith("state:"))
    assert re.search(r"not running \(last seen \d+ s ago, was training\)$", state), proc.stdout
    as_json = worker("status", "--data-dir", str(data_dir), "--json")
    assert as_json.returncode == 3 and json.loads(as_json.stdout)["running"] is False


def test_status_of_a_stopped_island_says_when_it_stopped(tmp_path):
    data_dir = tmp_path / "island"
    write_island(data_dir, "stopped", 600)
    proc = worker("status", "--data-dir", str(data_dir))
    assert proc.returncode == 3, proc.stderr
    # 600 s old when written; the command may start seconds later on a busy machine, so the
    # minutes are checked against the age it printed, not against the clock
    stopped = re.search(r"not running \(stopped (\d+) min ago\)", proc.stdout)
    updated = re.search(r"updated: (\d+) s ago", proc.stdout)
    assert stopped and updated, proc.stdout
    minutes, age_s = int(stopped[1]), int(updated[1])
    assert age_s >= 600 and abs(minutes * 60 - age_s) <= 31, proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_status_of_an_island_killed_with_9(tmp_path):
    cluster = Cluster(tmp_path, shards=1)
    data_dir = tmp_path / "island"
    try:
        started = worker("start", "--detach", "--connect", cluster.connect, "--island", "a",
                         "--data-dir", str(data_dir), *FAST, timeout=300)  # fmt: skip
        assert started.returncode == 0, started.stderr
        pid = daemon.read_pid(daemon.pid_path(data_dir))
        assert (data_dir / "diloco-kind").read_text() == "island\n"  # written once it joined
        live = worker("status", "--data-dir", str(data_dir))
        assert live.returncode == 0 and "running: True" in live.stdout, live.stdout
        os.kill(pid, signal.SIGKILL)
        assert daemon.wait_exit(pid, 30)
        proc = worker("status", "--data-dir", str(data_dir))
        assert proc.returncode == 3, (proc.stdout, proc.stderr)
        assert "not running (last seen " in proc.stdout, proc.stdout
        assert ", was training)" in proc.stdout, proc.stdout
    finally:
        from daemon_process import stop_daemons_under

        stop_daemons_under(tmp_path)
        cluster.stop()


# -- data dirs know their kind -------------------------------------------------------------------


def server(*args: str, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess:
    return run(sys.executable, "-m", "paramserver.ops.cli", *args, timeout=timeout)


def assert_one_line(proc: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_the_kind_of_a_data_dir_comes_from_its_marker_else_from_what_it_holds(tmp_path):
    from paramserver.plumbing import dir_kind

    assert dir_kind.infer(tmp_path / "new") is None
    assert dir_kind.infer(tmp_path) is None  # empty
    (tmp_path / "shard-0").mkdir()
    assert dir_kind.infer(tmp_path)[0] == "server"
    island = tmp_path / "island"
    write_island(island, "training", 1)
    assert dir_kind.infer(island) == ("island", "it holds status.json")
    dir_kind.mark(island, "island")
    assert (island / dir_kind.KIND_FILE).read_text() == "island\n"
    dir_kind.check(island, "island")
    with pytest.raises(dir_kind.DataDirKindError, match="an island's data dir"):
        dir_kind.check(island, "server")


def test_the_server_refuses_an_islands_data_dir_and_the_worker_a_servers(tmp_path):
    island = tmp_path / "island"
    write_island(island, "stopped", 5)
    before = sorted(p.name for p in island.iterdir())
    for argv in (("start", "--data-dir", str(island)), ("stop", "--data-dir", str(island))):
        proc = server(*argv)
        assert_one_line(proc, 1, str(island), "an island's data dir", "status.json")
    assert sorted(p.name for p in island.iterdir()) == before  # nothing written, nothing signalled

    server_dir = tmp_path / "server"
    (server_dir / "shard-0").mkdir(parents=True)
    for argv in (
        ("start", "--data-dir", str(server_dir), "--connect", "tcp://127.0.0.1:9"),
        ("stop", "--data-dir", str(server_dir)),
        ("status", "--data-dir", str(server_dir)),
    ):
        proc = worker(*argv)
        assert_one_line(proc, 1, str(server_dir), "a server's data dir", "shard-0/")
    assert sorted(p.name for p in server_dir.iterdir()) == ["shard-0"]


# -- the small things of a first run -----------------------------------------------------------


def test_eval_help_gives_one_default_for_eval_batches():
    proc = worker("eval", "--help")
    assert proc.returncode == 0, proc.stderr
    (flag,) = [line for line in proc.stdout.splitlines() if line.startswith("  --eval-batches")]
    assert flag.endswith("(default 32)"), flag
    assert "default: 4" not in proc.stdout and "is 32 here" in " ".join(proc.stdout.split())


def test_the_eval_loss_is_per_token_on_a_token_file_and_per_byte_on_text():
    from worker.config import IslandConfig
    from worker.evaluate import loss_unit

    assert loss_unit(IslandConfig()) == "nats/byte"  # the embedded corpus: bytes
    assert loss_unit(IslandConfig(data="corpus/")) == "nats/byte"
    assert loss_unit(IslandConfig(data="train.bin", vocab_size=50304)) == "nats/token"
    assert loss_unit(IslandConfig(data="ids.npy", vocab_size=1000)) == "nats/token"


@pytest.mark.parametrize(
    "endpoint, why",
    [
        ("127.0.0.1:5555", "the scheme must be tcp or ipc;"),
        ("inproc://shard", "the scheme must be tcp or ipc;"),
        ("tcp://10.1.2.3:5555", "not a loopback address"),
    ],
)
def test_worker_connect_errors_speak_of_connect_and_what_a_shard_offers(endpoint, why, tmp_path):
    proc = worker("start", "--connect", endpoint, "--data-dir", str(tmp_path / "island"))
    assert_one_line(proc, 2, "--connect", f"connect={endpoint!r}", why)
    assert "IslandConfig" not in proc.stderr and "inproc" not in proc.stderr.replace(endpoint, "")
    assert not (tmp_path / "island").exists()


def test_the_readme_runs_the_example_with_the_venvs_python():
    text = (ROOT / "README.md").read_text()
    lines = [line for line in text.splitlines() if "examples/own_mlp.py" in line]
    assert lines and all(not line.startswith("python ") for line in lines), lines
    assert any(line.startswith(".venv/bin/python examples/own_mlp.py") for line in lines)
