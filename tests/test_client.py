"""Client API without a server: config validation, misuse errors, join timeout, clean close."""

import numpy as np
import pytest
from conftest import free_port

from paramserver.client import Client, ClientConfig, ClientError, JoinTimeout


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"connect": "localhost:5555"}, r"connect='localhost:5555': give a ZeroMQ endpoint"),
        ({"island": ""}, r"island='': give a string of 1-128"),
        ({"heartbeat_interval_s": 0}, r"heartbeat_interval_s=0: must be a finite number > 0"),
        ({"ack_timeout_s": float("nan")}, r"ack_timeout_s=nan"),
        ({"liveness": 0}, r"liveness=0: must be an int >= 1"),
        ({"max_unacked": True}, r"max_unacked=True"),
        ({"ack_timeout_s": 10.0, "ack_timeout_cap_s": 5.0}, r"ack_timeout_cap_s=5.0: must be >="),
    ],
)
def test_config_validation_names_the_value(kwargs, match):
    args = {"connect": "tcp://127.0.0.1:5555", "island": "a", **kwargs}
    with pytest.raises(ClientError, match=match):
        ClientConfig(**args)


def test_push_before_join_and_after_close():
    client = Client(ClientConfig(connect="tcp://127.0.0.1:1", island="a"))
    try:
        with pytest.raises(ClientError, match="call join"):
            client.push(0, 0, 0, 1, 1, [b"x"])
        assert client.poll_updates() == []
        stats = client.stats()
        assert stats["bytes_sent"] == 0 and stats["pending"] == 0
    finally:
        assert client.close() == 0
    with pytest.raises(ClientError, match="closed"):
        client.poll_updates()
    assert client.close() == 0  # idempotent


def test_join_with_nobody_listening_times_out_clearly():
    port = free_port()
    cfg = ClientConfig(
        connect=f"tcp://127.0.0.1:{port}", island="a", join_timeout_s=0.5, ack_timeout_s=0.1
    )
    with Client(cfg) as client:
        with pytest.raises(
            ClientError,
            match=r"no hello reply .* within 0.5s; nothing listens at .*connection refused.*is the server",
        ) as failed:
            client.join({"w": np.zeros(4, np.float32)})
        assert isinstance(failed.value, JoinTimeout)  # classified by type, with its facts
        assert (failed.value.endpoint, failed.value.request) == (cfg.connect, "hello")
        assert failed.value.timeout_s == 0.5
        assert client.stats()["bytes_sent"] > 0  # hellos were queued on the socket


def test_join_rejects_unusable_params():
    with (
        Client(ClientConfig(connect="tcp://127.0.0.1:1", island="a")) as client,
        pytest.raises(ClientError, match="cannot use these parameters"),
    ):
        client.join({"w": np.zeros(4, np.int32)})
