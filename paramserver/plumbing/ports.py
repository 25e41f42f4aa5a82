"""Picking TCP ports for a local cluster that no outgoing connection can take meanwhile.

A launcher picks ports, checks that they are free, then starts a process that binds
them a second or two later. Ports in the kernel's ephemeral range
(`/proc/sys/net/ipv4/ip_local_port_range`, 32768-60999 by default on Linux) are what
every `connect()` on the machine takes for its local end, so one may be taken in that
window by any process that connects anywhere (a ZeroMQ client, a browser). Ports
below that range are only ever taken by an explicit bind, so `free_base_port` picks
there. Nothing here imports JAX or keeps state.
"""

from __future__ import annotations

import contextlib
import random
import socket

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LINUX_EPHEMERAL_LOW = 32768  # the kernel's default, where the file cannot be read


class NoFreePorts(OSError):
    """No `count` consecutive free ports were found in the range searched."""


def unreserved_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The ports a launcher may pick: above the well-known ones, below the ephemeral range.

    Args:
        path: the kernel's ephemeral range file (two numbers, low and high).

    Returns:
        (low, high): ports low .. high - 1; 10000 .. ephemeral low - 1 by default.
    """
    try:
        with open(path) as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = LINUX_EPHEMERAL_LOW
    low = 10000 if ephemeral_low > 12000 else 1024
    return low, max(ephemeral_low, low + 1000)


def free_base_port(
    count: int,
    host: str = "127.0.0.1",
    port_range: tuple[int, int] | None = None,
    rng: random.Random | None = None,
) -> int:
    """A base port P such that P .. P + count - 1 are all free on `host` right now.

    Args:
        count: number of consecutive ports needed (a shard binds ROUTER P and PUB P + 1).
        host: the address they will be bound on.
        port_range: (low, high) to pick from; `unreserved_range()` when None.
        rng: the random source (a fresh one when None).

    Returns:
        The base port P.

    Raises:
        NoFreePorts: after 200 picks found none.
    """
    low, high = port_range or unreserved_range()
    rng = rng or random.Random()
    for _ in range(200):
        base = rng.randrange(low, high - count + 1)
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + count):
                    held.enter_context(socket.socket()).bind((host, port))
            except OSError:
                continue
            return base
    raise NoFreePorts(f"no {count} consecutive free ports on {host} in {low}..{high - 1}")
