"""Several bulk flows against one on window-limited connections: a join and a round of pushes.

    python -m bench.flows [--links 3] [--fragments 6] [--fragment-mib 2]
                          [--window-kib 64] [--one-way-ms 20]
    diloco-bench flows ...

One shard serves in a thread of this process (async mode, `--fragments`
fragments of `--fragment-mib` MiB of float32 each, fsync off); our client
reaches it through `bench.window_relay.WindowRelay`, which lets each TCP
connection hold at most `--window-kib` KiB towards the shard, each chunk
delivered `--one-way-ms` later: one connection is then one flow whose window
is below its link's bandwidth-delay product (at most window / delay bytes a
second), the case of issue 31 where one TCP flow does not fill a long fat
pipe. The relay is that emulation, not a shaped link: this kernel has no
netem.

For `bulk_links` 1 and then `--links` (`ClientConfig.bulk_links`, a control
DEALER beside them; docs/protocol.md section 1), a fresh shard and client:
the join (the client is the first island, so it uploads the initial values
in init pieces) and one round (a raw float32 push per fragment, all in
flight at once; from the first push to the last ack) are timed. Prints one
JSON object: the inputs, per run the join and round seconds, the round's
bytes and MB/s, the client's and the shard's counters (acked, duplicates,
re-sends, reconnects; accepted) and the bytes each relayed connection
carried towards the shard; the speed-up of `--links` over 1 (round and
join, same run), and the load average before and after. A line on stderr
after each join and round.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

import codec
from bench import child
from bench.window_relay import WindowRelay
from paramserver.client import Client, ClientConfig
from paramserver.client.shards import MAX_BULK_LINKS
from paramserver.plumbing import ports
from paramserver.server.config import ShardConfig
from paramserver.server.shard import ShardServer

POLL_S = 0.02  # how often the round's wait looks at the acks
START_TIMEOUT_S = 60.0  # the shard's start


class FlowsBenchError(RuntimeError):
    """A run did not finish: the shard did not start, or acks did not come within the bound."""

    def __init__(self, what: str, bulk_links: int) -> None:
        super().__init__(f"bulk_links={bulk_links}: {what}")
        self.what = what
        self.bulk_links = bulk_links


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's flags."""
    parser.add_argument("--links", type=int, default=3, help="bulk_links compared against 1")
    parser.add_argument("--fragments", type=int, default=6, help="fragments (one push each)")
    parser.add_argument(
        "--fragment-mib", type=float, default=2.0, help="each fragment's float32 size (MiB)"
    )
    parser.add_argument(
        "--window-kib", type=int, default=64, help="bytes in flight per connection (KiB)"
    )
    parser.add_argument("--one-way-ms", type=float, default=20.0, help="delay added each way")
    parser.add_argument(
        "--timeout-s", type=float, default=300.0, help="bound on each run's join and round"
    )


def _say(line: str) -> None:
    """One progress line on stderr."""
    print(f"flows: {line}", file=sys.stderr, flush=True)


class _Shard:
    """A ShardServer serving in a thread; `stop` ends it and re-raises what ended it early."""

    def __init__(self, cfg: ShardConfig, advertised: str, bulk_links: int) -> None:
        pub = f"tcp://127.0.0.1:{ports.free_base_port(1)}"
        self.server = ShardServer(cfg, 0, [(advertised, pub)], "tcp://127.0.0.1:*", pub)
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="flows-shard", daemon=True)
        self.thread.start()
        ready = self.server.ready.wait(START_TIMEOUT_S)
        if self.error is not None or not ready or self.server.bound_endpoints is None:
            self.stop()
            raise FlowsBenchError(f"the shard did not start: {self.error or 'timeout'}", bulk_links)
        self.router_port = int(self.server.bound_endpoints[0].rsplit(":", 1)[1])

    def _run(self) -> None:
        try:
            self.server.serve(self.stop_event)
        except BaseException as exc:  # reported by __init__
            self.error = exc
            self.server.ready.set()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(START_TIMEOUT_S)


