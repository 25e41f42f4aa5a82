"""CURVE authentication: key files, and a live shard that admits only allow-listed islands.

Real sockets on 127.0.0.1: an island with an allowed key joins, pushes, is
acked and receives published updates (the PUB is CURVE too); an island with a
key not on the list, or with no key, is refused, the refusal is logged, and
nothing of it reaches the shard's state.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import zmq
from conftest import wait_for
from curve_helpers import curve_shard
from shard_helpers import small_flat

import codec
from paramserver.client import Client, ClientConfig, ClientConfigError, ClientError
from paramserver.plumbing.curve import CurveError, load_keypair, load_public_key, write_keypair
from paramserver.server.config import ConfigError, ShardConfig

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def keys(tmp_path):
    """A server key pair, an allow dir with island "good"'s public key, and a stranger's pair."""
    server_pub, server_secret = write_keypair(tmp_path / "server", "server")
    allow = tmp_path / "allow"
    _, good_secret = write_keypair(tmp_path / "islands", "good")
    allow.mkdir()
    (allow / "good.key").write_text((tmp_path / "islands" / "good.key").read_text())
    _, bad_secret = write_keypair(tmp_path / "strangers", "bad")
    return {
        "server_pub": str(server_pub),
        "server_secret": str(server_secret),
        "allow": str(allow),
        "good": str(good_secret),
        "bad": str(bad_secret),
    }


def _client(router, island, secret="", server_pub="", join_timeout_s=30.0):
    return Client(
        ClientConfig(
            connect=router,
            island=island,
            heartbeat_interval_s=5.0,
            liveness=20,
            join_timeout_s=join_timeout_s,
            curve_secret_key_file=secret,
            curve_server_key_file=server_pub,
        )
    )


def test_keys_command_writes_a_private_secret_and_never_overwrites(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "paramserver.ops.cli",
        "keys",
        "--out",
        str(tmp_path),
        "--name",
        "s",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    secret = tmp_path / "s.key_secret"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    public, private = load_keypair(secret)
    assert load_public_key(tmp_path / "s.key") == public and len(private) == 40
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    with pytest.raises(CurveError, match="holds no secret key"):
        load_keypair(tmp_path / "s.key")
    with pytest.raises(CurveError, match="key name"):
        write_keypair(tmp_path, "../evil")


def test_curve_settings_need_both_halves():
    with pytest.raises(ConfigError, match="curve"):
        ShardConfig(curve_secret_key_file="k.key_secret")
    with pytest.raises(ClientConfigError, match="CURVE needs both"):
        ClientConfig(connect="tcp://127.0.0.1:1", island="a", curve_server_key_file="s.key")


def test_a_missing_allow_dir_stops_the_shard_with_a_clear_error(start_shard, keys, tmp_path):
    with pytest.raises(CurveError, match="does not exist"):
        start_shard(
            curve_secret_key_file=keys["server_secret"], curve_allow_dir=str(tmp_path / "x")
        )


def test_only_allow_listed_islands_reach_the_shard(tmp_path, keys, caplog, zmq_ctx):
    caplog.set_level(logging.WARNING, logger="paramserver.plumbing.curve")
    shard = curve_shard(tmp_path, keys["server_secret"], keys["allow"])
    good = _client(shard.router, "good", keys["good"], keys["server_pub"])
    try:
        plan = good.join(small_flat()).plan
        size = plan.fragments[0].size
        frames, _ = codec.int8().encode({"delta": np.full(size, 0.1, np.float32)})
        good.push(0, 1, 0, 100, 1, frames)
        wait_for(lambda: good.stats()["acked"] == 1, "the ack")
        updates = wait_for(
            good.poll_updates, "an update"
        )  # the PUB stream authenticated the subscriber
        assert updates[0].fragment == 0 and updates[0].version == 1

        # a key that is not on the allow list: refused by ZAP, logged, never joins
        stranger = _client(shard.router, "bad", keys["bad"], keys["server_pub"], 1.5)
        with pytest.raises(ClientError, match="no hello reply"):
            stranger.join(small_flat())
        stranger.close(0)
        wait_for(lambda: "not in the allow list" in caplog.text, "the allow-list log line")

        # no key at all: the handshake fails before ZAP; the monitor logs it
        caplog.clear()
        plain = _client(shard.router, "plain", join_timeout_s=1.5)
        with pytest.raises(ClientError, match="no hello reply"):
            plain.join(small_flat())
        plain.close(0)
        wait_for(lambda: "failed the CURVE handshake" in caplog.text, "the handshake log line")

        # a raw peer without a key gets no answer either
        raw = zmq_ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(shard.router)
        raw.send_multipart([b"\x82\xa1v\x01\xa4kind\xa6status"])
        assert not raw.poll(500)
        raw.close(0)

        assert shard.server.state is not None
        assert set(shard.server.state.last_seen) == {"good"}
        assert shard.server.state.counters.accepted == 1
        assert not shard.server.state.counters.rejected
    finally:
        good.close(flush_timeout_s=1.0)
        shard.stop()
