"""The island's persisted session token: one per data dir, 0600, locked while in use; a shard
lets a hello with the bound connection's token take the id over at once (real shards, threads)."""

from __future__ import annotations

import os
import stat

import mlp_helpers as mlp
import pytest
from client_helpers import clients
from shard_helpers import small_flat

import worker
from paramserver.client import ClientConfig, ClientConfigError, ClientError
from worker import session_token
from worker.session_token import TOKEN_FILE, TokenInUse


@pytest.fixture
def client():
    yield from clients()


def test_a_token_is_made_once_with_mode_0600_and_reused(tmp_path):
    held = session_token.hold(tmp_path)
    path = tmp_path / TOKEN_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(held.value) == 32 and int(held.value, 16) >= 0
    with pytest.raises(TokenInUse, match="held by another running island"):
        session_token.hold(tmp_path)  # a second holder, even in this process
    held.release()
    again = session_token.hold(tmp_path)
    assert again.value == held.value
    again.release()
    other = tmp_path / "other"
    other.mkdir()
    own = session_token.hold(other)
    own.release()
    assert own.value != held.value  # another data dir: its own token


@pytest.mark.parametrize("content", ["", "\n", "two words\n", "x" * 129])
def test_an_empty_file_gets_a_token_and_a_foreign_one_is_set_aside(tmp_path, content, caplog):
    path = tmp_path / TOKEN_FILE
    path.write_text(content)
    held = session_token.hold(tmp_path)
    held.release()
    assert session_token.is_token(held.value) and path.read_text() == held.value + "\n"
    aside = list(tmp_path.glob(TOKEN_FILE + ".unused-*"))
    if content.strip():
        assert [p.read_text() for p in aside] == [content]
        assert "does not hold a session token" in caplog.text
    else:
        assert aside == []


def test_a_token_others_can_read_is_used_with_a_warning(tmp_path, caplog):
    path = tmp_path / TOKEN_FILE
    path.write_text("my-own-token\n")
    os.chmod(path, 0o644)
    held = session_token.hold(tmp_path)
    held.release()
    assert held.value == "my-own-token"
    assert "readable by others (mode 644)" in caplog.text


def test_client_config_session_is_checked():
    assert ClientConfig(connect="tcp://127.0.0.1:5555", island="a").session == ""
    with pytest.raises(ClientConfigError, match="ClientConfig.session"):
        ClientConfig(connect="tcp://127.0.0.1:5555", island="a", session="x" * 129)


@pytest.mark.timeout(60)
def test_the_same_token_takes_a_live_id_over_at_once_and_another_is_refused(cluster, client, peer):
    # heartbeats every 5 s: the first client's connection stays "live" for 10 s, so
    # only the token can let a second connection in
    c = cluster(1, heartbeat_interval_s=5.0)
    first = client(c.connect, "a", session="token-of-a", heartbeat_interval_s=5.0)
    first.join(small_flat(0))
    restarted = client(c.connect, "a", session="token-of-a", in_use_wait_s=0.5)
    assert restarted.join(small_flat(0)).versions  # welcomed at its first hello
    status = peer(c.connect, "probe").status()
    assert "island_in_use" not in status["rejected"], status["rejected"]
    intruder = client(c.connect, "a", session="another-token", in_use_wait_s=0.5)
    with pytest.raises(ClientError, match="in use by another running island"):
        intruder.join(small_flat(0))
    assert peer(c.connect, "probe2").status()["rejected"]["island_in_use"] >= 1


@pytest.mark.timeout(120)
def test_a_session_with_a_data_dir_sends_its_token_and_holds_the_dir(cluster, tmp_path):
    c = cluster(1)
    params = mlp.init_mlp(0)
    data_dir = tmp_path / "island"
    fast = {"heartbeat_interval_s": 0.2, "join_timeout_s": 20.0}
    with worker.join(c.connect, island="a", params=params, inner_steps=2, data_dir=data_dir,
                     **fast) as s:  # fmt: skip
        token = (data_dir / TOKEN_FILE).read_text().strip()
        assert s.client.cfg.session == token
        with pytest.raises(TokenInUse):  # another island on the same data dir: refused
            worker.join(c.connect, island="b", params=params, inner_steps=2,
                        data_dir=data_dir, **fast)  # fmt: skip
    with worker.join(c.connect, island="a", params=params, inner_steps=2, data_dir=data_dir,
                     **fast) as again:  # fmt: skip
        assert again.client.cfg.session == token  # the next run: the same token
    with worker.join(c.connect, island="c", params=params, inner_steps=2, **fast) as plain:
        assert plain.client.cfg.session == ""  # no data dir: a fresh token per client