def run_once(
    bulk_links: int,
    fragments: int,
    fragment_values: int,
    window_bytes: int,
    one_way_s: float,
    timeout_s: float,
) -> dict[str, Any]:
    """One fresh shard, relay and client: the join and one round of pushes, timed.

    Args:
        bulk_links: `ClientConfig.bulk_links`.
        fragments: fragments of the model (one push each).
        fragment_values: float32 values per fragment.
        window_bytes: the relay's cap per connection towards the shard.
        one_way_s: the relay's delay each way.
        timeout_s: bound on the join and on the round's acks, each.

    Returns:
        The run's figures (see the module docstring).

    Raises:
        FlowsBenchError: the shard did not start or the acks did not come in time.
    """
    round_bytes = fragments * fragment_values * 4
    with (
        tempfile.TemporaryDirectory(prefix="flows-bench-") as tmp,
        WindowRelay(window_bytes, one_way_s) as relay,
    ):
        cfg = ShardConfig(
            data_dir=tmp, fsync=False, mode="async", fragments=fragments,
            heartbeat_interval_s=1.0, liveness=30, downlink="float32",
            max_message_bytes=max(64 << 20, 2 * fragment_values * 4),
        )  # fmt: skip
        shard = _Shard(cfg, relay.endpoint, bulk_links)
        client = None
        try:
            relay.serve(("127.0.0.1", shard.router_port))
            client = Client(
                ClientConfig(
                    connect=relay.endpoint,
                    island="flows",
                    bulk_links=bulk_links,
                    ack_timeout_s=timeout_s,
                    ack_timeout_cap_s=2 * timeout_s,
                    join_timeout_s=timeout_s,
                    keep="versions",
                )  # fmt: skip
            )
            values = np.zeros((fragments, fragment_values), np.float32)
            start = time.monotonic()
            joined = client.join({"w": values})
            join_s = time.monotonic() - start
            _say(f"bulk_links={bulk_links}: joined in {join_s:.2f} s")
            delta = np.full(fragment_values, 0.001, np.float32)
            frames, _ = codec.raw("float32").encode({"delta": delta})
            start = time.monotonic()
            for frag in joined.plan.fragments:
                client.push(frag.index, 1, joined.versions[frag.index], 100, 1, frames)
            deadline = start + timeout_s
            while client.stats()["acked"] < fragments:
                if time.monotonic() > deadline:
                    raise FlowsBenchError(f"not every push acked within {timeout_s} s", bulk_links)
                time.sleep(POLL_S)
            round_s = time.monotonic() - start
            _say(f"bulk_links={bulk_links}: round of {fragments} pushes in {round_s:.2f} s")
            stats = client.stats()
        finally:
            if client is not None:
                client.close(flush_timeout_s=1.0)
            shard.stop()
        counters = shard.server.state.counters if shard.server.state is not None else None
        flows = relay.flow_bytes()
    return {
        "bulk_links": bulk_links,
        "join_s": round(join_s, 3),
        "round_s": round(round_s, 3),
        "round_bytes": round_bytes,
        "round_MB_per_s": round(round_bytes / 1e6 / round_s, 2),
        "client": {
            k: stats[k]
            for k in (
                "pushes",
                "acked",
                "duplicates",
                "resent",
                "spurious_resends",
                "reconnects",
                "rejected",
                "bytes_sent",
            )
        },  # fmt: skip
        "shard": {
            "accepted": counters.accepted if counters else None,
            "duplicates": counters.duplicates if counters else None,
        },
        "connections": len(flows),
        "bytes_up_per_connection": [f.up for f in flows],
    }


def measure(
    links: int,
    fragments: int,
    fragment_values: int,
    window_bytes: int,
    one_way_s: float,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """`run_once` with bulk_links 1, then `links`; the speed-up and the load around them.

    Args:
        links: the bulk_links compared against 1.
        fragments: fragments of the model (one push each).
        fragment_values: float32 values per fragment.
        window_bytes: the relay's cap per connection towards the shard.
        one_way_s: the relay's delay each way.
        timeout_s: bound on each run's join and round.

    Returns:
        The report (see the module docstring).
    """
    load_before = os.getloadavg()
    runs = [
        run_once(n, fragments, fragment_values, window_bytes, one_way_s, timeout_s)
        for n in (1, links)
    ]
    one, many = runs
    return {
        "window_bytes": window_bytes,
        "one_way_s": one_way_s,
        "flow_cap_MB_per_s": round(window_bytes / one_way_s / 1e6, 3),
        "fragments": fragments,
        "fragment_bytes": fragment_values * 4,
        "links": links,
        "runs": runs,
        "speedup": {
            "round": round(one["round_s"] / many["round_s"], 2),
            "join": round(one["join_s"] / many["join_s"], 2),
        },
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }


def run(args: argparse.Namespace) -> int:
    """Run the bench; print the JSON report (exit 2 with one line on a flag out of range)."""
    if not 1 <= args.links <= MAX_BULK_LINKS or args.fragments < 1 or args.window_kib < 1:
        print(
            f"python -m bench.flows: --links must be 1-{MAX_BULK_LINKS}, --fragments and "
            "--window-kib at least 1",
            file=sys.stderr,
        )
        return 2
    values = max(1, int(args.fragment_mib * (1 << 20) / 4))
    report = measure(
        args.links, args.fragments, values, args.window_kib * 1024,
        args.one_way_ms / 1000.0, args.timeout_s,
    )  # fmt: skip
    print(json.dumps(report, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point for `python -m bench.flows`."""
    parser = argparse.ArgumentParser(prog="python -m bench.flows", description=__doc__)
    add_arguments(parser)
    child.sigterm_unwinds()  # the shard, the relay and the client close as on Ctrl-C
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
