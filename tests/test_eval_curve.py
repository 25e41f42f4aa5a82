"""`diloco-worker eval` against a CURVE-only cluster: with the island's keys it reads and
evaluates the global model; without them it fails with one line. A real CURVE shard on
127.0.0.1, a real `Client`, the CLI as a subprocess."""

from __future__ import annotations

import json
import math

import pytest
from curve_helpers import SLOW_HB, curve_shard
from test_final_eval import EVAL_FLAGS, run_eval, tiny_flat

from paramserver.client import Client, ClientConfig
from paramserver.plumbing.curve import write_keypair


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_eval_speaks_curve_with_the_islands_keys(tmp_path):
    server_pub, server_secret = write_keypair(tmp_path / "server", "server")
    allow = tmp_path / "allow"
    allow.mkdir()
    public, secret = write_keypair(tmp_path / "islands", "isl")
    (allow / public.name).write_text(public.read_text())
    shard = curve_shard(tmp_path, str(server_secret), str(allow))
    try:
        cfg = ClientConfig(
            connect=shard.router,
            island="isl",
            join_timeout_s=30.0,
            curve_secret_key_file=str(secret),
            curve_server_key_file=str(server_pub),
            **SLOW_HB,
        )
        client = Client(cfg)
        client.join(tiny_flat())
        client.close(flush_timeout_s=1.0)  # says bye: the id is free for eval's hello

        keys = ("--curve-secret-key-file", str(secret), "--curve-server-key-file", str(server_pub))
        proc = run_eval("--connect", shard.router, "--island", "isl", "--json", *keys, *EVAL_FLAGS)
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert math.isfinite(result["eval_loss"]) and 4.0 < result["eval_loss"] < 7.0  # ~ln 256
        assert result["pending"] == 0

        plain = run_eval("--connect", shard.router, "--island", "isl", "--wait-s", "2", *EVAL_FLAGS)
        assert plain.returncode != 0
        lines = plain.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("diloco-worker eval:"), plain.stderr
        assert "CURVE" in lines[0], lines[0]  # names the likely cause
    finally:
        shard.stop()
