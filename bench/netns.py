"""The regions bench's topology: a network namespace per region, joined through a WAN namespace.

Layout of one run with prefix P (names are unique to the run; nothing is
made in the root namespace):

    P-r0 ... P-rN   one namespace per region. Region i owns 10.9.i.2/24 on
                    its veth end `Pr{i}`, routes everything through the WAN
                    namespace (10.9.i.1), and holds its service address
                    10.9.100.i on its loopback: its daemons bind 0.0.0.0 and
                    advertise the service address, which every region reaches
                    (region i itself locally, the others over the WAN).
    P-wan           the WAN namespace: the other veth end of every region
                    (`Pw{i}`), every region's service address on its
                    loopback, and one relay process per region
                    (`bench.children.wan_relay`: delay, jitter, loss) that
                    listens on that region's service address, tells the link
                    by the client's source address and connects on into the
                    region from the client region's service address. IP
                    forwarding stays off: regions reach each other only
                    through the relays.

Rates: on the WAN end of each region's veth (traffic towards that region) an
`htb` qdisc has one class per link of that region, chosen by source address
(the other region's service address, which the relays use in both
directions), so each direction of each link is shaped once, by the kernel,
and the connections of one link share its rate. The `netem`-free kernel here
cannot delay; the relays do.

Cleanup: before it creates anything, a run writes a state file
(`STATE_DIR/P.json`: its pid and start time). Everything the run makes lives
in namespaces named `P-*`; `cleanup_prefix(P)` stops the processes inside
them (`ip netns pids`), deletes them (which deletes their veths) and the
state file. `Topology` does it on exit; `stale_prefixes` finds the runs whose
owner is gone (kill -9), so the next run or `--cleanup` removes their
leftovers, and only theirs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import child

STATE_DIR = Path("/run/diloco-regions")
PREFIX_START = "drg"
BASE = "10.9"
PROBE_PORT = 5201
WORKDIR_START = "diloco-regions-"
_SENT = re.compile(r"Sent (\d+) bytes")


class NetnsError(RuntimeError):
    """A step of building or removing the topology failed; the message says which."""


@dataclasses.dataclass(frozen=True)
class LinkShape:
    """One region pair's emulated link as the kernel and the relay apply it."""

    a: int
    b: int
    mbit: float  # per direction, after scaling
    rtt_ms: float
    jitter_ms: float = 0.0
    loss: float = 0.0


def sh(*argv: str, timeout_s: float = 30.0) -> str:
    """Run a command; its stdout.

    Raises:
        NetnsError: it failed (the message holds the command and its stderr).
    """
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(argv)}: {exc}") from None
    if proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def can_build() -> str:
    """Why this process cannot build namespaces ('' when it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs the ip and tc commands (iproute2)"
    try:
        sh("ip", "netns", "list")
    except NetnsError as exc:
        return f"ip netns does not work here: {exc}"
    return ""


def new_prefix() -> str:
    """A fresh run prefix: 'drg' + 3 random hex digits, not in use by any namespace."""
    used = namespaces()
    while True:
        prefix = PREFIX_START + secrets.token_hex(2)[:3]
        if not any(ns.startswith(prefix + "-") for ns in used) and not state_file(prefix).exists():
            return prefix


def state_file(prefix: str) -> Path:
    """Where run `prefix` records its owner."""
    return STATE_DIR / f"{prefix}.json"


def namespaces() -> list[str]:
    """Names of every named network namespace."""
    return [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]


def region_ns(prefix: str, i: int) -> str:
    """Namespace of region i."""
    return f"{prefix}-r{i}"


def wan_ns(prefix: str) -> str:
    """The WAN namespace."""
    return f"{prefix}-wan"


def region_address(i: int) -> str:
    """Region i's own address (its shards and probe listen here)."""
    return f"{BASE}.{i}.2"


def service_address(i: int) -> str:
    """Region i's service address: what its daemons advertise; the same from every region."""
    return f"{BASE}.100.{i}"


