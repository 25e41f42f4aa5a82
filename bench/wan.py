"""WAN emulation for the benchmarks: a shaped link between every island and the hub (shards, reducer).

Preferred ("netns"): one network namespace per island, joined to a bridge in
the root namespace by a veth pair; a `tc tbf` qdisc on each end limits that
island's uplink and downlink to `rate_mbit`. Islands run inside their
namespace (`prefix(i)`), shards and the DDP reducer stay on loopback in the
root namespace and are reached through `bench.children.relay`, which listens on the
bridge address and adds the one-way latency (`netem` is not available).

Fallback ("relay"): where namespaces cannot be made (not root, no `ip`), the
relay listens on loopback and also limits each direction of each connection
to `rate_mbit`. `describe()` says which was used.

Everything created here is removed again on exit, also after errors, Ctrl-C
and SIGTERM (the report turns SIGTERM into SystemExit).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from bench import child

logger = logging.getLogger(__name__)


class WanError(RuntimeError):
    """The emulated link could not be set up; the message says which step failed."""


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """One island's link to the hub."""

    rate_mbit: float = 5.0  # per direction
    delay_ms: float = 25.0  # one way (added by bench.children.relay)


def _sh(*argv: str) -> None:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise WanError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")


def tbf_args(dev: str, rate_mbit: float) -> list[str]:
    """The `tc` command that caps egress of `dev` at `rate_mbit`.

    Args:
        dev: interface name.
        rate_mbit: rate in Mbit/s.

    Returns:
        argv for subprocess (burst: 10 ms at the rate, at least 16 KiB; queue: 200 ms).
    """
    burst = max(16 * 1024, int(rate_mbit * 1e6 / 8 * 0.01))
    return [
        "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
        "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "200ms",
    ]  # fmt: skip


class Wan:
    """Shaped links for `islands` islands; a context manager that always cleans up."""

    def __init__(self, islands: int, link: LinkSpec, force_relay: bool = False) -> None:
        """Nothing is created before `__enter__`.

        Args:
            islands: number of island links.
            link: rate and latency of each link.
            force_relay: skip namespaces and shape in the relay.
        """
        self.islands = islands
        self.link = link
        self.force_relay = force_relay
        pid = os.getpid()
        self.tag = f"dd{pid % 100000}"
        self.subnet = f"10.{200 + pid % 50}.{(pid // 50) % 250}"
        self.mode = "relay"
        self.hub = "127.0.0.1"
        self.fallback_reason = ""
        self._namespaces: list[str] = []
        self._bridge: str | None = None

    def _setup_netns(self) -> None:
        if shutil.which("ip") is None or shutil.which("tc") is None:
            raise WanError("ip/tc not found")
        if os.geteuid() != 0:
            raise WanError("not root")
        bridge = f"{self.tag}br"
        _sh("ip", "link", "add", bridge, "type", "bridge")
        self._bridge = bridge
        _sh("ip", "addr", "add", f"{self.subnet}.1/24", "dev", bridge)
        _sh("ip", "link", "set", bridge, "up")
        for i in range(self.islands):
            ns, host_end, island_end = f"{self.tag}n{i}", f"{self.tag}h{i}", f"{self.tag}i{i}"
            _sh("ip", "netns", "add", ns)
            self._namespaces.append(ns)
            _sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", island_end)
            _sh("ip", "link", "set", island_end, "netns", ns)
            _sh("ip", "link", "set", host_end, "master", bridge)
            _sh("ip", "link", "set", host_end, "up")
            inside = ("ip", "netns", "exec", ns)
            _sh(*inside, "ip", "addr", "add", f"{self.subnet}.{i + 2}/24", "dev", island_end)
            _sh(*inside, "ip", "link", "set", island_end, "up")
            _sh(*inside, "ip", "link", "set", "lo", "up")
            _sh(*tbf_args(host_end, self.link.rate_mbit))  # downlink: hub -> island
            _sh(*inside, *tbf_args(island_end, self.link.rate_mbit))  # uplink
        self.mode = "netns"
        self.hub = f"{self.subnet}.1"

    def cleanup(self) -> None:
        """Remove every namespace and the bridge this object made (idempotent)."""
        for ns in self._namespaces:  # deleting a namespace deletes its veth and the peer
            with contextlib.suppress(WanError, subprocess.TimeoutExpired):
                _sh("ip", "netns", "del", ns)
        self._namespaces = []
        if self._bridge is not None:
            with contextlib.suppress(WanError, subprocess.TimeoutExpired):
                _sh("ip", "link", "del", self._bridge)
            self._bridge = None

    def __enter__(self) -> Wan:
        atexit.register(self.cleanup)
        if not self.force_relay:
            try:
                self._setup_netns()
            except (WanError, OSError, subprocess.TimeoutExpired) as exc:
                self.cleanup()
                self.fallback_reason = str(exc)
                logger.warning("network namespaces unavailable (%s): shaping in the relay", exc)
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
        atexit.unregister(self.cleanup)

    def prefix(self, island: int) -> tuple[str, ...]:
        """The argv prefix that runs a command on island `island`'s side of its link.

        Args:
            island: island index.

        Returns:
            ("ip", "netns", "exec", NS) in netns mode, () in relay mode.
        """
        if self.mode == "netns":
            return ("ip", "netns", "exec", self._namespaces[island])
        return ()

    @property
    def relay_rate_mbit(self) -> float:
        """Rate the relay must enforce itself (0 when the kernel shapes)."""
        return 0.0 if self.mode == "netns" else self.link.rate_mbit

    def describe(self) -> dict[str, Any]:
        """What the JSON output records about the link.

        Returns:
            dict: shaping used, mode, rate per direction, one-way delay (and why it fell back).
        """
        return {
            "shaping": "netns+tbf (kernel), latency in bench.children.relay"
            if self.mode == "netns"
            else "bench.children.relay token bucket per connection and direction, latency in bench.children.relay",
            "mode": self.mode,
            "rate_mbit_per_direction": self.link.rate_mbit,
            "one_way_delay_ms": self.link.delay_ms,
            **({"fallback_reason": self.fallback_reason} if self.fallback_reason else {}),
        }

    @contextlib.contextmanager
    def relay(self, targets: dict[int, int]) -> Iterator[None]:
        """Run `bench.children.relay`: hub:listen -> 127.0.0.1:target for each item, with this link's latency.

        Args:
            targets: listen port on the hub -> target port on loopback.

        Yields:
            Once the relay listens; stops it on exit.
        """
        argv = [sys.executable, "-m", "bench.children.relay", "--delay-ms", str(self.link.delay_ms)]
        argv += ["--rate-mbit", str(self.relay_rate_mbit)]
        for listen, target in targets.items():
            argv += ["--pair", f"{self.hub}:{listen}=127.0.0.1:{target}"]
        try:
            relay = child.start(argv, "relay")
        except child.LaunchError as exc:
            raise WanError(str(exc)) from None
        try:
            yield
        finally:
            relay.stop(10.0)
