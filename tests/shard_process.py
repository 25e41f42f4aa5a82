"""A shard as a real subprocess for tests that signal it, limit its resources or read its log:
started the way the supervisor starts each shard (``python -m paramserver.ops.cli shard``)
on a free port pair, then polled until it answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import zmq
from conftest import Peer, free_port

from paramserver.plumbing.settings import load_settings
from paramserver.server.config import ShardConfig


def shard_argv(data_dir: Path, port: int, *flags: str) -> list[str]:
    """The command that runs shard 0 of a one-shard cluster the way the supervisor runs it.

    Args:
        data_dir: the cluster's data dir.
        port: ROUTER port (PUB on port + 1).
        flags: `diloco-server start` flags as pairs (``"--mode", "async"``).

    Returns:
        argv of ``python -m paramserver.ops.cli shard --index 0 --settings-json ...``.
    """
    given = {
        flags[i].removeprefix("--").replace("-", "_"): flags[i + 1] for i in range(0, len(flags), 2)
    }
    given.update(port=str(port), data_dir=str(data_dir))
    cfg = load_settings(ShardConfig, flags=given)
    return [
        sys.executable, "-m", "paramserver.ops.cli", "shard", "--index", "0",
        "--settings-json", json.dumps(asdict(cfg)),
    ]  # fmt: skip


class ShardProcess:
    """Shard 0 of a one-shard cluster on 127.0.0.1; its output is kept in `output`.

    `flags` are `diloco-server start` flags as pairs (``"--mode", "async"``).

    The output goes through a pipe (not a file), so a file-size limit on the
    process does not touch it, and the shard writes no JAX compile cache.
    """

    def __init__(self, data_dir: Path, *flags: str) -> None:
        self.port = free_port(2)
        self.router = f"tcp://127.0.0.1:{self.port}"
        # no DILOCO_ settings, and not the suite's shared JAX compile cache (tests/jax_cache.py):
        # under a test's file-size limit a cache write would fail and print its own warning
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("DILOCO_") and k != "JAX_COMPILATION_CACHE_DIR"
        }
        argv = shard_argv(data_dir, self.port, *flags)
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.append(line)

    @property
    def output(self) -> str:
        """Everything the process wrote so far."""
        return "".join(self._lines)

    def wait_ready(self, ctx: zmq.Context, timeout_s: float = 90.0) -> None:
        """Poll with status requests until the shard answers; fail at once if it exited."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"shard exited {self.proc.returncode}: {self.output}"
            p = Peer(ctx, self.router, "probe")  # fresh: no reply left queued
            try:
                p.send({"kind": "status"})
                if p.sock.poll(500):
                    return
            finally:
                p.close()
            assert time.monotonic() < deadline, f"shard did not answer: {self.output}"

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, wait, return the exit code (output complete afterwards)."""
        if self.proc.poll() is None:
            self.proc.terminate()
        code = self.proc.wait(timeout_s)
        self._reader.join(timeout_s)
        return code