def _start_time(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def owner_alive(state: dict[str, Any]) -> bool:
    """Whether the process that wrote a state file still runs (pid and start time match)."""
    pid = int(state.get("pid", 0))
    return pid > 0 and _start_time(pid) == state.get("start_time")


def stale_prefixes() -> list[str]:
    """Prefixes of runs whose owner is gone but whose state file (and maybe namespaces) remain."""
    found = []
    for path in sorted(STATE_DIR.glob(f"{PREFIX_START}*.json")):
        try:
            state = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not owner_alive(state):
            found.append(path.stem)
    return found


def _running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (an exited child nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _stop_pids(pids: list[int], grace_s: float = 5.0) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _running(p)]
        if pids:
            time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def cleanup_prefix(prefix: str) -> list[str]:
    """Remove everything run `prefix` made: processes in its namespaces, the namespaces, its work dir.

    Only namespaces named `prefix-*` are touched, and only when the prefix is
    a regions prefix; the veths go with their namespaces; the work dir the
    state file names is removed only if it is a `diloco-regions-*` directory
    of the temporary directory, as `Topology` makes it.

    Args:
        prefix: the run's prefix.

    Returns:
        The namespaces deleted.
    """
    if not prefix.startswith(PREFIX_START) or "-" in prefix:
        raise NetnsError(f"{prefix!r} is not a regions prefix ({PREFIX_START}...)")
    ours = [ns for ns in namespaces() if ns.startswith(prefix + "-")]
    pids: list[int] = []
    for ns in ours:
        with contextlib.suppress(NetnsError):
            pids += [int(p) for p in sh("ip", "netns", "pids", ns).split()]
    pids = [p for p in pids if p != os.getpid()]
    _stop_pids(pids)
    for ns in ours:
        with contextlib.suppress(NetnsError):
            sh("ip", "netns", "del", ns)
    with contextlib.suppress(OSError, json.JSONDecodeError, KeyError):
        workdir = Path(json.loads(state_file(prefix).read_text())["workdir"])
        # only the run's own temporary directory, where Topology made it
        if workdir.parent == Path(tempfile.gettempdir()) and workdir.name.startswith(WORKDIR_START):
            shutil.rmtree(workdir, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        state_file(prefix).unlink()
    return ours


def htb_rate(mbit: float) -> list[str]:
    """htb class arguments for `mbit` (ceil = rate; burst 10 ms at the rate, at least 16 KiB)."""
    burst = max(16 * 1024, int(mbit * 1e6 / 8 * 0.01))
    return ["rate", f"{mbit}mbit", "ceil", f"{mbit}mbit", "burst", str(burst), "cburst", str(burst)]


def _in_ns(ns: str, *argv: str) -> tuple[str, ...]:
    return ("ip", "netns", "exec", ns, *argv)


def _pdeathsig() -> tuple[str, ...]:
    # a helper dies with the bench even when the bench is killed with -9
    return ("setpriv", "--pdeathsig", "TERM") if shutil.which("setpriv") else ()


class Topology:
    """Regions, the WAN namespace, shaped links and their relays; a context manager that cleans up.

    Nothing is created before `__enter__`; `__exit__` (and `cleanup`) removes it all.
    """

    def __init__(
        self,
        regions: int,
        links: list[LinkShape],
        ports: list[int],
        prefix: str | None = None,
        loss_penalty_ms: float = 200.0,
        queue_ms: float = 0.0,
    ) -> None:
        """Args:
        regions: number of regions.
        links: one per region pair that talks (both directions share it).
        ports: TCP ports the relays forward (the probe's is added).
        prefix: the run's name prefix (default: a fresh one).
        loss_penalty_ms: stall of a stream per emulated lost packet.
        queue_ms: the bottleneck's buffer, in milliseconds at the link's rate (a
            `bfifo` under each link's htb class, at least 16 KiB; e.g. one RTT:
            the classic router buffer of one bandwidth-delay product); 0 = the
            kernel's default FIFO (the veth's txqueuelen, 1000 packets: about
            1.2 s at 10 Mbit/s, a bloated buffer). This kernel has no fair
            queueing qdisc (fq_codel, sfq), so every connection of a link shares
            its one FIFO.
        """
        self.regions = regions
        self.links = list(links)
        self.ports = sorted({PROBE_PORT, *ports})
        self.prefix = prefix
        self.loss_penalty_ms = loss_penalty_ms
        self.queue_ms = queue_ms
        self.relays: list[child.Child] = []
        self._probe_servers: list[child.Child] = []
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.workdir = Path()  # relay configs, counters, the run's data dirs (from __enter__)

    # ---- building
    def __enter__(self) -> Topology:
        if self.prefix is None:
            self.prefix = new_prefix()
        elif state_file(self.prefix).exists() or any(
            ns.startswith(self.prefix + "-") for ns in namespaces()
        ):
            raise NetnsError(f"prefix {self.prefix} is in use (a live run, or --cleanup it)")
        self._tmp = tempfile.TemporaryDirectory(prefix=WORKDIR_START)
        self.workdir = Path(self._tmp.name)
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {
            "prefix": self.prefix,
            "pid": os.getpid(),
            "start_time": _start_time(os.getpid()),
            "workdir": str(self.workdir),
        }
        state_file(self.prefix).write_text(json.dumps(state))
        try:
            self._build()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def _build(self) -> None:
        p, wan = self.prefix, wan_ns(self.prefix)
        sh("ip", "netns", "add", wan)
        sh(*_in_ns(wan, "ip", "link", "set", "lo", "up"))
        for i in range(self.regions):
            ns = region_ns(p, i)
            sh("ip", "netns", "add", ns)
            sh(
                "ip",
                "-n",
                wan,
                "link",
                "add",
                f"{p}w{i}",
                "type",
                "veth",
                "peer",
                "name",
                f"{p}r{i}",
            )
            sh("ip", "-n", wan, "link", "set", f"{p}r{i}", "netns", ns)
            sh("ip", "-n", wan, "addr", "add", f"{BASE}.{i}.1/24", "dev", f"{p}w{i}")
            sh("ip", "-n", wan, "link", "set", f"{p}w{i}", "up")
            sh("ip", "-n", ns, "addr", "add", f"{region_address(i)}/24", "dev", f"{p}r{i}")
            sh("ip", "-n", ns, "link", "set", f"{p}r{i}", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "addr", "add", f"{service_address(i)}/32", "dev", "lo")
            sh("ip", "-n", wan, "addr", "add", f"{service_address(i)}/32", "dev", "lo")
            sh("ip", "-n", ns, "route", "add", "default", "via", f"{BASE}.{i}.1")
            sh("tc", "-n", wan, "qdisc", "add", "dev", f"{p}w{i}", "root", "handle", "1:", "htb")
        for k, link in enumerate(self.links):
            for towards, other in ((link.a, link.b), (link.b, link.a)):
                dev = f"{p}w{towards}"
                cls = f"1:{10 + k}"
                sh("tc", "-n", wan, "class", "add", "dev", dev, "parent", "1:", "classid", cls,
                   "htb", *htb_rate(link.mbit), "quantum", "60000")  # fmt: skip
                sh("tc", "-n", wan, "filter", "add", "dev", dev, "parent", "1:", "protocol",
                   "ip", "prio", "1", "u32", "match", "ip", "src", f"{service_address(other)}/32",
                   "flowid", cls)  # fmt: skip
                if self.queue_ms > 0:
                    limit = max(16 * 1024, int(link.mbit * 1e6 / 8 * self.queue_ms / 1000))
                    sh("tc", "-n", wan, "qdisc", "add", "dev", dev, "parent", cls, "handle",
                       f"{100 + k}:", "bfifo", "limit", str(limit))  # fmt: skip
        for region in range(self.regions):
            self._start_relay(region)

    def _start_relay(self, region: int) -> None:
        peers = {}
        for k, link in enumerate(self.links):
            if region not in (link.a, link.b):
                continue
            other = link.b if region == link.a else link.a
            peers[region_address(other)] = {
                "bind": service_address(other),
                "one_way_ms": link.rtt_ms / 2,
                "jitter_ms": min(link.jitter_ms, link.rtt_ms / 2),
                "loss": link.loss,
                "loss_penalty_ms": self.loss_penalty_ms,
                "seed": 1000 * k + 10 * region + other,
            }
        if not peers:
            return
        config = self.workdir / f"relay{region}.json"
        config.write_text(
            json.dumps(
                {
                    "listen": service_address(region),
                    "target": region_address(region),
                    "ports": self.ports,
                    "peers": peers,
                }
            )
        )
        stats = self.workdir / f"relay{region}.stats.json"
        argv = _in_ns(
            wan_ns(self.prefix),
            *_pdeathsig(),
            *child.module_argv("bench.children.wan_relay", "--config", str(config)),
            "--stats",
            str(stats),
        )
        self.relays.append(child.start(argv, f"wan relay into region {region}"))

    def set_rates(self, mbit: dict[tuple[int, int], float]) -> None:
        """Change links' rates in place (their htb classes).

        Args:
            mbit: (a, b) of a link -> its new rate.
        """
        for k, link in enumerate(self.links):
            if (link.a, link.b) not in mbit:
                continue
            rate = mbit[(link.a, link.b)]
            for towards in (link.a, link.b):
                sh("tc", "-n", wan_ns(self.prefix), "class", "change", "dev",
                   f"{self.prefix}w{towards}", "parent", "1:", "classid", f"1:{10 + k}",
                   "htb", *htb_rate(rate), "quantum", "60000")  # fmt: skip
            self.links[k] = dataclasses.replace(link, mbit=rate)

    def class_bytes(self) -> dict[tuple[int, int], int]:
        """Bytes each link's htb class has sent so far, per direction (the kernel's counters).

        Returns:
            (towards, from) region pair -> bytes sent towards `towards` on the
            link between the two (whole frames, as htb counts them).
        """
        out: dict[tuple[int, int], int] = {}
        for k, link in enumerate(self.links):
            for towards, other in ((link.a, link.b), (link.b, link.a)):
                text = sh("tc", "-n", wan_ns(self.prefix), "-s", "class", "show", "dev",
                          f"{self.prefix}w{towards}", "classid", f"1:{10 + k}")  # fmt: skip
                match = _SENT.search(text)
                out[(towards, other)] = int(match.group(1)) if match else 0
        return out

    def set_region_down(self, region: int, down: bool) -> None:
        """Partition a region from the WAN (its veth's WAN end down), or restore it.

        Its connections stay open and retransmit; the kernel restores the
        end's connected route when it comes up again, and the htb qdisc stays.

        Args:
            region: the region.
            down: True to cut it off, False to restore it.
        """
        sh("ip", "-n", wan_ns(self.prefix), "link", "set", f"{self.prefix}w{region}",
           "down" if down else "up")  # fmt: skip

    # ---- running things in it
    def prefix_argv(self, region: int) -> tuple[str, ...]:
        """The argv prefix that runs a command inside region `region` (dies with the bench)."""
        return (*_in_ns(region_ns(self.prefix, region)), *_pdeathsig())

    @staticmethod
    def address(region: int) -> str:
        """The address any region connects to for a port of region `region` (its service address)."""
        return service_address(region)

    def probe(self, link: LinkShape, seconds: float, pings: int) -> dict[str, float]:
        """Measure one link with `bench.children.link_probe`, from region a to region b.

        Args:
            link: the link.
            seconds: streaming time at the link's rate (the probe sends rate x seconds bytes).
            pings: pings timed.

        Returns:
            The probe's figures (rtt_ms_median, mbit_s, ...).

        Raises:
            NetnsError: the probe failed.
        """
        self.start_probe_servers()
        argv = (
            *self.prefix_argv(link.a),
            *child.module_argv(
                "bench.children.link_probe", "measure", "--host", service_address(link.b),
                "--port", str(PROBE_PORT), "--bytes", str(int(link.mbit * 1e6 / 8 * seconds)),
                "--pings", str(pings),
            ),
        )  # fmt: skip
        out = sh(*argv, timeout_s=10 * seconds + pings * (link.rtt_ms + 500) / 1000 + 30)
        return json.loads(out.strip().splitlines()[-1])

    def start_probe_servers(self) -> None:
        """Start a `link_probe serve` in every region (once)."""
        if self._probe_servers:
            return
        for i in range(self.regions):
            argv = (
                *self.prefix_argv(i),
                *child.module_argv(
                    "bench.children.link_probe", "serve", "--host", "0.0.0.0",
                    "--port", str(PROBE_PORT),
                ),
            )  # fmt: skip
            self._probe_servers.append(child.start(argv, f"probe server {i}"))

    def probe_together(self, seconds: float) -> list[dict[str, float]]:
        """Stream over every link at once (what the relays and the CPUs carry together).

        Args:
            seconds: streaming time at each link's rate.

        Returns:
            One probe result per link, in `links` order (one ping each).
        """
        self.start_probe_servers()
        with concurrent.futures.ThreadPoolExecutor(len(self.links)) as pool:
            return list(pool.map(lambda link: self.probe(link, seconds, 1), self.links))

    def relay_stats(self) -> dict[int, dict[str, Any]]:
        """The relays' byte counters (after `stop_relays`): region -> its relay's counters."""
        out = {}
        for region in range(self.regions):
            path = self.workdir / f"relay{region}.stats.json"
            if path.exists():
                out[region] = json.loads(path.read_text())
        return out

    def stop_relays(self) -> None:
        """Stop the relays and probe servers (they write their counters)."""
        for helper in [*self._probe_servers, *self.relays]:
            helper.terminate()
        for helper in [*self._probe_servers, *self.relays]:
            helper.wait_or_kill(10.0)
        self._probe_servers, self.relays = [], []

    def cleanup(self) -> None:
        """Stop every helper and delete every namespace of this run (idempotent)."""
        with contextlib.suppress(Exception):
            self.stop_relays()
        if self.prefix is not None and state_file(self.prefix).exists():
            try:
                cleanup_prefix(self.prefix)
            except NetnsError as exc:
                print(f"regions: cleanup of {self.prefix}: {exc}", file=sys.stderr)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
