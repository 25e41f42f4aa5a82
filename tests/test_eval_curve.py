"""`diloco-worker eval` against a CURVE-only cluster: with the island's keys it reads and
evaluates the global model; without them it fails with one line. A real CURVE shard on
127.0.0.1, a real `Client`, the CLI as a subprocess."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from curve_helpers import SLOW_HB, curve_shard

import codec
from paramserver.client import Client, ClientConfig
from paramserver.plumbing.curve import write_keypair
from worker import model as model_lib

ROOT = Path(__file__).resolve().parent.parent
EVAL_FLAGS = ("--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2")


def run_eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", "eval", *args, *EVAL_FLAGS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(180)
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
        params = model_lib.init_params(model_lib.MODEL_CONFIGS["tiny"], 0)
        client.join(codec.flatten(jax.tree_util.tree_map(np.asarray, params)))
        client.close(flush_timeout_s=1.0)  # says bye: the id is free for eval's hello

        keys = ("--curve-secret-key-file", str(secret), "--curve-server-key-file", str(server_pub))
        proc = run_eval("--connect", shard.router, "--island", "isl", "--json", *keys)
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert math.isfinite(result["eval_loss"]) and 4.0 < result["eval_loss"] < 7.0  # ~ln 256
        assert result["pending"] == 0

        plain = run_eval("--connect", shard.router, "--island", "isl", "--wait-s", "2")
        assert plain.returncode != 0
        lines = plain.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("diloco-worker eval:"), plain.stderr
        assert "CURVE" in lines[0], lines[0]  # names the likely cause
    finally:
        shard.stop()
