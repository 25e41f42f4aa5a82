"""A new user's first commands (issue 25's stumbles): real commands from .venv/bin, no tracebacks.

Each test runs what a newcomer types (`diloco-server`, `diloco-worker`, `./dev`)
as a subprocess and checks the one line it answers: exit 2 and the bad value
named for bad input, the state an island is really in, help a person can read.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from conftest import free_port

from paramserver.plumbing import daemon

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # the venv's console scripts
CMD_TIMEOUT_S = 60


def run(*argv: str, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run a command to completion with no DILOCO_ settings from the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    return subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def assert_one_line(proc: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    """Exit `code`, no traceback, one line on stderr holding every needle."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


# -- 3: --connect is checked before anything connects -----------------------------------------


CONNECT_COMMANDS = {
    "server status": ("diloco-server", "status", "--timeout", "1"),
    "worker start": ("diloco-worker", "start", "--join-timeout-s", "1"),
    "worker eval": ("diloco-worker", "eval", "--wait-s", "0"),
}


BAD_ENDPOINTS = [
    ("tcp://127.0.0.1", "no port"),
    ("tcp://127.0.0.1:notaport", "'notaport' is not a number"),
    ("tcp://127.0.0.1:99999", "out of range 1..65535"),
    ("http://127.0.0.1:5555", "scheme must be tcp"),
]


@pytest.mark.parametrize("command", sorted(CONNECT_COMMANDS))
def test_a_bad_connect_is_one_line_naming_it_and_exit_2(command, tmp_path):
    prog, *args = CONNECT_COMMANDS[command]
    extra = ("--data-dir", str(tmp_path / "island")) if command == "worker start" else ()
    proc = run(str(BIN / prog), *args, *extra, "--connect", "tcp://127.0.0.1:notaport")
    assert_one_line(proc, 2, "tcp://127.0.0.1:notaport", "'notaport' is not a number")
    assert not (tmp_path / "island" / "daemon.log").exists()  # refused before it started


@pytest.mark.parametrize("command", sorted(CONNECT_COMMANDS))
@pytest.mark.parametrize("endpoint, why", BAD_ENDPOINTS)
def test_every_kind_of_bad_connect_is_named(command, endpoint, why, tmp_path, capsys):
    from paramserver.ops.cli import main as server_main
    from worker.cli import main as worker_main

    prog, *args = CONNECT_COMMANDS[command]
    extra = ["--data-dir", str(tmp_path / "island")] if command == "worker start" else []
    main = server_main if prog == "diloco-server" else worker_main
    assert main([*args, *extra, "--connect", endpoint]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and endpoint in err and why in err, err


def test_the_validator_accepts_what_zeromq_connects_to():
    from paramserver.plumbing.validate import endpoint_problem

    for good in ("tcp://127.0.0.1:5555", "tcp://[::1]:1", "tcp://h:65535", "ipc:///tmp/s"):
        assert endpoint_problem(good) is None, good
    for bad in ("tcp://:5555", "tcp://[::1]", "tcp://h:0", "tcp://", "5555", None):
        assert endpoint_problem(bad) is not None, bad


# -- 4: a config file that is not UTF-8 ---------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ("diloco-server", "start"),
        ("diloco-server", "stop"),
        ("diloco-worker", "start"),
        ("diloco-worker", "eval", "--connect", "tcp://127.0.0.1:5555"),
    ],
)
def test_a_config_file_that_is_not_utf8_is_named_in_one_line(argv, tmp_path):
    config = tmp_path / "latin1.toml"
    config.write_bytes('mode = "sync"\n# caf\xe9\n'.encode("latin-1"))
    proc = run(str(BIN / argv[0]), *argv[1:], "--config", str(config))
    assert_one_line(proc, 2, str(config), "not UTF-8", "0xe9")


# -- 2: the human status view says when the shards are gone ------------------------------------


def test_status_view_shows_the_shards_down_and_the_waiting_deltas(tmp_path):
    data_dir = tmp_path / "island"
    data_dir.mkdir()
    status = {
        "island": "a",
        "state": "training",
        "round": 7,
        "updated": time.time(),
        "version_lag": 0,
        "pending": 16,
        "client": {"shards_down": 2, "pending": 16},
    }
    (data_dir / "status.json").write_text(json.dumps(status))
    daemon.acquire_pid_file(daemon.pid_path(data_dir))  # this process plays the live island
    try:
        proc = run(str(BIN / "diloco-worker"), "status", "--data-dir", str(data_dir))
    finally:
        daemon.release_pid_file(daemon.pid_path(data_dir))
    assert proc.returncode == 0, proc.stderr
    state = next(line for line in proc.stdout.splitlines() if line.strip().startswith("state:"))
    assert "2 shard(s) down" in state and "16 delta(s)" in state, proc.stdout
    assert re.search(r"shards_down: 2$", proc.stdout, re.M), proc.stdout


# -- 9: no JAX backend noise on a CPU machine ----------------------------------------------------


def test_daemon_logging_drops_jax_backend_probing_but_keeps_its_warnings():
    code = (
        "import logging; from paramserver.plumbing.daemon import setup_logging\n"
        "setup_logging('INFO')\n"
        "import jax; jax.devices()\n"
        "logging.getLogger('jax._src.xla_bridge').warning('a real jax warning')\n"
    )
    proc = run(sys.executable, "-c", code)
    assert proc.returncode == 0, proc.stderr
    assert "Unable to initialize backend" not in proc.stderr, proc.stderr
    assert "a real jax warning" in proc.stderr


