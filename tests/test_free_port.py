"""Ports picked for local clusters: below the ephemeral range, never handed out twice, and a
port taken between the pick and the start is picked again.

The ephemeral range is what every `connect()` on the machine takes its local port from; a
port picked there can be taken by any process in the second before the server binds it
(CI failed once on a shard's PUB port taken so).
"""

from __future__ import annotations

import itertools
import random
import socket

import pytest
from conftest import PORT_GAP, free_port

from bench.launcher import LocalCluster
from paramserver.plumbing import ports, probe


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:  # read here, not by the code
        return int(f.read().split()[0])


@pytest.mark.timeout(30)
def test_the_tests_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice():
    handed = [free_port(2) for _ in range(50)] + [free_port() for _ in range(50)]
    taken = [p for base in handed[:50] for p in (base, base + 1)] + handed[50:]
    assert len(set(taken)) == len(taken)  # no port twice, not even a pair's second
    singles = sorted(handed[50:])
    assert all(b - a > PORT_GAP for a, b in itertools.pairwise(singles))  # nor near each other
    assert max(taken) < _ephemeral_low()  # no connect() of another test can take one meanwhile


@pytest.mark.timeout(30)
def test_a_launchers_ports_lie_below_the_ephemeral_range_and_skip_a_held_one(tmp_path):
    bases = [ports.free_base_port(4) for _ in range(50)]
    assert min(bases) >= 1024 and max(bases) + 3 < _ephemeral_low()
    with socket.socket() as held:  # the only free pair of a 3-port range is its last two
        held.bind(("127.0.0.1", free_port(3)))
        first = held.getsockname()[1]
        picks = {ports.free_base_port(2, port_range=(first, first + 3)) for _ in range(20)}
        assert picks == {first + 1}
        with pytest.raises(ports.NoFreePorts, match=f"no 3 consecutive free ports .* {first}"):
            ports.free_base_port(3, port_range=(first, first + 3), rng=random.Random(0))
    # a file that cannot be read gives Linux's default range
    assert ports.unreserved_range(str(tmp_path / "none")) == (10000, 32768)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_port_taken_after_the_pick_is_picked_again_and_the_server_starts(tmp_path):
    with LocalCluster(tmp_path / "run", shards=1) as cluster:
        picked = cluster.port
        with socket.socket() as thief:  # takes the PUB port the cluster picked
            thief.bind(("127.0.0.1", picked + 1))
            thief.listen()
            cluster.start_server()
        assert cluster.port != picked
        status = probe.cluster_status(cluster.connect, timeout_s=10.0)
        assert len(status["shards"]) == 1
