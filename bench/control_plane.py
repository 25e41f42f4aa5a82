"""The control plane under a bulk push on a thin, long link: one shared connection against two.

    diloco-bench control-plane [--mbit 10] [--rtt-ms 80] [--mbytes 24] [--beat-s 0.1]

Two regions in network namespaces (`bench.netns`: an htb rate per link, the
round trip added by `bench.children.wan_relay`): a shard in region 0, an
island in region 1 (`bench.children.control_probe`). The shard is
initialised from its own region (the values cross no thin link); then the
island pushes one raw float32 delta of `--mbytes` twice, once with its
heartbeats on the push's own connection (`--links 1`, one DEALER: what a
single-connection island does) and once on a control connection of their
own (`--links 2`: the push on a bulk DEALER attached to the island,
docs/protocol.md section 1), and times every heartbeat sent while the push is
in flight. Then our own client (`bench.children.control_client`) pushes the
same delta with `ClientConfig.control_link` off and on, watched from the
shard's side (how long the shard did not hear the island, whether it counted
it live). Prints one JSON object: the probed link, then per mode the push's
seconds and Mbit/s and the heartbeats' round trips (p50, p99, max), then per
client mode the push's seconds (None: not acked within three times the
push's time at the link's rate plus 20 s), reconnects and the shard's view. Needs
root (it creates and deletes its own namespaces); without, it exits 2 with
one line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from bench import child, netns

ROUTER_PORT = 6110  # the shard's ROUTER (PUB on +1), inside region 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's flags."""
    parser.add_argument("--mbit", type=float, default=10.0, help="link rate per direction")
    parser.add_argument("--rtt-ms", type=float, default=80.0, help="round trip added by the relay")
    parser.add_argument("--mbytes", type=float, default=24.0, help="the push's size (MB)")
    parser.add_argument("--beat-s", type=float, default=0.1, help="heartbeat period in the push")
    parser.add_argument("--order", default="1,2", help="the modes (links) in the order run")
    parser.add_argument(
        "--clients", default="0,1",
        help="our client's runs, control_link off (0) and on (1), in order; '' = none",
    )  # fmt: skip
    parser.add_argument(
        "--queue-ms", type=float, default=-1.0,
        help="the bottleneck's FIFO in ms at the rate; -1 = one RTT (one BDP); 0 = the kernel's "
        "default (1000 packets)",
    )  # fmt: skip


def _shard_cmd(topo: netns.Topology, work: str, *argv: str) -> list[str]:
    return [*topo.prefix_argv(0), sys.executable, "-m", "paramserver.server.cli", *argv]


def measure(
    mbit: float,
    rtt_ms: float,
    mbytes: float,
    beat_s: float,
    order: list[int],
    queue_ms: float,
    clients: list[int] = (),
) -> dict:
    """Build the two regions, run the pushes, tear everything down.

    Args:
        mbit: the link's rate per direction.
        rtt_ms: the round trip the relay adds.
        mbytes: the push's size in MB (10^6 bytes).
        beat_s: heartbeat period while the push is in flight.
        order: the modes to run (1: one connection, 2: control + bulk).
        queue_ms: the bottleneck's buffer (`bench.netns.Topology`); 0: the kernel's default.
        clients: our client's runs: 0 = control_link off, 1 = on.

    Returns:
        The report (see the module docstring).

    Raises:
        NetnsError: a namespace, the shard or a probe failed.
    """
    params = max(1, int(mbytes * 1e6 / 4))
    link = netns.LinkShape(0, 1, mbit=mbit, rtt_ms=rtt_ms)
    with netns.Topology(2, [link], [ROUTER_PORT, ROUTER_PORT + 1], queue_ms=queue_ms) as topo:
        probed = topo.probe(link, seconds=2.0, pings=10)
        data = str(topo.workdir / "server")
        start = _shard_cmd(
            topo, data, "start", "--host", "0.0.0.0", "--port", str(ROUTER_PORT),
            "--data-dir", data, "--mode", "async", "--fragments", "1", "--insecure",
            "--detach", "--max-message-bytes", str(max(64 << 20, 8 * params)),
        )  # fmt: skip
        proc = subprocess.run(start, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise netns.NetnsError(f"the shard did not start: {proc.stderr.strip()[-300:]}")
        try:
            local = f"tcp://{topo.address(0)}:{ROUTER_PORT}"
            _probe(topo, 0, "init", local, params)
            remote = f"tcp://{topo.address(0)}:{ROUTER_PORT}"
            modes = {}
            for k, links in enumerate(order):
                modes[f"links_{links}"] = _probe(
                    topo, 1, "push", remote, params, "--links", str(links),
                    "--round", str(k + 1), "--beat-s", str(beat_s),
                )  # fmt: skip
            bound_s = 3 * mbytes * 8 / mbit + 20
            runs = {}
            for k, control in enumerate(clients):
                runs[f"control_link_{control}"] = _child(
                    topo, 1, "bench.children.control_client", "--connect", remote,
                    "--params", str(params), "--control-link", str(control),
                    "--round", str(len(order) + k + 1), "--timeout-s", str(bound_s),
                )  # fmt: skip
        finally:
            subprocess.run(
                _shard_cmd(topo, data, "stop", "--data-dir", f"{data}/shard-0", "--timeout", "30"),
                capture_output=True, timeout=60,
            )  # fmt: skip
    return {
        "prefix": topo.prefix,  # its namespaces are gone by now
        "link": {"mbit": mbit, "rtt_ms": rtt_ms, "queue_ms": queue_ms, "probed": probed},
        "push_mbytes": mbytes,
        "beat_s": beat_s,
        "modes": modes,
        "client": runs,
    }


def _probe(
    topo: netns.Topology, region: int, command: str, connect: str, params: int, *argv: str
) -> dict[str, Any]:
    return _child(
        topo, region, "bench.children.control_probe", command, "--connect", connect,
        "--params", str(params), *argv,
    )  # fmt: skip


def _child(topo: netns.Topology, region: int, module: str, *argv: str) -> dict[str, Any]:
    """Run a bench child in a region; its last stdout line as JSON."""
    cmd = [*topo.prefix_argv(region), *child.module_argv(module, *argv)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise netns.NetnsError(f"{module} {argv[0]}: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> int:
    """Run the bench; print the JSON report (exit 2 with one line when it cannot build)."""
    why = netns.can_build()
    if why:
        print(f"diloco-bench control-plane: {why}", file=sys.stderr)
        return 2
    order = [int(x) for x in args.order.split(",")]
    queue_ms = args.rtt_ms if args.queue_ms < 0 else args.queue_ms
    clients = [int(x) for x in args.clients.split(",") if x.strip()]
    report = measure(args.mbit, args.rtt_ms, args.mbytes, args.beat_s, order, queue_ms, clients)
    print(json.dumps(report, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point for `python -m bench.control_plane`."""
    parser = argparse.ArgumentParser(prog="python -m bench.control_plane", description=__doc__)
    add_arguments(parser)
    child.sigterm_unwinds()  # daemons stop as on Ctrl-C
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