# -- 10: help a person can read ---------------------------------------------------------------


def test_dev_without_arguments_prints_its_commands_not_its_source():
    proc = run(str(ROOT / "dev"))
    assert proc.returncode == 0, proc.stderr
    assert "set -euo" not in proc.stdout and "usage: ./dev" in proc.stdout
    for command in ("demo", "server", "worker", "test", "fast", "lint"):
        assert re.search(rf"^  {command} ", proc.stdout, re.M), command
    assert "source .venv/bin/activate" in proc.stdout


def test_dev_runs_the_daemons_from_the_venv():
    proc = run(str(ROOT / "dev"), "worker", "status", "--help")
    assert proc.returncode == 0 and "usage: diloco-worker status" in proc.stdout, proc.stderr


def test_eval_help_lists_only_the_settings_eval_reads():
    proc = run(str(BIN / "diloco-worker"), "eval", "--help")
    assert proc.returncode == 0, proc.stderr
    for flag in ("--connect", "--model", "--data", "--eval-batches", "--seq-len"):
        assert flag in proc.stdout
    for flag in ("--inner-steps", "--speed", "--num-processes", "--codec", "--max-rounds"):
        assert flag not in proc.stdout, flag


def _subcommands(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    yield name, sub


def _parsers():
    from bench.cli import COMMANDS
    from bench.cli import build_parser as bench_parser
    from paramserver.ops.cli import build_parser as server_parser
    from worker.cli import _parser as worker_parser

    for name, sub in _subcommands(server_parser()):
        yield f"diloco-server {name}", sub
    for name, sub in _subcommands(worker_parser()):
        yield f"diloco-worker {name}", sub
    for command in COMMANDS:
        for name, sub in _subcommands(bench_parser([command])):
            if name == command:
                yield f"diloco-bench {name}", sub


def test_every_flag_of_every_command_says_what_it_does():
    vague = []
    for command, parser in _parsers():
        for action in parser._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            flag = action.option_strings[-1]
            text = re.sub(r"\s*\((default|e\.g\.)[^)]*\)\s*$", "", action.help or "").strip()
            words = re.findall(r"[A-Za-z0-9]+", text.lower())
            name = re.findall(r"[a-z0-9]+", flag.lower())
            if len(words) < 3 or words == name:
                vague.append(f"{command} {flag}: {action.help!r}")
    assert not vague, "flags without a real description:\n" + "\n".join(vague)


# -- 1: the README's hand-run cluster works as written --------------------------------------------


def test_readme_cluster_by_hand_uses_commands_on_path_and_stops_what_it_starts():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Running a cluster by hand") :]
    block = section[section.index("```bash") : section.index("```\n", section.index("```bash") + 7)]
    commands = [line.split("#")[0].split() for line in block.splitlines()[1:] if line.strip()]
    commands = [c for c in commands if c]
    assert all(c[0] == "./dev" and c[1] in ("server", "worker") for c in commands), commands
    started = {c[c.index("--data-dir") + 1] for c in commands if c[2] == "start"}
    stops = [c[c.index("--data-dir") + 1] for c in commands if c[2] == "stop"]
    assert started == set(stops), (started, stops)
    assert stops[-1] == "runs/server"  # the islands stop first, while they can still flush


# -- 5: a wrong or silent --connect says what answers there ----------------------------------------


def test_peer_peek_tells_a_pub_port_from_a_router_and_from_nothing():
    from paramserver.plumbing.peer_peek import peer_kind, silence_cause

    ctx = zmq.Context()
    try:
        pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
        pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
        router_port = router.bind_to_random_port("tcp://127.0.0.1")
        assert peer_kind("127.0.0.1", pub_port) == "PUB"
        assert peer_kind("127.0.0.1", router_port) == "ROUTER"
        assert silence_cause(f"tcp://127.0.0.1:{router_port}") is None  # a shard: silent otherwise
        cause = silence_cause(f"tcp://127.0.0.1:{pub_port}")
        assert "answered like a PUB socket" in cause and f"try port {pub_port - 1}" in cause
        pub.close(linger=0)
        router.close(linger=0)
        assert "connection refused" in silence_cause(f"tcp://127.0.0.1:{free_port()}")
    finally:
        ctx.destroy(linger=0)


@pytest.fixture
def pub_endpoint():
    """A PUB socket bound on 127.0.0.1, as a shard's update port is."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}", port
    ctx.destroy(linger=0)


def test_status_at_a_pub_port_says_it_answered_like_one(pub_endpoint):
    endpoint, port = pub_endpoint
    proc = run(str(BIN / "diloco-server"), "status", "--connect", endpoint, "--timeout", "2")
    assert_one_line(proc, 1, "answered like a PUB socket", f"try port {port - 1}")


@pytest.mark.slow
def test_detached_island_says_where_it_waits_before_it_joins_and_why_it_failed(
    pub_endpoint, tmp_path
):
    endpoint, port = pub_endpoint
    island = tmp_path / "island"
    argv = ("start", "--connect", endpoint, "--data-dir", str(island), "--island", "a")
    proc = run(str(BIN / "diloco-worker"), *argv, "--join-timeout-s", "2", "--detach")
    assert_one_line(proc, 1, "answered like a PUB socket", f"try port {port - 1}")
    first = proc.stdout.splitlines()[0]  # printed before the island started to join
    assert endpoint in first and str(island / "daemon.log") in first, proc.stdout
