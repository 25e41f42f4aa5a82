"""Where plain TCP is allowed: the secure-by-default rule that shards and islands both apply.

Without CURVE a shard admits whoever reaches its port (to join, init and
push), and an island sends its deltas to whoever answers at an endpoint. So
plain TCP is allowed only where nobody else can be: loopback (127.0.0.0/8,
::1, or a host name that resolves only to such addresses, like
``localhost``) and the local transports ``ipc://`` and ``inproc://``. Any
other address (``0.0.0.0``, ``*``, ``::``, a LAN or public address, a name
that does not resolve) needs CURVE keys, or the operator's explicit
``insecure`` for a trusted, firewalled network.

This module owns that rule (`plain_tcp_problem`, and `refusal`, its one-line
message naming both ways out) and the loopback test (`is_loopback`); a shard applies it to its bind addresses
(`paramserver.server.config`, `paramserver.ops.cli`), a client to its
`connect` and to every endpoint a welcome names (`paramserver.client`).
The decision is pure given the addresses a name resolves to; only a host
name (not an IP address) is looked up, through `resolve`.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence

LOCAL_SCHEMES = ("ipc://", "inproc://")
WILDCARDS = ("*", "0.0.0.0", "::", "")  # bind to every interface: never loopback
KEYS_COMMAND = "`diloco-server keys --out keys --islands NAME,...` writes them"

Resolver = Callable[[str], Sequence[str]]


def resolve(name: str) -> list[str]:
    """The addresses a host name resolves to.

    Args:
        name: a host name such as "localhost".

    Returns:
        The IP addresses (as text), [] when the name does not resolve.
    """
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    return [str(info[4][0]) for info in infos]


def endpoint_host(endpoint: str) -> str | None:
    """The host part of a ZeroMQ endpoint, or None for a local transport.

    Args:
        endpoint: tcp://[SOURCE;]HOST:PORT (an IPv6 host in brackets), ipc://...,
            inproc://..., or a bare host.

    Returns:
        HOST without brackets ("*" for every interface); None for ipc:// and
        inproc://; a string without a scheme is returned as it is.
    """
    if endpoint.startswith(LOCAL_SCHEMES):
        return None
    if not endpoint.startswith("tcp://"):
        return endpoint.strip()
    address = endpoint[len("tcp://") :].rsplit(";", 1)[-1]
    host = address.rpartition(":")[0] or address
    return host.strip("[]")


def _loopback_ip(text: str) -> bool | None:
    """Whether an IP address is loopback; None when `text` is not an IP address."""
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])  # fe80::1%eth0: the zone is not the ip
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    return ip.is_loopback


def is_loopback(host: str, resolver: Resolver = resolve) -> bool:
    """Whether a host is reachable from this machine only: a loopback address or such a name.

    Args:
        host: an IP address (IPv6 with or without brackets) or a host name.
        resolver: name -> its addresses (only called for a name, not an address).

    Returns:
        True for 127.0.0.0/8, ::1 and a name that resolves, only to those
        (``localhost``); False for wildcards (0.0.0.0, *, ::), any other
        address, and a name that does not resolve or resolves to any other address.
    """
    host = host.strip().strip("[]")
    if host in WILDCARDS:
        return False
    literal = _loopback_ip(host)
    if literal is not None:
        return literal
    addresses = list(resolver(host))
    return bool(addresses) and all(_loopback_ip(a) is True for a in addresses)


def plain_tcp_problem(
    address: str, *, curve: bool, insecure: bool, resolver: Resolver = resolve
) -> str | None:
    """Why plain TCP at `address` is refused, or None when it is allowed.

    Args:
        address: a bind host ("0.0.0.0") or an endpoint (tcp://HOST:PORT, ipc://, inproc://).
        curve: whether the connection speaks CURVE (then anything is allowed).
        insecure: the operator's explicit permission for plain TCP anywhere.
        resolver: name -> its addresses (see `is_loopback`).

    Returns:
        None for CURVE, `insecure`, a local transport or a loopback host; else a
        phrase naming the host, e.g. "plain TCP on 0.0.0.0, which is not a
        loopback address" (the caller adds what is at risk and the ways out).
    """
    if curve or insecure:
        return None
    host = endpoint_host(address)
    if host is None or is_loopback(host, resolver):
        return None
    return f"plain TCP on {host or address}, which is not a loopback address"


def refusal(
    address: str,
    *,
    curve: bool,
    insecure: bool,
    risk: str,
    keys: str,
    opt_out: str,
    resolver: Resolver = resolve,
) -> str | None:
    """The one-line refusal of plain TCP at `address`, in one side's words; None when allowed.

    Args:
        address: as for `plain_tcp_problem`.
        curve: whether the connection speaks CURVE.
        insecure: the operator's explicit permission for plain TCP anywhere.
        risk: what plain TCP there would allow, e.g. "anyone who reaches the port may push".
        keys: the CURVE settings to give, e.g. "--curve-secret-key-file and --curve-allow-dir".
        opt_out: the explicit opt-out, e.g. "--insecure".
        resolver: name -> its addresses (see `is_loopback`).

    Returns:
        "PROBLEM: without CURVE RISK; give KEYS (`diloco-server keys ...` writes
        them), or OPT_OUT on a trusted, firewalled network", or None.
    """
    problem = plain_tcp_problem(address, curve=curve, insecure=insecure, resolver=resolver)
    if problem is None:
        return None
    return (
        f"{problem}: without CURVE {risk}; give {keys} ({KEYS_COMMAND}), or {opt_out} on a "
        "trusted, firewalled network"
    )
