"""`free_port` hands out ports no outgoing connection can take and never the same one twice."""

from __future__ import annotations

import pytest
from conftest import free_port


@pytest.mark.timeout(30)
def test_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    handed = [free_port(2) for _ in range(50)] + [free_port() for _ in range(50)]
    ports = [p for base in handed[:50] for p in (base, base + 1)] + handed[50:]
    assert len(set(ports)) == len(ports)  # no port twice, not even a pair's second
    assert max(ports) < ephemeral_low  # no connect() of another test can take one meanwhile
